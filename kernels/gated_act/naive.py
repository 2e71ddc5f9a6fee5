"""Reference for a gated activation, ``act(gate) * up`` (GeGLU, SwiGLU, an output gate), or the activation
alone: each op in the inputs' dtype, rounded as PyTorch rounds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "gelu": F.gelu}


def gated_act_ref(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """``activation(gate) * up`` (``activation(gate)`` without ``up``) for ``activation`` in :data:`ACTIVATIONS`."""
    out = ACTIVATIONS[activation](gate)
    return out if up is None else out * up
