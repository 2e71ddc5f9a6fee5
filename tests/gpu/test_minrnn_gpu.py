"""minGRU / minLSTM on CUDA: the Triton path's logits and states == the PyTorch reference path's."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.models.minrnn import MinGRULM, MinLSTMLM, MinRNNConfig
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels.backend import force_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("model_class", [MinGRULM, MinLSTMLM])
def test_kernel_path_matches_reference_path(model_class):
    config = MinRNNConfig(vocab_size=512, d_model=512, n_layers=4)
    model = model_class(config)
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.cuda().eval()
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 70, 300, 5]
    slots = [9, 2, 30, 17]
    prompt = PrefillBatch.build(
        [torch.randint(0, 512, (n,), generator=gen) for n in lengths], slots, device="cuda"
    )
    steps = [
        DecodeBatch.build(torch.randint(0, 512, (4,), generator=gen).tolist(), slots,
                          [n + t for n in lengths], device="cuda")
        for t in range(16)
    ]
    results = {}
    with torch.inference_mode():
        for use_kernels in (False, True):
            pool = StatePool(model.state_spec(), num_slots=32, device="cuda")
            with force_triton(use_kernels):
                logits = [model.prefill(prompt, pool.tensors)]
                logits += [model.decode(batch, pool.tensors) for batch in steps]
            results[use_kernels] = torch.stack(logits), pool.tensors
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-3, atol=1e-3)
    for name, expected in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_class", [MinGRULM, MinLSTMLM])
def test_kernel_prefill_matches_kernel_decode(model_class):
    """The Triton scan/conv prefill and the fused decode kernels agree token for token."""
    model = model_class(MinRNNConfig(vocab_size=512, d_model=256, n_layers=3))
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.cuda().eval()
    prompt = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        prefilled = StatePool(model.state_spec(), num_slots=4, device="cuda")
        logits = model.prefill(PrefillBatch.build([prompt], [2], device="cuda"), prefilled.tensors)
        decoded = StatePool(model.state_spec(), num_slots=4, device="cuda")
        for position, token in enumerate(prompt):
            step_logits = model.decode(DecodeBatch.build([token], [1], [position], device="cuda"), decoded.tensors)
    torch.testing.assert_close(step_logits, logits, rtol=1e-4, atol=1e-4)
    for name, tensor in prefilled.tensors.items():
        torch.testing.assert_close(decoded.tensors[name][1], tensor[2], rtol=1e-4, atol=1e-4)
