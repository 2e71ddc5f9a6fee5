"""Whole prefill == chunked prefill == token-by-token decode, for minGRU/minLSTM and a windowed Griffin."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models import MODEL_REGISTRY, PRESETS
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.state_pool import StatePool
from tests.engine.conftest import tiny_model

LENGTHS = [1, 2, 7, 8, 63, 64, 65, 129, 300]


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g) for n in LENGTHS]


def _prefill_whole(model, prompts, slots, pool, starts=None) -> torch.Tensor:
    return model.prefill(PrefillBatch.build(prompts, slots, starts), pool.tensors)


def _decode(model, tokens, slots, positions, pool) -> torch.Tensor:
    return model.decode(DecodeBatch.build(tokens, slots, positions), pool.tensors)


def _prefill_chunked(model, prompts, slots, pool, chunk: int) -> torch.Tensor:
    """Feed every prompt in chunks of ``chunk`` tokens, all sequences batched together each round."""
    last = [None] * len(prompts)
    for start in range(0, max(len(p) for p in prompts), chunk):
        active = [i for i, p in enumerate(prompts) if start < len(p)]
        pieces = [prompts[i][start : start + chunk] for i in active]
        logits = _prefill_whole(model, pieces, [slots[i] for i in active], pool, [start] * len(active))
        for row, i in enumerate(active):
            last[i] = logits[row]
    return torch.stack(last)


def _decode_stepwise(model, prompts, slots, pool) -> torch.Tensor:
    last = [None] * len(prompts)
    for t in range(max(len(p) for p in prompts)):
        active = [i for i, p in enumerate(prompts) if t < len(p)]
        ids = [int(prompts[i][t]) for i in active]
        logits = _decode(model, ids, [slots[i] for i in active], [t] * len(active), pool)
        for row, i in enumerate(active):
            last[i] = logits[row]
    return torch.stack(last)


SLOTS = [5, 0, 11, 3, 9, 1, 14, 7, 2]  # out of order, with gaps


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_whole_prefill(architecture: str, chunk: int) -> None:
    model = tiny_model(architecture, scan_chunk_size=32)
    prompts = _prompts()
    whole_pool, chunk_pool = StatePool(model.state_spec(), 16), StatePool(model.state_spec(), 16)
    whole = _prefill_whole(model, prompts, SLOTS, whole_pool)
    chunked = _prefill_chunked(model, prompts, SLOTS, chunk_pool, chunk)
    assert whole.dtype == torch.float32 and whole.shape == (len(prompts), 300)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    for name, tensor in whole_pool.tensors.items():
        torch.testing.assert_close(chunk_pool.tensors[name], tensor, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_token_by_token_decode_equals_whole_prefill(architecture: str) -> None:
    model = tiny_model(architecture, scan_chunk_size=32)
    prompts = _prompts()
    whole_pool, step_pool = StatePool(model.state_spec(), 16), StatePool(model.state_spec(), 16)
    whole = _prefill_whole(model, prompts, SLOTS, whole_pool)
    stepwise = _decode_stepwise(model, prompts, SLOTS, step_pool)
    torch.testing.assert_close(stepwise, whole, atol=1e-5, rtol=0)
    for name, tensor in whole_pool.tensors.items():
        torch.testing.assert_close(step_pool.tensors[name], tensor, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_decode_after_prefill_continues_the_same_sequence(architecture: str) -> None:
    """Prefill a prompt, then decode more tokens: equals prefilling the whole thing at once."""
    model = tiny_model(architecture)
    seq = _prompts(1)[7]  # 129 tokens
    pool_a, pool_b = StatePool(model.state_spec(), 2), StatePool(model.state_spec(), 2)
    _prefill_whole(model, [seq[:100]], [1], pool_a)
    for t in range(100, len(seq)):
        logits_a = _decode(model, [int(seq[t])], [1], [t], pool_a)
    logits_b = _prefill_whole(model, [seq], [1], pool_b)
    torch.testing.assert_close(logits_a, logits_b, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_other_slots_are_untouched(architecture: str) -> None:
    model = tiny_model(architecture)
    pool = StatePool(model.state_spec(), 6)
    for tensor in pool.tensors.values():
        tensor.normal_()
    before = {k: v.clone() for k, v in pool.tensors.items()}
    _prefill_whole(model, _prompts()[:2], [4, 1], pool)
    _decode(model, [3], [2], [0], pool)
    untouched = torch.tensor([0, 3, 5, 6])
    for name, tensor in pool.tensors.items():
        assert torch.equal(tensor[untouched], before[name][untouched])
        assert not torch.equal(tensor[torch.tensor([4, 1, 2])], before[name][torch.tensor([4, 1, 2])])


@torch.inference_mode()
def test_bf16_weights_keep_fp32_state(architecture: str) -> None:
    model = tiny_model(architecture).to(torch.bfloat16)
    pool = StatePool(model.state_spec(), 2)
    assert all(t.dtype == torch.float32 for t in pool.tensors.values())
    logits = _prefill_whole(model, _prompts()[1:3], [0, 1], pool)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    stepped = _decode(model, [1, 2], [0, 1], [1, 2], pool)
    assert torch.isfinite(stepped).all()


def _griffin(window: int) -> torch.nn.Module:
    architecture, preset = PRESETS["griffin-tiny"]
    cls = MODEL_REGISTRY[architecture]
    model = cls(cls.config_class(**{**preset, "window": window}))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval().requires_grad_(False)


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [3, 8, 13])
def test_griffin_window_crossing_chunks_and_decode_equal_whole_prefill(chunk: int) -> None:
    """Positions come from the batch: chunks that straddle the 8-token attention window, and decoding token by
    token, continue each slot's ring buffer exactly as one whole prefill does (logits and every state)."""
    model = _griffin(window=8)
    assert "pos" not in {spec.name for spec in model.state_spec()}
    prompts = [p[:40] for p in _prompts(2)]  # lengths 1, 2, 7, 8 and 40 (5 windows)
    slots = SLOTS[: len(prompts)]
    pools = {name: StatePool(model.state_spec(), 16) for name in ("whole", "chunked", "stepwise")}
    whole = _prefill_whole(model, prompts, slots, pools["whole"])
    chunked = _prefill_chunked(model, prompts, slots, pools["chunked"], chunk)
    stepwise = _decode_stepwise(model, prompts, slots, pools["stepwise"])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(stepwise, whole, atol=1e-5, rtol=0)
    for name, tensor in pools["whole"].tensors.items():
        torch.testing.assert_close(pools["chunked"].tensors[name], tensor, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pools["stepwise"].tensors[name], tensor, atol=1e-5, rtol=1e-5)

