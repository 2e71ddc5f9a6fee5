"""Based's Taylor linear attention: the references agree with each other and with a direct quadratic form; the
PyTorch paths and the Triton kernels (``TRITON_INTERPRET=1``) equal the references."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.based import based_linear_attention_step, based_linear_attention_varlen
from rnnserve.kernels.based.naive import (
    based_quadratic_naive,
    based_recurrent_naive,
    based_step_naive,
    taylor_features,
)
from rnnserve.kernels.based.torch_recurrent import based_step_torch
from rnnserve.kernels.cpu_extension import cpu_ops
from tests.kernels.kernel_cases import record_op_calls

LENGTHS = [1, 5, 16, 17, 40, 3]


def _inputs(lengths, heads=2, f=16, dv=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, f, generator=g).to(dtype)
    k = torch.randn(total, heads, f, generator=g).to(dtype)
    v = torch.randn(total, heads, dv, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, cu


def _initial_state(batch, heads, f, dv, seed=1):
    """A state as left by a few random tokens (so ``z``'s constant feature is a positive count)."""
    q, k, v, cu = _inputs([7] * batch, heads, f, dv, seed=seed)
    _, s, z = based_recurrent_naive(q, k, v, cu, None, f**-0.5, 1e-6)
    return s, z


def test_feature_map_gives_the_taylor_kernel() -> None:
    q, k, _, _ = _inputs([9], f=16)
    phi = torch.einsum("thD,thD->th", taylor_features(q, 0.25), taylor_features(k, 0.25))
    s = (q * k).sum(-1) / 4
    torch.testing.assert_close(phi, 1 + s + s * s / 2)
    assert taylor_features(q, 0.25).shape[-1] == 1 + 16 + 256


def test_token_loop_equals_the_quadratic_form() -> None:
    q, k, v, cu = _inputs(LENGTHS)
    out, _, _ = based_recurrent_naive(q, k, v, cu, None, 0.25, 1e-12)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        torch.testing.assert_close(out[lo:hi], based_quadratic_naive(q[lo:hi], k[lo:hi], v[lo:hi], 0.25, 1e-12))


def _fla_naive_parallel_based():
    """fla's ``naive_parallel_based``, loaded from its file: fla 0.5.2's package ``__init__`` fails under Triton
    3.9 (an autotuner key), while the reference module needs only torch and einops."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("einops") is None:
        pytest.skip("fla (flash-linear-attention, a test-only reference) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "based" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_based_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_parallel_based


def test_quadratic_form_equals_fla_naive_parallel_based() -> None:
    """fla's reference (``[B, H, L, f]`` layout, ``s = q . k * f^-1/2``, eps 1e-6) when fla is installed."""
    naive_parallel_based = _fla_naive_parallel_based()
    q, k, v, _ = _inputs([33])
    expected = naive_parallel_based(*(t.transpose(0, 1)[None] for t in (q, k, v)), use_norm=True)[0].transpose(0, 1)
    torch.testing.assert_close(based_quadratic_naive(q, k, v, 0.25, 1e-6), expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_chunked_torch_path_equals_token_loop(chunk_size: int) -> None:
    q, k, v, cu = _inputs(LENGTHS)
    initial = _initial_state(len(LENGTHS), 2, 16, 24)
    expected = based_recurrent_naive(q, k, v, cu, initial, 0.25, 1e-6)
    with force_triton(False):
        got = based_linear_attention_varlen(q, k, v, cu, initial, 0.25, 1e-6, chunk_size)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[3, 0, 5], slice(1, 4)])
def test_torch_step_equals_reference(slots) -> None:
    q, k, v, _ = _inputs([3], seed=2)
    q, k, v = (t.reshape(3, *t.shape[1:]) for t in (q, k, v))
    s_pool, z_pool = _initial_state(6, 2, 16, 24)
    slot_ids = torch.tensor([3, 0, 5]) if isinstance(slots, list) else torch.arange(1, 4)
    s_ref, z_ref = s_pool.clone(), z_pool.clone()
    expected = based_step_naive(q, k, v, s_ref, z_ref, slot_ids, 0.25, 1e-6)
    got = based_step_torch(q, k, v, s_pool, z_pool, slots, 0.25, 1e-6)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(s_pool, s_ref)
    torch.testing.assert_close(z_pool, z_ref)


