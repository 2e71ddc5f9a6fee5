"""PyTorch reference for the weight-only int4 linear layer: unpack and dequantize, then an fp32 matmul.

The layout (``engine/quantize.py`` writes it): a weight ``[N, K]`` in groups of :data:`GROUP` consecutive inputs
of a row (the last one padded with zeros), each group one fp16 scale and 32 signed 4-bit values ``q`` in
``[-8, 7]``, ``w = q * scale``. ``packed [N, G * 16]`` uint8 holds a group in 16 bytes: byte ``j`` has
``q[j] + 8`` in its low nibble and ``q[j + 16] + 8`` in its high one, so the low nibbles of a group's bytes are its
first 16 values and the high nibbles the next 16, both in order. ``scale [N, G]`` fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 32  # inputs sharing one scale
GROUP_BYTES = GROUP // 2


def groups_of(k: int) -> int:
    """The groups a row of ``k`` inputs takes (the last one padded)."""
    return -(-k // GROUP)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``packed [N, G * 16]`` uint8 -> ``q [N, G * 32]`` int8 in ``[-8, 7]``, in the weight's order."""
    nibbles = packed.view(packed.shape[0], packed.shape[1] // GROUP_BYTES, GROUP_BYTES)
    low, high = nibbles & 15, nibbles >> 4
    return (torch.cat([low, high], dim=-1).to(torch.int8) - 8).reshape(packed.shape[0], packed.shape[1] * 2)


def pack(q: torch.Tensor) -> torch.Tensor:
    """``q [N, G * 32]`` (integers in ``[-8, 7]``) -> ``packed [N, G * 16]`` uint8: the inverse of :func:`unpack`."""
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8).view(q.shape[0], q.shape[1] // GROUP, GROUP)
    return (nibbles[..., :GROUP_BYTES] | (nibbles[..., GROUP_BYTES:] << 4)).reshape(q.shape[0], q.shape[1] // 2)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 weight ``[N, k]``: ``q * scale`` of each group (fp32 products of exact values, one rounding)."""
    q = unpack(packed).float().view(*scale.shape, GROUP)
    return (q * scale.float()[..., None]).reshape(packed.shape[0], scale.shape[1] * GROUP)[:, :k]


def int4_linear_ref(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` computed in fp32 and rounded once to ``x``'s dtype, where ``W`` is
    ``dequantize(packed, scale)`` rounded to ``x``'s dtype: the weights a model of that dtype would hold (and the
    kernels' bf16 products can take exactly)."""
    weight = dequantize(packed, scale, x.shape[-1]).to(x.dtype).float()
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)
