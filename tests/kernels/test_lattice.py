"""Lattice's orthogonal state recurrence: the reference against the paper's equations and the gradient step it
was derived from; the Triton kernels (interpreter) and the fused C++ kernel against the reference; norm
stability over 100,000 steps; finite results for zero and huge inputs."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.lattice import orthonormal_columns
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.lattice import lattice_decode, lattice_varlen
from rnnserve.kernels.lattice.naive import lattice_decode_ref, lattice_step_ref, lattice_varlen_ref
from tests.kernels.kernel_cases import cu_seqlens_of, slot_ids_for

VARIANTS = ["dec", "enc", "sim"]
D, M = 12, 6  # not powers of two


def _paper_step(s, q, k, v, gamma, mu, variant, normalize):
    """Eq. 13 (with Table 1's h, c), Eq. 16 and Eq. 14 written out column by column, in fp64."""
    phi = s / torch.linalg.vector_norm(s, dim=0)
    if variant == "dec":
        e = phi @ k - v
        h, c = e, k
    elif variant == "enc":
        e = phi.T @ v - k
        h, c = v, e
    else:
        h, c = -v, k
    columns = []
    for i in range(s.shape[1]):
        si = s[:, i]
        projection = torch.eye(s.shape[0], dtype=s.dtype) - torch.outer(si, si) / (si @ si)
        delta = -gamma * c[i] * (projection @ h) / torch.linalg.vector_norm(si)
        if normalize and mu is None:
            beta = (1 + delta @ delta) ** -0.5  # Eq. 14, for a unit-norm s_i
            columns.append(beta * (si + delta))
        elif normalize:
            moved = mu * si + delta
            columns.append(moved / torch.linalg.vector_norm(moved))
        else:
            columns.append((1.0 if mu is None else mu) * si + delta)
    new = torch.stack(columns, dim=1)
    return new, new @ q


def _inputs(seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(M, generator=gen, dtype=torch.float64), torch.randn(M, generator=gen, dtype=torch.float64)
    v = scale * torch.randn(D, generator=gen, dtype=torch.float64)
    gamma = torch.rand((), generator=gen, dtype=torch.float64)
    return q, k, v, gamma


def _state(seed: int, normalize: bool) -> torch.Tensor:
    s = orthonormal_columns(D, M, generator=torch.Generator().manual_seed(seed)).double()
    return s if normalize else s * torch.linspace(0.5, 2.0, M, dtype=torch.float64)


def _ref(s, q, k, v, gamma, mu, variant, normalize):
    mu_t = None if mu is None else torch.tensor(mu)
    new, y = lattice_step_ref(s, q, k, v, gamma, mu_t, variant, normalize)
    return new.double(), y.double()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("mu", [None, 0.7])
def test_reference_equals_the_papers_equations(variant, normalize, mu):
    s = _state(0, normalize)
    for step in range(5):
        q, k, v, gamma = _inputs(step)
        expected, y_expected = _paper_step(s, q, k, v, gamma, mu, variant, normalize)
        new, y = _ref(s, q, k, v, gamma, mu, variant, normalize)
        torch.testing.assert_close(new, expected, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(y, y_expected, atol=1e-5, rtol=1e-5)
        s = expected


def _loss(s, q, k, v, variant):
    """The paper's compression losses: Eq. 6 (DEC), Eq. 9 (ENC), Eq. 11 (SIM)."""
    phi = s / torch.linalg.vector_norm(s, dim=0)
    if variant == "dec":
        return ((phi @ k - v) ** 2).sum()
    if variant == "enc":
        return ((phi.T @ v - k) ** 2).sum()
    return -(phi.T @ v) @ k


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("mu", [None, 0.8])
def test_closed_form_update_equals_a_gradient_step_on_the_compression_loss(variant, normalize, mu):
    """S <- mu S - gamma' grad L (Eq. 4, 16), then columns onto the unit sphere (Eq. 14); gamma' = gamma / 2 for
    the squared losses, whose factor 2 the closed forms (Eq. 7, 10) leave in the step size."""
    s = _state(1, normalize)
    for step in range(3):
        q, k, v, gamma = _inputs(10 + step, scale=3.0)
        leaf = s.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(_loss(leaf, q, k, v, variant), leaf)
        moved = (1.0 if mu is None else mu) * s - gamma * (1.0 if variant == "sim" else 0.5) * grad
        expected = moved / torch.linalg.vector_norm(moved, dim=0) if normalize else moved
        new, _ = _ref(s, q, k, v, gamma, mu, variant, normalize)
        torch.testing.assert_close(new, expected, atol=2e-6, rtol=1e-5)
        s = expected


def test_fused_dec_step_for_unit_columns():
    """The fused DEC form: e = S k - v, p = S^T e, U = S diag(1 + gamma k p) - gamma e k^T, columns scaled by
    (1 + gamma^2 k^2 (|e|^2 - p^2))^(-1/2)."""
    s = _state(2, True)
    q, k, v, gamma = _inputs(3, scale=2.0)
    e = s @ k - v
    p = s.T @ e
    u = s * (1 + gamma * k * p) - gamma * torch.outer(e, k)
    beta = (1 + gamma**2 * k**2 * (e @ e - p**2)) ** -0.5
    new, y = _ref(s, q, k, v, gamma, None, "dec", True)
    torch.testing.assert_close(new, u * beta, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(y, (u * beta) @ q, atol=1e-5, rtol=1e-5)


def _pool_case(lengths, heads, num_slots, seed, forget, m=M):
    """Random inputs and a pool ``[num_slots, 3 layers, heads, d, m]`` of orthonormal columns (``d = D``, or
    ``m + 4`` for more slots than that)."""
    gen = torch.Generator().manual_seed(seed)
    total, d = sum(lengths), max(D, m + 4)
    q, k = torch.randn(total, heads, m, generator=gen), torch.randn(total, heads, m, generator=gen)
    v = torch.randn(total, heads, d, generator=gen)
    gamma = torch.rand(total, heads, generator=gen)
    mu = torch.rand(total, heads, generator=gen) if forget else None
    pool = orthonormal_columns(num_slots, 3, heads, d, m, generator=gen)
    return q, k, v, gamma, mu, pool


def _check_varlen(variant, normalize, forget, lengths, m=M):
    q, k, v, gamma, mu, pool = _pool_case(lengths, 2, 11, 4, forget, m)
    slots = slot_ids_for(len(lengths), 11, seed=2)
    cu = cu_seqlens_of(lengths)
    expected_pool = pool.clone()
    expected = lattice_varlen_ref(q, k, v, gamma, mu, cu, expected_pool[:, 1], slots, variant, normalize)
    y = lattice_varlen(q, k, v, gamma, mu, cu, pool[:, 1], slots, variant, normalize)
    torch.testing.assert_close(y, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool, expected_pool, atol=2e-5, rtol=2e-5)


def _check_decode(variant, normalize, forget, m=M):
    q, k, v, gamma, mu, pool = _pool_case([1] * 5, 3, 9, 5, forget, m)
    slots = slot_ids_for(5, 9, seed=3)
    expected_pool = pool.clone()
    expected = lattice_decode_ref(q, k, v, gamma, mu, expected_pool[:, 2], slots, variant, normalize)
    y = lattice_decode(q, k, v, gamma, mu, pool[:, 2], slots, variant, normalize)
    torch.testing.assert_close(y, expected, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(pool, expected_pool, atol=2e-6, rtol=2e-6)


CASES = [(variant, normalize, forget) for variant in VARIANTS for normalize, forget in ((True, False), (True, True))]
CASES.append(("dec", False, True))


@pytest.mark.parametrize("variant, normalize, forget", CASES)
def test_triton_prefill_and_decode_equal_reference(triton_on_cpu, variant, normalize, forget):
    _check_varlen(variant, normalize, forget, [3, 1, 6])
    _check_decode(variant, normalize, forget)


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
@pytest.mark.parametrize("variant, normalize, forget", CASES)
@pytest.mark.parametrize("m", [M, 16])  # 16 slots fill whole vectors: the kernel works in the pool itself
def test_cpu_kernel_prefill_and_decode_equal_reference(variant, normalize, forget, m):
    _check_varlen(variant, normalize, forget, [5, 1, 40, 17], m)
    _check_decode(variant, normalize, forget, m)


@pytest.mark.parametrize("m", [M, 16])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_slot_whose_update_vanishes_keeps_its_value(request, backend, m):
    """Closed forget gate (mu = 0), basis vectors as the slots and v along slot 0's: P(s_0) h is exactly zero,
    so slot 0 keeps its value while the others move (SIM: h = -v, c = k)."""
    if backend == "cpu" and not cpu_ops():
        pytest.skip("fused CPU kernels could not be built")
    if backend == "triton":
        request.getfixturevalue("triton_on_cpu")
    d = m + 4
    q, k, _, gamma, _, _ = _pool_case([3], 1, 2, 6, False, m)
    pool = torch.zeros(2, 1, 1, d, m)
    pool[1, 0, 0, :m] = torch.eye(m)
    v = torch.zeros(3, 1, d)
    v[:, 0, 0] = -2.0
    mu = torch.zeros(3, 1)
    expected_pool = pool.clone()
    slot = torch.tensor([1])
    expected = lattice_varlen_ref(q, k, v, gamma, mu, cu_seqlens_of([3]), expected_pool[:, 0], slot, "sim")
    y = lattice_varlen(q, k, v, gamma, mu, cu_seqlens_of([3]), pool[:, 0], slot, "sim")
    assert torch.equal(pool[1, 0, 0, :, 0], torch.eye(d, m)[:, 0])  # slot 0 kept
    assert not torch.equal(pool[1, 0, 0, :, 1:], torch.eye(d, m)[:, 1:])  # the others moved
    torch.testing.assert_close(y, expected, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(pool, expected_pool, atol=2e-6, rtol=2e-6)


def _column_norm_error(pool: torch.Tensor) -> float:
    return float((torch.linalg.vector_norm(pool.double(), dim=-2) - 1).abs().max())


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
@pytest.mark.parametrize("variant", VARIANTS)
def test_columns_stay_unit_norm_over_100k_steps(variant):
    """100,000 tokens of random input (values up to ~1e3, some with a closed forget gate), checked every 1000."""
    gen = torch.Generator().manual_seed(7)
    heads, chunk = 4, 1000
    pool = orthonormal_columns(1, heads, 8, 4, generator=gen)
    slot = torch.zeros(1, dtype=torch.long)
    cu = torch.tensor([0, chunk])
    worst = 0.0
    for _ in range(100):
        magnitude = 10 ** (3 * torch.rand(chunk, heads, 1, generator=gen))
        q, k = torch.randn(chunk, heads, 4, generator=gen), magnitude * torch.randn(chunk, heads, 4, generator=gen)
        v = magnitude * torch.randn(chunk, heads, 8, generator=gen)
        gamma, mu = torch.rand(chunk, heads, generator=gen), torch.rand(chunk, heads, generator=gen)
        y = lattice_varlen(q, k, v, gamma, mu, cu, pool, slot, variant)
        assert torch.isfinite(y).all()
        worst = max(worst, _column_norm_error(pool))
    assert worst < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scale", [0.0, 1e15, 1e30])
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_no_nan_for_zero_or_huge_inputs(request, variant, scale, backend):
    """Zero inputs, or inputs whose squares overflow fp32; one head's forget gate fully closed (mu = 0)."""
    if backend == "cpu" and not cpu_ops():
        pytest.skip("fused CPU kernels could not be built")
    if backend == "triton":
        request.getfixturevalue("triton_on_cpu")
    lengths = [4, 2]
    q, k, v, gamma, _, pool = _pool_case(lengths, 2, 3, 9, False)
    q, k, v = q * scale, k * scale, v * scale
    mu = torch.tensor([[1.0, 0.0]]).expand(6, 2).contiguous()
    gamma = torch.ones_like(gamma) if scale else gamma
    run = lattice_varlen_ref if backend == "reference" else lattice_varlen
    y = run(q, k, v, gamma, mu, cu_seqlens_of(lengths), pool[:, 0], torch.tensor([0, 2]), variant)
    assert torch.isfinite(y).all() and torch.isfinite(pool).all()
    assert _column_norm_error(pool) < 1e-5


BF16_CASES = [("dec", True, False), ("enc", True, False), ("sim", True, True)]


@pytest.mark.parametrize(("variant", "normalize", "forget"), BF16_CASES)
def test_triton_with_bf16_inputs_keeps_the_state_in_fp32(triton_on_cpu, variant, normalize, forget):
    """bf16 ``q, k, v`` (a bf16 model's projections): the kernel converts them on load and updates the state in
    fp32, so it equals the fp32 reference on the same inputs to fp32 accuracy. Measured over 257 tokens
    (2026-11-30): kernel - reference 2e-7 (DEC, SIM) and 9e-6 (ENC) of the largest |y|, the kernel as close to an
    fp64 reference as the fp32 reference is, where the reference computed in bf16 is 7e-3 (DEC, SIM) to 4e-1 (ENC)
    away. The ~2e-2 between a bf16 and an fp32 Lattice model is the weights' rounding, which both paths share (see
    docs/kernels.md); a state or a sum kept in bf16 would be ~1e-2 off here."""
    q, k, v, gamma, mu, pool = _pool_case([12, 3], 2, 5, 8, forget)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    slots, cu = torch.tensor([4, 2]), cu_seqlens_of([12, 3])
    expected_pool = pool.clone()
    expected = lattice_varlen_ref(q, k, v, gamma, mu, cu, expected_pool[:, 0], slots, variant, normalize)
    y = lattice_varlen(q, k, v, gamma, mu, cu, pool[:, 0], slots, variant, normalize)
    scale = float(expected.abs().max())
    torch.testing.assert_close(y, expected, atol=2e-5 * scale, rtol=0)
    torch.testing.assert_close(pool, expected_pool, atol=2e-5, rtol=0)
