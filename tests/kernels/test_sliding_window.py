"""Sliding-window attention over a ring: equals masked softmax attention restricted to the window, in chunks
or token by token; the Triton kernels (``TRITON_INTERPRET=1``) equal the reference."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.sliding_window import sliding_window_decode, sliding_window_prefill
from rnnserve.kernels.sliding_window.naive import sliding_window_decode_naive, sliding_window_prefill_naive
from rnnserve.kernels.sliding_window.torch_varlen import sliding_window_decode_sdpa
from tests.kernels.kernel_cases import record_op_calls

WINDOW = 8  # ring rows: a query sees 9 keys


def _sequences(lengths, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(n, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)) for n in lengths
    ]


def _direct(q, k, v, window, scale):
    """Whole-sequence softmax attention with query ``i`` restricted to keys ``i - window .. i``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q.float(), k) * scale
    i, j = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None, :]
    scores = scores.masked_fill(~((j <= i) & (j >= i - window)), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v)


def _pack(pieces):
    lengths = [p[0].shape[0] for p in pieces]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [torch.cat([p[i] for p in pieces]) for i in range(3)], cu


@pytest.mark.parametrize("chunk", [3, 8, 13, 100])
def test_chunked_prefill_equals_windowed_attention(chunk: int) -> None:
    seqs = _sequences([1, 5, 9, 30, 41])
    rings = torch.zeros(2, len(seqs), WINDOW, 2, 16)
    outs = [[] for _ in seqs]
    for start in range(0, 41, chunk):
        active = [i for i, s in enumerate(seqs) if start < s[0].shape[0]]
        (q, k, v), cu = _pack([tuple(t[start : start + chunk] for t in seqs[i]) for i in active])
        k_cache, v_cache = rings[0][active], rings[1][active]
        out = sliding_window_prefill_naive(q, k, v, cu, torch.tensor([start] * len(active)), k_cache, v_cache, 0.25)
        rings[0][active], rings[1][active] = k_cache, v_cache
        for row, i in enumerate(active):
            outs[i].append(out[cu[row] : cu[row + 1]])
    for seq, out in zip(seqs, outs, strict=True):
        torch.testing.assert_close(torch.cat(out), _direct(*seq, WINDOW, 0.25), atol=1e-5, rtol=1e-5)


def test_decode_equals_windowed_attention() -> None:
    seqs = _sequences([20, 20, 20], seed=1)
    k_pool, v_pool = torch.zeros(5, WINDOW, 2, 16), torch.zeros(5, WINDOW, 2, 16)
    slots = torch.tensor([4, 0, 2])
    steps = []
    for t in range(20):
        q, k, v = (torch.stack([s[i][t] for s in seqs]) for i in range(3))
        steps.append(sliding_window_decode_naive(q, k, v, torch.full((3,), t), k_pool, v_pool, slots, 0.25))
    for b, seq in enumerate(seqs):
        stepped = torch.stack([s[b] for s in steps])
        torch.testing.assert_close(stepped, _direct(*seq, WINDOW, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "dim"), [(torch.float32, 16), (torch.float16, 24), (torch.float32, 64)])
