"""The Triton RG-LRU decode step == its reference (the Hugging Face model's ops), under the interpreter."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.rg_lru import rg_lru_step
from rnnserve.kernels.rg_lru.naive import rg_lru_step_ref

HEADS, WIDTH = 2, 48  # a width that is not a power of two: two 32-channel blocks per head, the second partial
DIM = HEADS * WIDTH


def step_args(dtype: torch.dtype, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    slots = batch + 4
    return {
        "x": torch.randn(batch, DIM, generator=g).to(dtype),
        "y": torch.randn(batch, DIM, generator=g).to(dtype),
        "first": torch.arange(batch) % 3 == 1,  # some sequences start here
        "input_gate_weight": (torch.randn(HEADS, WIDTH, WIDTH, generator=g) / WIDTH**0.5).to(dtype),
        "input_gate_bias": (torch.randn(HEADS, WIDTH, generator=g) * 0.1).to(dtype),
        "recurrent_gate_weight": (torch.randn(HEADS, WIDTH, WIDTH, generator=g) / WIDTH**0.5).to(dtype),
        "recurrent_gate_bias": (torch.randn(HEADS, WIDTH, generator=g) * 0.1).to(dtype),
        "recurrent_param": torch.randn(DIM, generator=g).to(dtype),
        "pool": torch.randn(slots, 3, DIM, generator=g)[:, 1],  # a layer's view of a strided pool
        "slot_ids": torch.randperm(slots - 1, generator=g)[:batch] + 1,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5])
@torch.inference_mode()
def test_step_matches_reference(triton_on_cpu, dtype: torch.dtype, batch: int) -> None:
    args = step_args(dtype, batch)
    ref = {name: t.clone() for name, t in args.items()}
    before = args["pool"].clone()
    for _ in range(2):
        out = rg_lru_step(**args)
        expected = rg_lru_step_ref(**ref)
        assert out.dtype == expected.dtype == dtype
        # bf16: the interpreter rounds fp32 to bf16 toward zero, torch to nearest; each of the ~10 roundings
        # may differ by one unit.
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
        torch.testing.assert_close(out.float(), expected.float(), **tol)
        torch.testing.assert_close(args["pool"], ref["pool"], **tol)
    untouched = torch.ones(args["pool"].shape[0], dtype=torch.bool)
    untouched[args["slot_ids"]] = False
    assert torch.equal(args["pool"][untouched], before[untouched])
