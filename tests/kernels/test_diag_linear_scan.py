"""Triton chunked scan and fused decode step == the PyTorch reference (interpreter, small sizes)."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.diag_linear_scan import diag_linear_scan, diag_log_scan, diag_scan_step
from rnnserve.kernels.diag_linear_scan.naive import diag_linear_scan_ref, diag_log_scan_ref, diag_scan_step_ref
from tests.kernels.kernel_cases import LENGTHS, cu_seqlens_of, record_op_calls, slot_ids_for

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")

DIM = 24  # not a power of two: exercises the channel mask


def _inputs(log_space: bool, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    k = torch.randn(total, DIM, generator=gen)
    v = torch.randn(total, DIM, generator=gen)
    if log_space:
        a, b = -torch.nn.functional.softplus(k), -torch.nn.functional.softplus(-k) + 0.3 * v
    else:
        a, b = torch.sigmoid(k), v
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize(
    "log_space, dtype, chunk_size",
    [
        (True, torch.float32, 16),
        (True, torch.bfloat16, 32),
        (False, torch.float32, 32),
        (False, torch.bfloat16, 16),
    ],
)
def test_varlen_scan_matches_reference(triton_on_cpu, log_space, dtype, chunk_size):
    a, b = _inputs(log_space, dtype)
    cu = cu_seqlens_of(LENGTHS)
    h0 = torch.rand(len(LENGTHS), DIM) + 0.1
    h0[1] = 0.0  # a fresh request (log-space: log(0) = -inf enters the scan)
    scan, ref = (diag_log_scan, diag_log_scan_ref) if log_space else (diag_linear_scan, diag_linear_scan_ref)
    h, final = scan(a, b, cu, h0, chunk_size=chunk_size)
    h_ref, final_ref = ref(a, b, cu, h0)
    assert h.dtype == final.dtype == torch.float32
    torch.testing.assert_close(h, h_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final, final_ref, rtol=2e-5, atol=2e-5)


def test_varlen_scan_without_initial_state(triton_on_cpu):
    a, b = _inputs(log_space=True, dtype=torch.float32, seed=1)
    a, b = a[: sum(LENGTHS[:4])], b[: sum(LENGTHS[:4])]
    cu = cu_seqlens_of(LENGTHS[:4])
    h, final = diag_log_scan(a, b, cu, chunk_size=16)
    h_ref, final_ref = diag_log_scan_ref(a, b, cu)
    torch.testing.assert_close(h, h_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final, final_ref, rtol=2e-5, atol=2e-5)


@torch.inference_mode()
def test_log_scan_of_infinite_inputs_and_states(triton_on_cpu) -> None:
    """``log b = +inf`` (a minGRU candidate that overflowed) and ``h0 = inf`` give ``h = inf`` from there on, as the
    linear recurrence ``a h + b`` does; ``logaddexp`` shifted by the larger operand, ``+inf``, and made it NaN."""
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 40]
    log_a = -torch.rand(sum(lengths), DIM, generator=gen) * 3
    log_b = torch.randn(sum(lengths), DIM, generator=gen)
    log_b[[1, 10, 30], [0, 5, 23]] = float("inf")
    h0 = torch.rand(len(lengths), DIM, generator=gen)
    h0[1, 7] = float("inf")
    cu = cu_seqlens_of(lengths)
    h, final = diag_log_scan(log_a, log_b, cu, h0)
    h_ref, final_ref = diag_linear_scan_ref(log_a.exp(), log_b.exp(), cu, h0)
    assert h_ref.isinf().sum() > 10 and not h_ref.isnan().any()
    torch.testing.assert_close(h, h_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final, final_ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_updates_slots_in_place(triton_on_cpu, log_space, dtype):
    batch, num_slots, layers, layer = 5, 11, 3, 1
    a, b = _inputs(log_space, dtype, seed=2)
    a, b = a[:batch], b[:batch]
    pool = torch.rand(num_slots, layers, DIM)
    expected_pool = pool.clone()
    slots = slot_ids_for(batch, num_slots)
    h = diag_scan_step(a, b, pool[:, layer], slots, log_space)
    h_ref = diag_scan_step_ref(a, b, expected_pool[slots, layer], log_space)
    expected_pool[slots, layer] = h_ref
    torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-6, atol=1e-6)


needs_cpu_kernels = pytest.mark.skipif(not cpu_ops(), reason="needs the fused CPU kernels")


@needs_cpu_kernels
@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [DIM, 150])
def test_cpu_scan_matches_reference(log_space: bool, dtype: torch.dtype, dim: int) -> None:
    """Ragged lengths (an empty sequence among them), a zero initial state beside positive ones, channels that
    leave a partial block of 64, inputs that are slices of wider rows."""
    lengths = [*LENGTHS[:3], 0, *LENGTHS[3:]]
    gen = torch.Generator().manual_seed(dim)
    k = torch.randn(sum(lengths), dim + 7, generator=gen)[:, 3 : 3 + dim]
    v = torch.randn(sum(lengths), dim, generator=gen)
    if log_space:
        a, b = -torch.nn.functional.softplus(k), -torch.nn.functional.softplus(-k) + 0.3 * v
    else:
        a, b = torch.sigmoid(k), v
    a, b = a.to(dtype), b.to(dtype)
    cu = cu_seqlens_of(lengths)
    h0 = torch.rand(len(lengths), dim, generator=gen) + 0.1
    h0[1] = 0.0
    ref = diag_log_scan_ref if log_space else diag_linear_scan_ref
    h, final = torch.ops.rnnserve.diag_scan_varlen(a, b, cu, h0, log_space)
    h_ref, final_ref = ref(a, b, cu, h0)
    assert h.dtype == final.dtype == torch.float32 and h.is_contiguous()
    torch.testing.assert_close(h, h_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final, final_ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(final[3], h0[3])  # the empty sequence keeps its state
    h, final = torch.ops.rnnserve.diag_scan_varlen(a, b, cu, None, log_space)
    h_ref, final_ref = ref(a, b, cu)
    torch.testing.assert_close(h, h_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final, final_ref, rtol=2e-5, atol=2e-5)


@needs_cpu_kernels
def test_cpu_scan_takes_exp_of_minus_infinity_as_zero() -> None:
    """A gate of log 0 forgets the state; an input of log 0 adds nothing (log-space padding, empty inputs)."""
    log_a = torch.tensor([[0.0, float("-inf")], [-1.0, -100.0]])
    log_b = torch.tensor([[float("-inf"), 0.5], [float("-inf"), float("-inf")]])
    h0 = torch.tensor([[2.0, 3.0]])
    h, final = torch.ops.rnnserve.diag_scan_varlen(log_a, log_b, torch.tensor([0, 2]), h0, True)
    expected = torch.tensor([[2.0, torch.e**0.5], [2.0 * torch.e**-1.0, 0.0]])
    torch.testing.assert_close(h, expected)
    torch.testing.assert_close(final, expected[1:])


@needs_cpu_kernels
@pytest.mark.parametrize("log_space", [False, True])
def test_public_scans_run_the_cpu_kernel(log_space: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "diag_scan_varlen")
    a, b = _inputs(log_space, torch.float32)
    scan = diag_log_scan if log_space else diag_linear_scan
    h, _ = scan(a, b, cu_seqlens_of(LENGTHS))
    assert calls == [log_space] and h.shape == a.shape
    with torch.enable_grad():  # no autograd formula: inputs that need a gradient take the reference
        scan(a.requires_grad_(True), b, cu_seqlens_of(LENGTHS))
    assert calls == [log_space]


@needs_cpu_kernels
def test_cpu_scan_rejects_malformed_offsets() -> None:
    a = torch.rand(4, 3)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to T"):
        torch.ops.rnnserve.diag_scan_varlen(a, a, torch.tensor([0, 3]), None, False)
    with pytest.raises(RuntimeError, match="must not decrease"):
        torch.ops.rnnserve.diag_scan_varlen(a, a, torch.tensor([0, 3, 2, 4]), None, False)


LONG = 4096
LOG_DECAYS = {  # log_a per step: gates near 1, near 0 (|sum log_a| over a chunk ~ 1600), and sigmoid gates
    "near-one": lambda gen, steps: -1e-4 * torch.rand(steps, 8, generator=gen),
    "near-zero": lambda gen, steps: -20 - 10 * torch.rand(steps, 8, generator=gen),
    "mixed": lambda gen, steps: torch.nn.functional.logsigmoid(6 * torch.randn(steps, 8, generator=gen)),
}


def _long_log_scan_case(decay: str, steps: int = LONG) -> tuple[torch.Tensor, ...]:
    """One sequence of ``steps`` steps and its exact states: the linear recurrence run in fp64."""
    gen = torch.Generator().manual_seed(5)
    log_a = LOG_DECAYS[decay](gen, steps)
    log_b = 2 * torch.randn(steps, 8, generator=gen) - 1
    h0 = torch.rand(1, 8, generator=gen) + 0.5
    a, b, h = log_a.double().exp(), log_b.double().exp(), h0[0].double()
    states = []
    for t in range(steps):
        h = a[t] * h + b[t]
        states.append(h)
    return log_a, log_b, torch.tensor([0, steps]), h0, torch.stack(states)


def _assert_relative_error(h: torch.Tensor, exact: torch.Tensor, bound: float) -> None:
    error = ((h.double() - exact).abs() / exact).max().item()
    assert error < bound, f"relative error {error:.2e} (bound {bound:.0e})"


@pytest.mark.parametrize("decay", sorted(LOG_DECAYS))
def test_log_scan_reference_is_exact_over_long_sequences(decay: str) -> None:
    """The reference's chunks add a cumulative log-gate and a log-sum-exp that cancel: in fp32, gates near 0 left
    a relative error of 1e-4 (kernels: 1e-7). It stays within fp32 rounding of the exact states at any length."""
    log_a, log_b, cu, h0, exact = _long_log_scan_case(decay)
    h, final = diag_log_scan_ref(log_a, log_b, cu, h0)
    assert h.dtype == final.dtype == torch.float32
    _assert_relative_error(h, exact, 2e-7)
    _assert_relative_error(final[0], exact[-1], 2e-7)


@needs_cpu_kernels
@pytest.mark.parametrize("decay", sorted(LOG_DECAYS))
def test_cpu_log_scan_is_accurate_over_long_sequences(decay: str) -> None:
    """The CPU kernel (sequential in fp32) against the exact states: rounding, not drift (1e-5 over 4096 steps
    of gates near 1, whose states sum thousands of terms)."""
    log_a, log_b, cu, h0, exact = _long_log_scan_case(decay)
    h, final = torch.ops.rnnserve.diag_scan_varlen(log_a, log_b, cu, h0, True)
    _assert_relative_error(h, exact, 2e-5)
    _assert_relative_error(final[0], exact[-1], 2e-5)


@pytest.mark.parametrize("decay", sorted(LOG_DECAYS))
def test_triton_log_scan_is_accurate_over_long_sequences(triton_on_cpu, decay: str) -> None:
    """The Triton kernel's pairwise scan likewise (1024 steps: the interpreter takes seconds per thousand)."""
    log_a, log_b, cu, h0, exact = _long_log_scan_case(decay, 1024)
    h, final = diag_log_scan(log_a, log_b, cu, h0, chunk_size=32)
    _assert_relative_error(h, exact, 2e-5)
    _assert_relative_error(final[0], exact[-1], 2e-5)
