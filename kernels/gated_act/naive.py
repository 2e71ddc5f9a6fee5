"""Reference for a gated activation, ``act(gate) * up`` (GeGLU, SwiGLU): each op in the inputs' dtype, rounded
as PyTorch rounds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def gated_act_ref(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation(gate) * up`` for ``activation`` in :data:`ACTIVATIONS`."""
    return ACTIVATIONS[activation](gate) * up
