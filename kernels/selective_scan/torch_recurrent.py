"""Mamba-1 decode step applied in place to a state pool, in PyTorch ops: the path when the C++ kernel does not
apply (any device)."""

from __future__ import annotations

import torch

from rnnserve.kernels.selective_scan.naive import discretise, gate_output


def selective_state_update_torch(
    state: torch.Tensor,
    slots: torch.Tensor | slice,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """Advance ``state[slots]`` (pool ``[N, Di, Ns]`` fp32, a strided view is fine) by one token.

    ``slots`` is a ``[B]`` index tensor or, when the batch occupies consecutive slots, a ``slice`` (then the
    update runs in place on the pool without a gather/scatter). ``x, dt, z [B, Di]`` (``dt`` before
    :func:`~rnnserve.kernels.selective_scan.naive.discretise`), ``B, C [B, Ns]``; returns ``y [B, Di]`` in fp32.
    """
    delta = discretise(dt, dt_bias, dt_softplus)
    decay = (delta[:, :, None] * A.float()).exp_()
    h = state[slots]
    h.mul_(decay).addcmul_((delta * x.float())[:, :, None], B.float()[:, None, :])
    if not isinstance(slots, slice):
        state[slots] = h
    y = torch.bmm(h, C.float()[:, :, None])[:, :, 0]
    return gate_output(y, x, D, z)
