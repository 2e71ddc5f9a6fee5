"""The Triton RG-LRU decode step == its reference on CUDA at hawk-100m's size (8 heads of 128 channels)."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.rg_lru import rg_lru_step
from rnnserve.kernels.rg_lru.naive import rg_lru_step_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HEADS, WIDTH = 8, 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 256])
@torch.inference_mode()
def test_step_matches_reference(dtype: torch.dtype, batch: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    dim = HEADS * WIDTH

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    args = {
        "x": randn(batch, dim), "y": randn(batch, dim), "first": torch.arange(batch, device="cuda") % 7 == 3,
        "input_gate_weight": randn(HEADS, WIDTH, WIDTH, scale=WIDTH**-0.5), "input_gate_bias": randn(HEADS, WIDTH),
        "recurrent_gate_weight": randn(HEADS, WIDTH, WIDTH, scale=WIDTH**-0.5),
        "recurrent_gate_bias": randn(HEADS, WIDTH), "recurrent_param": randn(dim),
        "pool": torch.randn(batch + 9, 2, dim, device="cuda", generator=g)[:, 1],
        "slot_ids": torch.randperm(batch + 8, device="cuda")[:batch] + 1,
    }  # fmt: skip
    ref = {name: t.clone() for name, t in args.items()}
    out, expected = rg_lru_step(**args), rg_lru_step_ref(**ref)
    # bf16: the reference's batched matmul and the kernel sum the gates in another order, and a rounding of a
    # gate to bf16 can differ by one unit.
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    torch.testing.assert_close(args["pool"], ref["pool"], **tol)
