"""The RG-LRU of Griffin / Hawk (RecurrentGemma): the prefill scan and the decode step.

``naive.py`` holds the reference (the Hugging Face model's ops, each rounding in the activations' dtype).
``fused_recurrent.py``: the decode step as one Triton kernel (gates, coefficients, in-place state update, output
gate) instead of about twenty launches; a GPU's prefill takes the reference's coefficients and the Triton scan of
:mod:`rnnserve.kernels.diag_linear_scan`. ``rg_lru_cpu.cpp``: both on CPU from the gates' pre-activations (ATen's
batched GEMMs), the coefficients with the reference's roundings computed where the scan and the step use them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.diag_linear_scan import diag_linear_scan
from rnnserve.kernels.rg_lru.naive import gate_preactivation, rg_lru_coefficients, rg_lru_step_ref


def _cpu_op_applies(x: torch.Tensor, state: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.stride(-1) == 1
        and state.dtype == torch.float32
        and state.stride(-1) == 1
        and not torch.is_grad_enabled()
        and use_cpu_kernel(x)
    )


def _cpu_gate_inputs(
    x: torch.Tensor,
    input_gate_weight: torch.Tensor,
    input_gate_bias: torch.Tensor,
    recurrent_gate_weight: torch.Tensor,
    recurrent_gate_bias: torch.Tensor,
    recurrent_param: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C++ ops' gate inputs: both pre-activations ``[N, H, w]`` and ``softplus(param)``, in ``x``'s dtype."""
    pre_i = gate_preactivation(x, input_gate_weight, input_gate_bias).to(x.dtype)
    pre_r = gate_preactivation(x, recurrent_gate_weight, recurrent_gate_bias).to(x.dtype)
    return pre_i, pre_r, F.softplus(recurrent_param).to(x.dtype).contiguous()


def rg_lru_scan(
    x: torch.Tensor,
    first: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    input_gate_weight: torch.Tensor,
    input_gate_bias: torch.Tensor,
    recurrent_gate_weight: torch.Tensor,
    recurrent_gate_bias: torch.Tensor,
    recurrent_param: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen prefill over ``x [T, D]`` (the conv's output; ``first [T]``: the token starts its sequence)
    from ``initial_state [B, D]`` (not written): ``(h [T, D], final_state [B, D])`` in fp32, the coefficients as
    :func:`~rnnserve.kernels.rg_lru.naive.rg_lru_coefficients` computes them."""
    weights = (input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias, recurrent_param)
    if _cpu_op_applies(x, initial_state):
        final = initial_state.float().contiguous().clone()
        h = torch.ops.rnnserve.rg_lru_scan(x, *_cpu_gate_inputs(x, *weights), first.bool().contiguous(),
                                           cu_seqlens.long().contiguous(), final)  # fmt: skip
        return h, final
    a, b = rg_lru_coefficients(x, first, *weights)
    return diag_linear_scan(a, b, cu_seqlens, initial_state)


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
    :func:`~rnnserve.kernels.rg_lru.naive.rg_lru_step_ref`): the Triton kernel on a GPU, the C++ op on CPU, else
    the reference."""
    weights = (input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias, recurrent_param)
    if use_triton(x) and pool.stride(-1) == 1:
        from rnnserve.kernels.rg_lru.fused_recurrent import rg_lru_step_triton

        return rg_lru_step_triton(x, y, first, *weights, pool, slot_ids)
    if _cpu_op_applies(x, pool) and y.dtype == x.dtype and y.stride(-1) == 1:
        return torch.ops.rnnserve.rg_lru_step(x, y, *_cpu_gate_inputs(x, *weights), first.bool().contiguous(), pool,
                                              slot_ids.long().contiguous())  # fmt: skip
    return rg_lru_step_ref(x, y, first, *weights, pool, slot_ids)


__all__ = ["rg_lru_coefficients", "rg_lru_scan", "rg_lru_step"]