def test_triton_prefill_equals_reference(triton_on_cpu, dtype: torch.dtype, dim: int) -> None:
    seqs = _sequences([1, 4, 9, 40, 70, 2], dim=dim, dtype=dtype, seed=2)
    (q, k, v), cu = _pack(seqs)
    starts = torch.tensor([0, 3, 20, 0, 5, 100])
    g = torch.Generator().manual_seed(3)
    # The rings hold keys and values the model computed in the activation dtype.
    rings = [torch.randn(len(seqs), WINDOW, 2, dim, generator=g).to(dtype).float() for _ in range(2)]
    expected_rings = [r.clone() for r in rings]
    expected = sliding_window_prefill_naive(q, k, v, cu, starts, *expected_rings, dim**-0.5)
    got = sliding_window_prefill(q, k, v, cu, starts, *rings, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3  # 16-bit activations: probabilities rounded for p @ v
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    for a, b in zip(rings, expected_rings, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("ring_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "dim"), [(4, 16), (2, 24)])
def test_triton_prefill_bf16_equals_reference(triton_on_cpu, ring_dtype: torch.dtype, heads: int, dim: int) -> None:
    """bf16 activations (both products are bf16 tl.dots, the interpreter's patched as tests/kernels/interpreter_bf16.py
    says): ragged chunks continuing rings from several positions, query heads two to a key/value head and one each,
    a head dim padded to 32. ``q . k`` has exact products and fp32 sums; the one rounding off the fp32 reference is the
    probabilities' to bf16 for ``p @ v``, under one bf16 unit of the last place each (2^-7 relative: the
    interpreter truncates, a GPU rounds to nearest, half that), so an output, a weighted mean of values, is within
    2^-7 max |v| of the reference."""
    seqs = _sequences([1, 4, 9, 40, 70, 2], heads=heads, dim=dim, dtype=torch.bfloat16, seed=9)
    (q, k, v), cu = _pack(seqs)
    starts = torch.tensor([0, 3, 20, 0, 5, 100])
    g = torch.Generator().manual_seed(10)
    rings = [torch.randn(len(seqs), WINDOW, 2, dim, generator=g).to(torch.bfloat16).to(ring_dtype) for _ in range(2)]
    bound = 2**-7 * max(v.float().abs().max(), rings[1].float().abs().max()) + 1e-5
    expected_rings = [r.clone() for r in rings]
    expected = sliding_window_prefill_naive(q, k, v, cu, starts, *expected_rings, dim**-0.5)
    got = sliding_window_prefill(q, k, v, cu, starts, *rings, dim**-0.5)
    torch.testing.assert_close(got, expected, atol=bound, rtol=0)
    for a, b in zip(rings, expected_rings, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("window", [8, 5])
def test_triton_decode_equals_reference(triton_on_cpu, window: int) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(4, 4, 16, generator=g), torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    pools = [torch.randn(6, 3, window, 2, 16, generator=g) for _ in range(2)]  # 3 layers; layer 1 is used
    expected_pools = [p.clone() for p in pools]
    positions, slots = torch.tensor([0, 3, window, 50]), torch.tensor([5, 0, 2, 3])
    expected = sliding_window_decode_naive(q, k, v, positions, *(p[:, 1] for p in expected_pools), slots, 0.25)
    got = sliding_window_decode(q, k, v, positions, *(p[:, 1] for p in pools), slots, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(pools, expected_pools, strict=True):
        torch.testing.assert_close(a, b)


def test_public_prefill_off_triton_equals_windowed_attention() -> None:
    seqs = _sequences([12], seed=5)
    (q, k, v), cu = _pack(seqs)
    rings = torch.zeros(2, 1, WINDOW, 2, 16)
    with force_triton(False):
        out = sliding_window_prefill(q, k, v, cu, torch.tensor([0]), rings[0], rings[1], 0.25)
    torch.testing.assert_close(out, _direct(*seqs[0], WINDOW, 0.25), atol=1e-5, rtol=1e-5)
    assert torch.equal(rings[0][0, torch.arange(4, 12) % WINDOW], k[4:12])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_prefill_equals_reference(dtype: torch.dtype) -> None:
    """The prefill off Triton (one SDPA call per query block) == the reference: ragged chunks continuing rings
    from several positions, grouped heads, a chunk longer than a query block."""
    seqs = _sequences([1, 4, 9, 300, 2], dtype=dtype, seed=6)
    (q, k, v), cu = _pack(seqs)
    starts = torch.tensor([0, 3, 20, 5, 100])
    g = torch.Generator().manual_seed(7)
    rings = [torch.randn(len(seqs), WINDOW, 2, 16, generator=g) for _ in range(2)]
    expected_rings = [r.clone() for r in rings]
    expected = sliding_window_prefill_naive(q, k, v, cu, starts, *expected_rings, 0.25)
    with force_triton(False):
        got = sliding_window_prefill(q, k, v, cu, starts, *rings, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(rings, expected_rings, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 1), (3, 3)])
def test_fused_decode_equals_reference(heads: int, kv_heads: int) -> None:
    """The decode step off Triton (query heads folded onto their key/value head) == the reference: slots out of
    order, rings before and after wrapping, a first token."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(4, heads, 16, generator=g)
    k, v = torch.randn(4, kv_heads, 16, generator=g), torch.randn(4, kv_heads, 16, generator=g)
    pools = [torch.randn(6, 3, WINDOW, kv_heads, 16, generator=g).bfloat16() for _ in range(2)]
    expected_pools = [p.clone() for p in pools]
    positions, slots = torch.tensor([0, 3, WINDOW, 50]), torch.tensor([5, 0, 2, 3])
    expected = sliding_window_decode_naive(q, k, v, positions, *(p[:, 1] for p in expected_pools), slots, 0.25)
    with force_triton(False):
        got = sliding_window_decode_sdpa(q, k, v, positions, *(p[:, 1] for p in pools), slots, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(pools, expected_pools, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not cpu_ops(), reason="needs the fused CPU kernels")
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 1), (3, 3)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_equals_reference(
    heads: int, kv_heads: int, pool_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C++ decode step == the reference, through the public function: rings not yet full, full, wrapped,
    slots out of order in a multi-layer pool, bf16 activations and pools; the other rows stay as they were."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    positions, slots = torch.tensor([0, 3, WINDOW - 1, WINDOW, 50]), torch.tensor([5, 0, 2, 3, 6])
    q = torch.randn(5, heads, 16, generator=g).bfloat16()
    k, v = (torch.randn(5, kv_heads, 16, generator=g).bfloat16() for _ in range(2))
    pools = [torch.randn(7, 3, WINDOW, kv_heads, 16, generator=g).to(pool_dtype) for _ in range(2)]
    expected_pools = [p.clone() for p in pools]
    expected = sliding_window_decode_naive(q, k, v, positions, *(p[:, 1] for p in expected_pools), slots, 0.25)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "sliding_window_decode")
    with force_triton(False):
        got = sliding_window_decode(q, k, v, positions, *(p[:, 1] for p in pools), slots, 0.25)
    assert calls == [0.25] and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(pools, expected_pools, strict=True):
        assert torch.equal(a, b)