@pytest.mark.skipif(not cpu_ops(), reason="needs the fused CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_step_equals_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ step through the public function: a layer view of a 3-layer pool, slots out of order, 16-bit
    activations; the other layers stay untouched."""
    q, k, v, _ = _inputs([3], f=16, dv=24, dtype=dtype, seed=3)
    s_pool, z_pool = _initial_state(6, 2, 16, 24)
    s_view, z_view = torch.zeros(6, 3, 2, *s_pool.shape[2:]), torch.zeros(6, 3, 2, z_pool.shape[2])
    s_view[:, 1], z_view[:, 1] = s_pool, z_pool
    slot_ids = torch.tensor([4, 0, 2])
    s_ref, z_ref = s_pool.clone(), z_pool.clone()
    expected = based_step_naive(q, k, v, s_ref, z_ref, slot_ids, 0.25, 1e-6)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "based_decode_step")
    with force_triton(False):
        got = based_linear_attention_step(q, k, v, s_view[:, 1], z_view[:, 1], slot_ids, slot_ids, 0.25, 1e-6)
    assert calls == [1e-6] and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_view[:, 1], s_ref)
    torch.testing.assert_close(z_view[:, 1], z_ref)
    assert not s_view[:, 0].any() and not s_view[:, 2].any() and not z_view[:, 2].any()


@pytest.mark.parametrize(
    ("f", "dv", "dtype", "with_state"),
    [(16, 24, torch.float32, True), (16, 24, torch.float32, False), (8, 16, torch.float32, True),
     (16, 20, torch.float16, True), (16, 20, torch.bfloat16, True)],
)
def test_triton_chunk_equals_reference(triton_on_cpu, f: int, dv: int, dtype: torch.dtype, with_state: bool) -> None:
    """Ragged lengths around the 16-token chunk; value widths that do and do not fill the 16-channel blocks.
    16-bit inputs widen to fp32 exactly and every product is fp32 (broadcast and sum, no tl.dot), so each dtype
    meets the fp32 tolerance."""
    q, k, v, cu = _inputs([1, 16, 17, 35, 3], f=f, dv=dv, dtype=dtype)
    q, k = q / math.sqrt(2), k / math.sqrt(2)
    initial = _initial_state(5, 2, f, dv) if with_state else None
    expected = based_recurrent_naive(q, k, v, cu, initial, f**-0.5, 1e-6)
    got = based_linear_attention_varlen(q, k, v, cu, initial, f**-0.5, 1e-6)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("f", "dv"), [(16, 24), (8, 64)])
def test_triton_step_equals_reference(triton_on_cpu, f: int, dv: int) -> None:
    q, k, v, _ = _inputs([3], f=f, dv=dv, seed=2)
    s_pool, z_pool = _initial_state(6, 2, f, dv)
    s_view, z_view = torch.zeros(6, 3, 2, *s_pool.shape[2:]), torch.zeros(6, 3, 2, z_pool.shape[2])
    s_view[:, 1], z_view[:, 1] = s_pool, z_pool  # a strided per-layer view of a pool with 3 layers
    slot_ids = torch.tensor([4, 0, 2])
    s_ref, z_ref = s_pool.clone(), z_pool.clone()
    expected = based_step_naive(q, k, v, s_ref, z_ref, slot_ids, f**-0.5, 1e-6)
    got = based_linear_attention_step(q, k, v, s_view[:, 1], z_view[:, 1], slot_ids, slot_ids, f**-0.5, 1e-6)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_view[:, 1], s_ref)
    torch.testing.assert_close(z_view[:, 1], z_ref)
    assert not s_view[:, 0].any() and not s_view[:, 2].any()


@torch.inference_mode()
def test_based_model_with_triton_kernels_equals_reference_path(triton_on_cpu) -> None:
    """The tiny preset (feature dim 8, 8-key ring) through every Triton kernel == the CPU path: prefill in two
    chunks that straddle the ring, then decode steps; logits and every state tensor."""
    from rnnserve.engine.loader import build_random
    from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
    from rnnserve.engine.state_pool import StatePool

    model, _ = build_random("based-tiny", "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (3, 21, 12)]
    slots = [4, 0, 2]
    results = {}
    for triton in (False, True):
        pool = StatePool(model.state_spec(), 6)
        with force_triton(triton):
            model.prefill(PrefillBatch.build([p[:10] for p in prompts], slots), pool.tensors)
            rest = PrefillBatch.build([p[10:] for p in prompts[1:]], slots[1:], [10, 10])
            logits = [model.prefill(rest, pool.tensors)]
            for t in range(3):
                batch = DecodeBatch.build([t + 1, t + 2, t + 3], slots, [len(p) + t for p in prompts])
                logits.append(model.decode(batch, pool.tensors))
        results[triton] = (logits, pool.tensors)
    for a, b in zip(results[True][0], results[False][0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for name, tensor in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], tensor, atol=1e-4, rtol=1e-4)
