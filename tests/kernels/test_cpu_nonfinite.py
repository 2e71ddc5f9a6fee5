"""NaN and infinities through the fused CPU kernels, against their PyTorch references: a NaN stays NaN where the
reference has one (a broken checkpoint or an overflow stays visible, not turned into finite numbers), infinities go
where the reference takes them, and the finite values among them agree. The extension is built with -ffast-math,
whose vector max/min in ``fast_exp``'s clamp took NaN as -87 (``sigmoid(NaN)`` was 1) and whose compares may drop a
NaN (``clamp(NaN)``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.engine.models.lattice import orthonormal_columns
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.causal_conv1d.naive import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.diag_linear_scan import diag_log_scan
from rnnserve.kernels.diag_linear_scan.naive import diag_linear_scan_ref
from rnnserve.kernels.gated_act import gated_act
from rnnserve.kernels.gated_act.naive import gated_act_ref
from rnnserve.kernels.gated_rms_norm import gated_rms_norm
from rnnserve.kernels.gated_rms_norm.naive import gated_rms_norm_ref
from rnnserve.kernels.lattice import lattice_varlen
from rnnserve.kernels.lattice.naive import lattice_varlen_ref
from rnnserve.kernels.mamba2_decode import mamba2_mixer_step
from rnnserve.kernels.mamba2_decode.naive import mamba2_mixer_step_ref
from rnnserve.kernels.min_rnn_step import min_rnn_scan, min_rnn_step
from rnnserve.kernels.min_rnn_step.naive import min_rnn_step_ref
from rnnserve.kernels.rg_lru import rg_lru_scan, rg_lru_step
from rnnserve.kernels.rg_lru.naive import rg_lru_coefficients, rg_lru_step_ref
from rnnserve.kernels.selective_scan import selective_scan_varlen, selective_state_update
from rnnserve.kernels.selective_scan.naive import selective_scan_ref, selective_state_update_ref
from tests.kernels.kernel_cases import cu_seqlens_of, record_op_calls

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")

NAN, INF = float("nan"), float("inf")
SPECIALS = torch.tensor([NAN, -NAN, INF, -INF])
NANS = torch.tensor([NAN, -NAN])
DTYPES = [torch.float32, torch.bfloat16]


def with_specials(t: torch.Tensor, count: int, seed: int, values: torch.Tensor = SPECIALS) -> torch.Tensor:
    """``t`` with ``count`` entries (a different one each) set to ``values`` in turn: NaN of both signs and
    ``±inf``, or NaN only."""
    g = torch.Generator().manual_seed(seed)
    flat = t.clone().reshape(-1)
    at = torch.randperm(flat.numel(), generator=g)[:count]
    flat[at] = values.repeat(count // len(values) + 1)[:count].to(t.dtype)
    return flat.view(t.shape)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """NaN exactly where the reference has NaN (some), the same infinities, the finite values within ``tol``."""
    got, expected = got.float(), expected.float()
    assert expected.isnan().any(), "the case never reaches a NaN: it tests nothing"
    assert torch.equal(got.isnan(), expected.isnan()), (
        f"NaN at {got.isnan().sum()} positions, the reference at {expected.isnan().sum()}"
    )
    infinite = expected.isinf()
    assert torch.equal(got.isinf(), infinite) and torch.equal(got[infinite], expected[infinite])
    finite = expected.isfinite()
    torch.testing.assert_close(got[finite], expected[finite], rtol=tol, atol=tol)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2**-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("gated", [False, True])
@torch.inference_mode()
def test_gated_act(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, activation: str, gated: bool) -> None:
    g = torch.Generator().manual_seed(0)
    gate = with_specials((torch.randn(5, 100, generator=g) * 30).to(dtype), 40, seed=1)
    up = torch.randn(5, 100, generator=g).to(dtype) if gated else None
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "gated_act")
    assert_matches(gated_act(gate, up, activation), gated_act_ref(gate, up, activation), tolerance(dtype))
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_causal_conv1d_with_silu(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    lengths = [7, 1, 40]
    x = with_specials((torch.randn(sum(lengths), 70, generator=g) * 20).to(dtype), 24, seed=3)
    weight, bias = torch.randn(70, 4, generator=g).to(dtype), torch.randn(70, generator=g).to(dtype)
    cu = cu_seqlens_of(lengths)
    y, _ = causal_conv1d_varlen(x, weight, bias, cu, silu=True)
    y_ref, _ = causal_conv1d_varlen_ref(x, weight, bias, cu)
    assert_matches(y, F.silu(y_ref.to(dtype)), tolerance(dtype))
    state = torch.randn(6, 70, 3, generator=g).to(dtype)
    expected_state = state.clone()[torch.tensor([4, 1, 2])]
    y = causal_conv1d_update(x[:3], state, weight, bias, torch.tensor([4, 1, 2]), silu=True)
    y_ref, _ = causal_conv1d_update_ref(x[:3], expected_state, weight, bias)
    assert_matches(y, F.silu(y_ref.to(dtype)), tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_gated_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    y = torch.randn(9, 64, generator=g).to(dtype)
    z = with_specials((torch.randn(9, 64, generator=g) * 30).to(dtype), 4, seed=5)
    weight = torch.rand(64, generator=g).to(dtype) + 0.5
    assert_matches(gated_rms_norm(y, z, weight, 4, 1e-5), gated_rms_norm_ref(y, z, weight, 4, 1e-5), tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("cell", "projections"), [("mingru", 2), ("minlstm", 3)])
@torch.inference_mode()
def test_min_rnn_step_and_scan(dtype: torch.dtype, cell: str, projections: int) -> None:
    g = torch.Generator().manual_seed(6)
    dim, lengths = 40, [9, 1, 30]
    proj = (torch.randn(sum(lengths), projections * dim, generator=g) * 12).to(dtype)
    proj = with_specials(proj, 60, seed=7, values=NANS)
    h0 = torch.rand(len(lengths), dim, generator=g)
    # The step on the first token of each sequence, then the whole scan against the reference token by token.
    firsts = cu_seqlens_of(lengths)[:-1]
    pool = h0.clone()
    h = min_rnn_step(proj[firsts].contiguous(), pool, torch.arange(len(lengths)), cell)
    assert_matches(h, min_rnn_step_ref(proj[firsts], h0.clone(), cell), tolerance(dtype))
    hidden, final = min_rnn_scan(proj, cu_seqlens_of(lengths), h0, cell)
    state, expected = h0.clone(), []
    bounds = cu_seqlens_of(lengths).tolist()
    for b in range(len(lengths)):
        for t in range(bounds[b], bounds[b + 1]):
            state[b] = min_rnn_step_ref(proj[t : t + 1], state[b : b + 1], cell)[0]
            expected.append(state[b].clone())
    assert_matches(hidden, torch.stack(expected), 1e-5)
    assert_matches(final, state, 1e-5)


@torch.inference_mode()
def test_log_space_scan() -> None:
    """``exp`` of NaN gates and inputs (the scan's own exp: ``exp(-inf) = 0``, NaN stays NaN)."""
    g = torch.Generator().manual_seed(8)
    lengths = [5, 33]
    log_a = with_specials(-torch.rand(sum(lengths), 70, generator=g) * 100, 30, seed=9, values=NANS)
    log_b = with_specials(torch.randn(sum(lengths), 70, generator=g), 30, seed=10, values=NANS)
    h0 = torch.rand(len(lengths), 70, generator=g)
    cu = cu_seqlens_of(lengths)
    hidden, final = diag_log_scan(log_a, log_b, cu, h0)
    hidden_ref, final_ref = diag_linear_scan_ref(log_a.exp(), log_b.exp(), cu, h0)
    assert_matches(hidden, hidden_ref, 1e-5)
    assert_matches(final, final_ref, 1e-5)


def _selective_inputs(tokens: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    channels, d_state = 40, 16
    return {
        "x": with_specials(torch.randn(tokens, channels, generator=g).to(dtype), 6, seed=seed + 1, values=NANS),
        "dt": with_specials((torch.randn(tokens, channels, generator=g) * 10).to(dtype), 6, seed=seed + 2, values=NANS),
        "A": -torch.rand(channels, d_state, generator=g) * 4,
        "B": torch.randn(tokens, d_state, generator=g).to(dtype),
        "C": torch.randn(tokens, d_state, generator=g).to(dtype),
        "D": torch.randn(channels, generator=g),
        "z": with_specials((torch.randn(tokens, channels, generator=g) * 30).to(dtype), 6, seed=seed + 3),
        "dt_bias": torch.randn(channels, generator=g),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_selective_scan(dtype: torch.dtype) -> None:
    lengths = [3, 20]
    args = _selective_inputs(sum(lengths), dtype, seed=11)
    h0 = torch.randn(len(lengths), 40, 16, generator=torch.Generator().manual_seed(12))
    cu = cu_seqlens_of(lengths)
    y, final = selective_scan_varlen(**args, cu_seqlens=cu, initial_state=h0.clone(), dt_softplus=True)
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu, initial_state=h0.clone(), dt_softplus=True)
    assert_matches(y, y_ref, 1e-4)
    assert_matches(final, final_ref, 1e-4)
    pool = h0.clone()
    step = {name: t[:2] if t.shape[0] == sum(lengths) else t for name, t in args.items()}
    y = selective_state_update(pool, slice(None), **step, dt_softplus=True)
    y_ref, h_ref = selective_state_update_ref(h0.clone(), **step, dt_softplus=True)
    assert_matches(y, y_ref, 1e-4)
    assert_matches(pool, h_ref, 1e-4)


def _rg_lru_weights(dtype: torch.dtype, heads: int, width: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(13)
    return (
        (torch.randn(heads, width, width, generator=g) / width**0.5).to(dtype),
        (torch.randn(heads, width, generator=g) * 0.1).to(dtype),
        (torch.randn(heads, width, width, generator=g) / width**0.5).to(dtype),
        (torch.randn(heads, width, generator=g) * 0.1).to(dtype),
        torch.randn(heads * width, generator=g).to(dtype),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rg_lru(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(14)
    lengths, heads, width = [4, 25], 2, 16
    x = with_specials(torch.randn(sum(lengths), heads * width, generator=g).to(dtype), 3, seed=15, values=NANS)
    cu = cu_seqlens_of(lengths)
    first = torch.zeros(sum(lengths), dtype=torch.bool)
    first[cu[:-1]] = True
    h0 = torch.rand(len(lengths), heads * width, generator=g)
    weights = _rg_lru_weights(dtype, heads, width)
    h, final = rg_lru_scan(x, first, cu, h0.clone(), *weights)
    a, b = rg_lru_coefficients(x, first, *weights)
    h_ref, final_ref = diag_linear_scan_ref(a, b, cu, h0)
    assert_matches(h, h_ref, tolerance(dtype))
    assert_matches(final, final_ref, tolerance(dtype))
    x_step = with_specials(torch.randn(2, heads * width, generator=g).to(dtype), 4, seed=16, values=NANS)
    y = torch.randn(2, heads * width, generator=g).to(dtype)
    pool, expected_pool = h0.clone(), h0.clone()
    rows, step_first = torch.tensor([1, 0]), torch.tensor([False, True])
    out = rg_lru_step(x_step, y, step_first, *weights, pool, rows)
    out_ref = rg_lru_step_ref(x_step, y, step_first, *weights, expected_pool, rows)
    assert_matches(out, out_ref, tolerance(dtype))
    assert_matches(pool, expected_pool, 1e-5)


@torch.inference_mode()
def test_mamba2_step_keeps_a_nan_step_size() -> None:
    """``clamp(softplus(dt), dt_min, dt_max)`` of a NaN is NaN (the kernel's min/max took it as a limit)."""
    g = torch.Generator().manual_seed(16)
    heads, head_dim, d_state, batch = 4, 8, 16, 3
    d_inner = heads * head_dim
    dt_raw = torch.randn(batch, heads, generator=g) * 3
    dt_raw[0, 1], dt_raw[2, 3] = NAN, -NAN
    args = {
        "xbc": torch.randn(batch, d_inner + 2 * d_state, generator=g),
        "dt_raw": dt_raw,
        "z": torch.randn(batch, d_inner, generator=g),
        "pool": torch.randn(batch + 2, heads, head_dim, d_state, generator=g),
        "slot_ids": torch.tensor([4, 0, 2]),
        "dt_bias": torch.rand(heads, generator=g) - 3,
        "A_log": torch.rand(heads, generator=g),
        "D": torch.randn(heads, generator=g),
        "norm_weight": 1 + torch.randn(d_inner, generator=g) / 4,
        "groups": 1,
        "eps": 1e-5,
        "dt_min": 0.001,
        "dt_max": 0.1,
    }
    ref_args = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
    out = mamba2_mixer_step(**args)
    assert_matches(out, mamba2_mixer_step_ref(**ref_args), 1e-5)
    assert_matches(args["pool"], ref_args["pool"], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rg_lru_with_infinite_inputs(dtype: torch.dtype) -> None:
    """An infinite x drives its input gate's pre-activation to -inf, where torch's sigmoid is 0 and ``x i`` is
    inf * 0 = NaN; the kernel's sigmoid(-inf) was 1 / (1 + e^88), which kept ``x i`` infinite."""
    g = torch.Generator().manual_seed(17)
    lengths, heads, width = [5, 15], 2, 16
    weights = _rg_lru_weights(dtype, heads, width)
    cu = cu_seqlens_of(lengths)
    first = torch.zeros(sum(lengths), dtype=torch.bool)
    first[cu[:-1]] = True
    for seed in range(6):
        x = with_specials(torch.randn(sum(lengths), heads * width, generator=g).to(dtype), 3, seed=seed,
                          values=torch.tensor([INF, -INF]))  # fmt: skip
        h0 = torch.rand(len(lengths), heads * width, generator=g)
        h, final = rg_lru_scan(x, first, cu, h0.clone(), *weights)
        a, b = rg_lru_coefficients(x, first, *weights)
        h_ref, final_ref = diag_linear_scan_ref(a, b, cu, h0)
        assert_matches(h, h_ref, tolerance(dtype))
        assert_matches(final, final_ref, tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_silu_of_large_negative_numbers_is_zero(dtype: torch.dtype) -> None:
    """F.silu is 0 below about -88 (its exp(-x) is inf there): the kernels' x / (1 + e^88), with fast_exp's clamp,
    grew with |x| (-2 at -3.3e38), which an up projection or the gated norm's y then scaled up."""
    g = torch.Generator().manual_seed(18)
    gate = torch.randn(4, 100, generator=g) * 4
    gate[:, ::7] = -torch.logspace(2, 38.5, 15)[None, :]
    gate[0, 3], gate[1, 3] = -INF, NAN
    gate = gate.to(dtype)
    up = torch.randn(4, 100, generator=g).mul(1e30).to(dtype)
    assert_matches(gated_act(gate, up, "silu"), gated_act_ref(gate, up, "silu"), tolerance(dtype))
    z = gate[:, :64].contiguous()
    y = up[:, :64].contiguous()
    weight = torch.rand(64, generator=g).to(dtype) + 0.5
    assert_matches(gated_rms_norm(y, z, weight, 4, 1e-5), gated_rms_norm_ref(y, z, weight, 4, 1e-5), tolerance(dtype))


@pytest.mark.parametrize("variant", ["dec", "enc", "sim"])
@pytest.mark.parametrize("forget", [False, True])
@torch.inference_mode()
def test_lattice_keeps_a_column_whose_update_is_not_finite(variant: str, forget: bool) -> None:
    """An infinite v, k or step size makes a column's normalised update NaN (inf - inf); the reference's
    ``where(|u| > 0, u / |u|, s)`` then keeps the column, as for an update that vanished. The kernel's test,
    ``!(|u|^2 > 0)``, was compiled as ``|u|^2 <= 0`` under -ffast-math, and the NaN went into the state."""
    gen = torch.Generator().manual_seed(19)
    lengths, heads, d, m = [3, 9], 2, 12, 6
    total = sum(lengths)
    for name in ["q", "k", "v", "gamma"]:
        inputs = {
            "q": torch.randn(total, heads, m, generator=gen),
            "k": torch.randn(total, heads, m, generator=gen),
            "v": torch.randn(total, heads, d, generator=gen),
            "gamma": torch.rand(total, heads, generator=gen),
            "mu": torch.rand(total, heads, generator=gen) if forget else None,
        }
        inputs[name] = with_specials(inputs[name], 2, seed=20, values=torch.tensor([INF, -INF]))
        pool = orthonormal_columns(5, heads, d, m, generator=gen)
        slots, cu = torch.tensor([3, 1]), cu_seqlens_of(lengths)
        expected_pool = pool.clone()
        expected = lattice_varlen_ref(*inputs.values(), cu, expected_pool, slots, variant, True)
        y = lattice_varlen(*inputs.values(), cu, pool, slots, variant, True)
        for got, want in ((y, expected), (pool, expected_pool)):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), name
            finite = want.isfinite()
            torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
