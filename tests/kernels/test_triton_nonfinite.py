"""NaN, infinities and overflow through the Triton decode stacks, under the interpreter, against the op-by-op
references: NaN and infinities where the reference has them, the finite values among them close. The survey
behind these (docs/kernels.md, "Infinities and large finite values") placed each special value in each input,
weight and state in turn; these are the cases where a kernel differed."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels import test_mamba2_decode_triton as mamba2_cases
from tests.kernels import test_mamba_decode_triton as mamba1_cases


def assert_same_nonfinite(got: torch.Tensor, expected: torch.Tensor, tol: float, has_nan: bool = True) -> None:
    """NaN exactly where the reference has NaN (some, if ``has_nan``), the same infinities, the finite values
    within ``tol`` of the largest finite reference value (if any)."""
    got, expected = got.double(), expected.double()
    assert expected.isnan().any() == has_nan, "the case does not reach the reference's NaN it was written for"
    assert torch.equal(got.isnan(), expected.isnan()), (
        f"NaN at {int(got.isnan().sum())} positions, the reference at {int(expected.isnan().sum())}"
    )
    infinite = expected.isinf()
    assert torch.equal(got.isinf(), infinite) and torch.equal(got[infinite], expected[infinite])
    finite = expected.isfinite()
    if finite.any():
        scale = float(expected[finite].abs().max())
        torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=tol * scale)


def run_mamba_stack(args: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The Triton Mamba-1 decode stack on ``args`` (its pools updated in place) and the reference on copies of the
    pools: ``(out, expected, reference pools)``."""
    from rnnserve.kernels.mamba_decode.fused_recurrent import mamba_decode_stack_triton

    ref_pools = {name: args[name].clone() for name in ("conv_pool", "ssm_pool")}
    out = mamba_decode_stack_triton(args["normed"], args["stream"], args["norm_weights"], args["eps"], args["layers"],
                                    args["conv_pool"], args["ssm_pool"], args["slot_ids"])
    expected = mamba1_cases.reference_stack(args["normed"], args["stream"], args["norm_weights"], args["eps"],
                                            args["layers"], ref_pools["conv_pool"], ref_pools["ssm_pool"],
                                            args["slot_ids"])
    return out, expected, ref_pools


def run_mamba2_stack(args: dict, normed: torch.Tensor, stream: torch.Tensor, eps: float,
                     dt_limits: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The Triton Mamba-2 decode stack and its reference, as :func:`run_mamba_stack`."""
    from rnnserve.kernels.mamba2_decode.fused_recurrent import mamba2_decode_stack_triton

    ref_pools = {name: args[name].clone() for name in ("conv_pool", "ssm_pool")}
    out = mamba2_decode_stack_triton(normed, stream, args["norm_weights"], eps, args["layers"], args["conv_pool"],
                                     args["ssm_pool"], args["slot_ids"], mamba2_cases.GROUPS, eps, dt_limits)
    expected = mamba2_cases.reference_stack(normed, stream, args["norm_weights"], eps, args["layers"],
                                            ref_pools["conv_pool"], ref_pools["ssm_pool"], args["slot_ids"], dt_limits)
    return out, expected, ref_pools


@pytest.mark.parametrize("stream_dtype", [torch.float16, torch.float32])
@torch.inference_mode()
def test_mamba_stack_rounds_the_conv_output_before_its_silu(triton_on_cpu, monkeypatch, stream_dtype) -> None:
    """fp16 weights and an fp32 conv bias of -7e4 in two channels: the conv's output is -inf in fp16, and the
    op-by-op step's SiLU of it NaN, which reaches the SSM state and the output. The stack took the SiLU of the fp32
    conv output (-0 there) and rounded after it, so those channels stayed finite."""
    monkeypatch.setattr(mamba1_cases, "LAYERS", 1)
    args = mamba1_cases.stack_args(torch.float16, 2, True, stream_dtype)
    layer = list(args["layers"][0])
    layer[3][[5, 40]] = -7e4
    args["layers"][0] = tuple(layer)
    out, expected, ref_pools = run_mamba_stack(args)
    assert_same_nonfinite(args["ssm_pool"], ref_pools["ssm_pool"], 1e-2)
    assert_same_nonfinite(out, expected, 3e-2)


@pytest.mark.parametrize("dt_limits", [(0.0, math.inf), (1e-3, 0.05)])
@torch.inference_mode()
def test_mamba2_stack_keeps_a_nan_step_size(triton_on_cpu, monkeypatch, dt_limits) -> None:
    """A NaN in one head's ``dt_bias``: torch's clamp keeps the NaN step size, so the head's state and (through
    the group norm) the output are NaN. The stack's ``tl.maximum`` / ``tl.minimum`` took NaN as the lower bound,
    and the head kept its state and gave finite outputs."""
    monkeypatch.setattr(mamba2_cases, "LAYERS", 1)
    args = mamba2_cases.stack_args(torch.float32, 2, True)
    args["layers"][0][4][1] = float("nan")
    g = torch.Generator().manual_seed(9)
    normed, stream = (torch.randn(2, mamba2_cases.D_MODEL, generator=g) for _ in range(2))
    eps = 1e-5
    out, expected, ref_pools = run_mamba2_stack(args, normed, stream, eps, dt_limits)
    assert_same_nonfinite(args["ssm_pool"], ref_pools["ssm_pool"], 1e-4)
    assert_same_nonfinite(out, expected, 1e-4)


@torch.inference_mode()
def test_mamba2_stack_gates_y_by_silu_z_in_the_references_order(triton_on_cpu, monkeypatch) -> None:
    """An in_proj weight of 1e30 in a z row (channel 21) and in a C row: ``y`` and ``z`` of ~1e30. The reference
    gates ``y * silu(z)``; the stack computed ``(y * z) * sigmoid(z)``, whose ``y * z`` overflowed to inf, and the
    group norm (``inf * rsqrt(inf)``) made the output NaN where the reference's is finite."""
    monkeypatch.setattr(mamba2_cases, "LAYERS", 1)
    args = mamba2_cases.stack_args(torch.float32, 2, True)
    args["layers"][0][0][21, 13] = 1e30
    args["layers"][0][0][295, 24] = 1e30
    g = torch.Generator().manual_seed(99)
    normed, stream = (torch.randn(2, mamba2_cases.D_MODEL, generator=g) for _ in range(2))
    eps, dt_limits = 1e-5, (0.0, math.inf)
    out, expected, _ = run_mamba2_stack(args, normed, stream, eps, dt_limits)
    assert_same_nonfinite(out, expected, 1e-4, has_nan=False)


