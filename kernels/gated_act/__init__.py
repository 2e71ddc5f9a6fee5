"""A gated activation, ``act(gate) * up``: the middle of a gated MLP (Gemma's GeGLU, SwiGLU) or an output gate;
or the activation alone (an MLP's GELU).

``naive.py`` is the reference (one or two PyTorch ops); ``gated_act_cpu.cpp`` does it in one pass on CPU, each
result rounded to the inputs' dtype as the reference rounds it.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.gated_act.naive import ACTIVATIONS, gated_act_ref

_KINDS = {name: index for index, name in enumerate(ACTIVATIONS)}


def _cpu_op_applies(gate: torch.Tensor, up: torch.Tensor | None) -> bool:
    return (
        gate.dim() == 2
        and gate.dtype in (torch.float32, torch.bfloat16)
        and gate.stride(-1) == 1
        and (up is None or (up.shape == gate.shape and up.dtype == gate.dtype and up.stride(-1) == 1))
        and not torch.is_grad_enabled()
        and use_cpu_kernel(gate)
    )


def gated_act(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """``activation(gate) * up``, or ``activation(gate)`` when ``up`` is None (``activation``: ``"gelu_tanh"``,
    ``"silu"`` or ``"gelu"``, the exact one), in the inputs' dtype: one fused pass on CPU, else the reference."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if _cpu_op_applies(gate, up):
        return torch.ops.rnnserve.gated_act(gate, up, _KINDS[activation])
    return gated_act_ref(gate, up, activation)


__all__ = ["gated_act"]
