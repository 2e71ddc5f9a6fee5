"""The RG-LRU of Griffin / Hawk (RecurrentGemma): recurrence coefficients and the decode step.

``naive.py`` holds the reference (the Hugging Face model's ops, each rounding in the activations' dtype), which
the model's prefill uses for the coefficients (its scan is :mod:`rnnserve.kernels.diag_linear_scan`) and every
device but a GPU uses for the decode step. ``fused_recurrent.py``: the decode step as one Triton kernel
(gates, coefficients, in-place state update, output gate) instead of about twenty launches.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.rg_lru.naive import rg_lru_coefficients, rg_lru_step_ref


def rg_lru_step(
    x: torch.Tensor,
    y: torch.Tensor,
    first: torch.Tensor,
    input_gate_weight: torch.Tensor,
    input_gate_bias: torch.Tensor,
    recurrent_gate_weight: torch.Tensor,
    recurrent_gate_bias: torch.Tensor,
    recurrent_param: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """One decode step on ``pool[slot_ids]`` in place -> ``h * y`` (see
    :func:`~rnnserve.kernels.rg_lru.naive.rg_lru_step_ref`): the Triton kernel on a GPU, else the reference."""
    args = (x, y, first, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias,
            recurrent_param, pool, slot_ids)  # fmt: skip
    if use_triton(x) and pool.stride(-1) == 1:
        from rnnserve.kernels.rg_lru.fused_recurrent import rg_lru_step_triton

        return rg_lru_step_triton(*args)
    return rg_lru_step_ref(*args)


__all__ = ["rg_lru_coefficients", "rg_lru_step"]