@torch.inference_mode()
def test_mamba_stack_gates_y_by_silu_z_in_the_references_order(triton_on_cpu, monkeypatch) -> None:
    """Channel 7's state rows of 1e30 and an in_proj bias of -1e30 on its ``z`` row: ``y`` ~ 1e30 and
    ``z`` = -1e30. The reference gates ``y * silu(z)`` = ``y * -0`` (0); the stack computed ``(y * z) * sigmoid(z)``,
    whose ``y * z`` overflowed, and ``inf * 0`` was NaN in that channel and, through out_proj, in every output."""
    monkeypatch.setattr(mamba1_cases, "LAYERS", 1)
    args = mamba1_cases.stack_args(torch.float32, 2, True, torch.float32)
    args["layers"][0][1][mamba1_cases.D_INNER + 7] = -1e30
    args["ssm_pool"][args["slot_ids"], 0, 7] = 1e30
    out, expected, _ = run_mamba_stack(args)
    assert_same_nonfinite(out, expected, 1e-4, has_nan=False)


@torch.inference_mode()
def test_ssd_prefill_keeps_a_nan_step_size_under_a_dt_limit(triton_on_cpu) -> None:
    """A NaN in one token's ``dt`` (sequence 1 of 3, head 2) with a ``dt_limit``: torch's clamp keeps it, so that
    head's outputs from the token on and its final state are NaN, and no other sequence's. The chunked prefill's
    ``tl.maximum`` / ``tl.minimum`` took NaN as the lower bound: a step of ``dt_min``, all finite."""
    from rnnserve.kernels.ssd.chunk import ssd_scan_varlen_triton
    from rnnserve.kernels.ssd.naive import discretize_dt, ssd_scan_ref
    from tests.kernels.kernel_cases import cu_seqlens_of

    lengths, heads, head_dim, groups, d_state = [5, 20, 3], 4, 16, 2, 16
    total = sum(lengths)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(total, heads, head_dim, generator=g)
    dt = torch.randn(total, heads, generator=g)
    A = -torch.rand(heads, generator=g) - 0.1
    B, C = (torch.randn(total, groups, d_state, generator=g) for _ in range(2))
    D, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    h0 = torch.randn(len(lengths), heads, head_dim, d_state, generator=g)
    dt[lengths[0] + 9, 2] = float("nan")
    cu, dt_limit = cu_seqlens_of(lengths), (1e-3, 0.5)
    y, final = ssd_scan_varlen_triton(x, dt, A, B, C, cu, D, h0, dt_bias=dt_bias, dt_softplus=True,
                                      dt_limit=dt_limit, chunk_size=16, block_m=16, block_k=16)
    y_ref, final_ref = ssd_scan_ref(x, discretize_dt(dt, dt_bias, True, dt_limit), A, B, C, cu, D, h0)
    assert_same_nonfinite(y, y_ref, 1e-4)
    assert_same_nonfinite(final, final_ref, 1e-4)


@torch.inference_mode()
def test_based_prefill_keeps_a_nan_value_from_earlier_tokens(triton_on_cpu) -> None:
    """A NaN in one token's ``v`` (sequence 1 of 3, the 6th of its 16-token chunk): the reference's recurrence
    makes that token's and the later tokens' outputs NaN in those channels, the earlier ones stay finite, and so
    does every other sequence. The chunk kernel's ``a @ v`` multiplied the masked (zero) weights of the later
    token by NaN, which made the earlier rows of the chunk NaN too."""
    from rnnserve.kernels.based.chunk import based_chunk_triton
    from rnnserve.kernels.based.naive import based_recurrent_naive
    from tests.kernels.kernel_cases import cu_seqlens_of

    lengths, heads, f, dv = [3, 20, 5], 2, 4, 8
    total, features = sum(lengths), 1 + f + f * f
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(total, heads, f, generator=g) for _ in range(2))
    v = torch.randn(total, heads, dv, generator=g)
    state = (torch.randn(len(lengths), heads, features, dv, generator=g),
             torch.rand(len(lengths), heads, features, generator=g) * 5 + 1)
    v[lengths[0] + 5, 1, 3] = float("nan")
    cu = cu_seqlens_of(lengths)
    out, s_final, z_final = based_chunk_triton(q, k, v, cu, state, 0.5, 1e-6)
    expected, s_ref, z_ref = based_recurrent_naive(q, k, v, cu, state, 0.5, 1e-6)
    assert_same_nonfinite(out, expected, 1e-4)
    assert_same_nonfinite(s_final, s_ref, 1e-4)
    assert_same_nonfinite(z_final, z_ref, 1e-4, has_nan=False)
