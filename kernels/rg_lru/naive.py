"""PyTorch reference for the RG-LRU (Griffin / Hawk): its recurrence coefficients and one decode step.

Per channel, with ``W_a``, ``W_x`` block-diagonal (one ``[w, w]`` block per head)::

    r = sigmoid(x W_a + b_a);  i = sigmoid(x W_x + b_x)
    log_a = -8 r softplus(param);  a = exp(log_a)
    b = (x i) sqrt(1 - a^2)        # the factor is 1 at a sequence's first token, where a = 0
    h = a h + b

Every op runs in ``x``'s dtype as the Hugging Face model runs it (each result rounded); ``a`` and ``b`` are
returned in fp32 for the scan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.diag_linear_scan import diag_scan_step


def gate_preactivation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x W + b`` with ``W [H, w, w]`` block-diagonal over ``x [N, H * w]``, as ``[N, H, w]`` (a transposed view of
    the batched product)."""
    heads, width, _ = weight.shape
    blocks = x.reshape(-1, heads, width).transpose(0, 1)
    return torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1)


def block_diagonal_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x W + b)`` with ``W [H, w, w]`` block-diagonal over ``x [N, H * w]``."""
    return torch.sigmoid(gate_preactivation(x, weight, bias).reshape(x.shape))


def rg_lru_coefficients(
    x: torch.Tensor,
    first: torch.Tensor,
    input_gate_weight: torch.Tensor,
    input_gate_bias: torch.Tensor,
    recurrent_gate_weight: torch.Tensor,
    recurrent_gate_bias: torch.Tensor,
    recurrent_param: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` (the conv's output), ``first [N]`` (the token starts its sequence) -> ``(a, b)`` in fp32."""
    input_gate = block_diagonal_gate(x, input_gate_weight, input_gate_bias)
    recurrent_gate = block_diagonal_gate(x, recurrent_gate_weight, recurrent_gate_bias)
    log_a = -8.0 * recurrent_gate * F.softplus(recurrent_param)
    multiplier = torch.where(first[:, None], 1.0, torch.sqrt(1 - torch.exp(2 * log_a)))
    b = (x * input_gate) * multiplier.to(x.dtype)
    a = torch.where(first[:, None], 0.0, torch.exp(log_a))
    return a.float(), b.float()


def rg_lru_step_ref(
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
    """One decode step: advances ``pool[slot_ids]`` (``[N, D]`` fp32) in place and returns ``h * y`` in ``x``'s
    dtype (``y [B, D]``: the recurrent block's other branch, ``gelu_tanh(linear_y(x))``)."""
    a, b = rg_lru_coefficients(
        x, first, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias, recurrent_param
    )
    return diag_scan_step(a, b, pool, slot_ids).to(x.dtype) * y
