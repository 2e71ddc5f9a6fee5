"""The decode stacks' path under programmatic dependent launch, under the interpreter.

Before its wait each stack kernel asks L2 for what it reads later (``prefetch_l2``, inline PTX) and then waits
for the kernel before it (``griddepcontrol``); the interpreter runs neither. Here the prefetch records its
addresses and the wait does nothing, so the path runs on the CPU: every address it asks for lies in a tensor
the stack was given (a prefetch of any other address is undefined), it covers every element of the weights,
the small inputs and the slots' conv tails it is meant to, and the results equal a launch without it.

With ``EARLY_LOADS`` the kernels load the small inputs (and each GEMV's first weight tile) at their start,
before the wait, instead of asking L2 for them: the results must equal a plain launch without early loads too.
With ``PREFETCH_AHEAD`` in_proj also asks for its layer's out_proj weights and the SSM kernel for the next layer's
in_proj weights.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rnnserve.kernels.mamba2_decode import fused_recurrent as mamba2_fused
from rnnserve.kernels.mamba_decode import fused_recurrent as mamba_fused
from tests.kernels import test_mamba2_decode_triton as mamba2_case
from tests.kernels import test_mamba_decode_triton as mamba_case

LINE = 128  # bytes an L2 request brings
# (batch, use_bias, EARLY_LOADS, PREFETCH_AHEAD) of the dependent launch compared with a plain one
CASES = [(1, False, False, False), (1, True, False, True), (5, True, True, True), (5, False, True, False)]


def recording_launch(monkeypatch: pytest.MonkeyPatch, dependent: bool, early: bool, ahead: bool) -> list[np.ndarray]:
    """Both stacks launched as under programmatic dependent launch if ``dependent`` (else plainly), with
    ``EARLY_LOADS = early`` and ``PREFETCH_AHEAD = ahead``, the prefetch recording its addresses (returned, filled
    as the stacks run) and the wait doing nothing."""
    addresses: list[np.ndarray] = []

    def record(ptrs) -> None:
        addresses.append(np.asarray(ptrs.handle.data, dtype=np.uint64).ravel().copy())

    def no_wait() -> None:
        return None

    monkeypatch.setattr(mamba_fused, "prefetch_l2", record)
    for stack in (mamba_fused, mamba2_fused):
        monkeypatch.setattr(stack, "wait_for_previous_kernel", no_wait)
        monkeypatch.setattr(stack, "dependent_launch", lambda wanted, device: dependent)
        monkeypatch.setattr(stack, "PREFETCH_INPUTS", True)
        monkeypatch.setattr(stack, "EARLY_LOADS", early)
        monkeypatch.setattr(stack, "PREFETCH_AHEAD", ahead)
    return addresses


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def element_lines(t: torch.Tensor) -> set[int]:
    """The L2 lines holding the elements of ``t`` (any strides)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets[..., None] + torch.arange(size) * stride
    return set(((t.data_ptr() + offsets.flatten() * t.element_size()) // LINE).tolist())


def check_prefetches(addresses: list[np.ndarray], given: list[torch.Tensor], meant: list[torch.Tensor]) -> None:
    """Every address lies in one of the ``given`` tensors; every element of the ``meant`` ones was asked for."""
    asked = np.concatenate(addresses)
    starts, ends = np.array([byte_range(t) for t in given], dtype=np.uint64).T
    inside = ((asked[:, None] >= starts[None, :]) & (asked[:, None] < ends[None, :])).any(axis=1)
    assert inside.all(), f"{int((~inside).sum())} of {asked.size} prefetched addresses lie outside the inputs"
    lines = set((asked // LINE).tolist())
    for t in meant:
        missed = element_lines(t) - lines
        assert not missed, f"{len(missed)} lines of a {tuple(t.shape)} input were not prefetched"


def run_both_ways(
    monkeypatch: pytest.MonkeyPatch, make_args, run, early: bool, ahead: bool = False
) -> tuple[dict, list[np.ndarray]]:
    """``run(args)`` on fresh ``make_args()``, launched plainly without early loads, then as under dependent
    launch with ``EARLY_LOADS = early`` and ``PREFETCH_AHEAD = ahead``: the outputs and the pools must be equal.
    Returns the second run's args and prefetched addresses."""
    results = []
    for dependent in (False, True):
        args = make_args()
        addresses = recording_launch(monkeypatch, dependent, early and dependent, ahead and dependent)
        results.append((run(args), args["conv_pool"], args["ssm_pool"]))
        assert bool(addresses) == dependent
    for plain, under_dependent_launch in zip(*results, strict=True):
        assert torch.equal(plain, under_dependent_launch)
    return args, addresses


def ahead_weights(layers: list, ahead: bool, out_proj: int) -> list[torch.Tensor]:
    """What ``PREFETCH_AHEAD`` asks for (``ahead``): every layer's out_proj (at index ``out_proj`` of a layer),
    and each layer's in_proj but the first (the SSM kernel of the layer before asks for it)."""
    if not ahead:
        return []
    return [layer[out_proj] for layer in layers] + [layer[0] for layer in layers[1:]]


def check_stack_prefetches(
    args: dict, addresses: list[np.ndarray], layer_inputs: list[torch.Tensor], tails: bool = True
) -> None:
    """:func:`check_prefetches` against every tensor the stack was given; meant: the norms of the stack's kernels
    (all but the final one), ``layer_inputs`` and with ``tails`` the slots' conv tails."""
    layers = [[t for t in layer if t is not None] for layer in args["layers"]]
    slot_tails = [args["conv_pool"][slot, i] for slot in args["slot_ids"].tolist()  # views, not copies
                  for i in range(len(layers))] if tails else []  # fmt: skip
    given = [*args["norm_weights"], *(t for layer in layers for t in layer), args["conv_pool"], args["ssm_pool"],
             args["slot_ids"]]  # fmt: skip
    check_prefetches(addresses, given, [*args["norm_weights"][:-1], *slot_tails, *layer_inputs])


@pytest.mark.parametrize(("batch", "use_bias", "early", "ahead"), CASES)
@torch.inference_mode()
def test_mamba_stack_prefetches_its_inputs_and_changes_no_result(
    triton_on_cpu, monkeypatch, batch, use_bias, early, ahead
):
    def run(args: dict) -> torch.Tensor:
        return mamba_fused.mamba_decode_stack_triton(
            args["normed"], args["stream"], args["norm_weights"], args["eps"], args["layers"], args["conv_pool"],
            args["ssm_pool"], args["slot_ids"])  # fmt: skip

    args, addresses = run_both_ways(
        monkeypatch, lambda: mamba_case.stack_args(torch.float32, batch, use_bias, torch.float32), run, early, ahead)
    # With early loads, every input but the norms' weights is loaded before the wait (at these sizes each weight
    # row fits its first tile), so only the norms' weights are left to prefetch, and those of later kernels.
    meant = ahead_weights(args["layers"], ahead, out_proj=9) if early else [
        t for in_w, _, conv_w, conv_b, x_w, dt_w, dt_b, A, D, out_w, _ in (layer[:11] for layer in args["layers"])
        for t in (in_w, conv_w, conv_b, x_w, dt_w, dt_b, A, D, out_w) if t is not None]  # fmt: skip
    check_stack_prefetches(args, addresses, meant, tails=not early)


@torch.inference_mode()
def test_mamba_stack_with_small_tiles_prefetches_what_it_does_not_load_early(triton_on_cpu, monkeypatch):
    """Tiles smaller than the rows (``EARLY_LOADS`` on): in_proj's and out_proj's rows past their first tile and
    x_proj's rows past its first block are asked for; the results equal a plain launch without early loads."""
    monkeypatch.setattr(mamba_fused, "TILE", 512)
    monkeypatch.setattr(mamba_fused, "OUT_PROJ_TILE", 512)

    def run(args: dict) -> torch.Tensor:
        return mamba_fused.mamba_decode_stack_triton(
            args["normed"], args["stream"], args["norm_weights"], args["eps"], args["layers"], args["conv_pool"],
            args["ssm_pool"], args["slot_ids"])  # fmt: skip

    args, addresses = run_both_ways(
        monkeypatch, lambda: mamba_case.stack_args(torch.float32, 5, True, torch.float32), run, True)
    _, block_k, block_e = mamba_fused.in_proj_blocks(8, mamba_case.D_MODEL, mamba_case.D_INNER, 35)
    assert block_k < mamba_case.D_MODEL and block_e < 35
    meant = [t for layer in args["layers"] for t in (layer[0], layer[4][block_e:], layer[9])]
    check_stack_prefetches(args, addresses, meant, tails=False)


@pytest.mark.parametrize(("batch", "use_bias", "early", "ahead"), CASES)
@torch.inference_mode()
def test_mamba2_stack_prefetches_its_inputs_and_changes_no_result(
    triton_on_cpu, monkeypatch, batch, use_bias, early, ahead
):
    g = torch.Generator().manual_seed(7)
    normed, stream = torch.randn(batch, mamba2_case.D_MODEL, generator=g), torch.randn(batch, mamba2_case.D_MODEL)

    def run(args: dict) -> torch.Tensor:
        return mamba2_fused.mamba2_decode_stack_triton(
            normed, stream, args["norm_weights"], 1e-5, args["layers"], args["conv_pool"], args["ssm_pool"],
            args["slot_ids"], mamba2_case.GROUPS, 1e-5, (0.0, math.inf))  # fmt: skip

    args, addresses = run_both_ways(
        monkeypatch, lambda: mamba2_case.stack_args(torch.float32, batch, use_bias), run, early, ahead)
    # With early loads (see the Mamba-1 test) only the norms' weights are left to prefetch, the gated norm's too.
    meant = [layer[7] for layer in args["layers"]] + ahead_weights(args["layers"], ahead, out_proj=8) if early else [
        t for in_w, _, conv_w, conv_b, _, _, _, gated_w, out_w, _ in args["layers"]
        for t in (in_w, conv_w, conv_b, gated_w, out_w) if t is not None]  # fmt: skip
    check_stack_prefetches(args, addresses, meant, tails=not early)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "start"), [(1, 0), (63, 1), (64, 0), (65, 3), (2048, 0), (2048, 5)])
@torch.inference_mode()
def test_prefetch_vector_asks_for_each_line_once(triton_on_cpu, monkeypatch, dtype, n, start):
    """A norm's weights, asked for by every program of a GEMV: each line of the vector once (and the line of its
    last element), wherever it starts. A request per element made every line's requests as many as its elements,
    ~4 us a layer of the Mamba-2 stack on an H200."""
    import triton

    addresses = recording_launch(monkeypatch, True, False, False)

    @triton.jit
    def kernel(ptr, n):
        mamba_fused.prefetch_vector(ptr, n)

    storage = torch.zeros(start + n + 64, dtype=dtype)
    vector = storage[start : start + n]
    kernel[(1,)](vector, n)
    asked = np.concatenate(addresses)
    check_prefetches(addresses, [vector], [vector])
    assert len(set(asked.tolist())) <= math.ceil(n * vector.element_size() / LINE) + 1
