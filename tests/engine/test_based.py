"""Based: whole prefill == chunked prefill == token-by-token decode, batched == alone, and the state size."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models import MODEL_REGISTRY, PRESETS
from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.state_pool import StatePool
from tests.engine.test_model_consistency import _decode_stepwise, _prefill_chunked
from tests.engine.test_model_consistency import _prefill_whole as _prefill

LENGTHS = [1, 2, 7, 8, 9, 30, 64, 65, 100]
SLOTS = [5, 0, 11, 3, 9, 1, 14, 7, 2]  # out of order, with gaps


def _model(**overrides: object) -> torch.nn.Module:
    architecture, preset = PRESETS["based-tiny"]
    cls = MODEL_REGISTRY[architecture]
    model = cls(cls.config_class(**{**preset, **overrides}))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval().requires_grad_(False)


def _prompts(lengths: list[int] = LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (n,), generator=g) for n in lengths]


def _assert_same_states(a: StatePool, b: StatePool) -> None:
    for name, tensor in a.tensors.items():
        torch.testing.assert_close(b.tensors[name], tensor, atol=1e-4, rtol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [1, 13, 64])
def test_chunked_prefill_equals_whole_prefill(chunk: int) -> None:
    """Chunks of 13 straddle the 8-key ring of the tiny preset's sliding-window layer."""
    model = _model()
    prompts = _prompts()
    whole_pool, chunk_pool = StatePool(model.state_spec(), 16), StatePool(model.state_spec(), 16)
    whole = _prefill(model, prompts, SLOTS, whole_pool)
    chunked = _prefill_chunked(model, prompts, SLOTS, chunk_pool, chunk)
    assert whole.dtype == torch.float32 and whole.shape == (len(prompts), 320)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    _assert_same_states(whole_pool, chunk_pool)


@torch.inference_mode()
def test_token_by_token_decode_equals_whole_prefill() -> None:
    model = _model()
    prompts = _prompts()
    whole_pool, step_pool = StatePool(model.state_spec(), 16), StatePool(model.state_spec(), 16)
    whole = _prefill(model, prompts, SLOTS, whole_pool)
    stepwise = _decode_stepwise(model, prompts, SLOTS, step_pool)
    torch.testing.assert_close(stepwise, whole, atol=1e-5, rtol=1e-5)
    _assert_same_states(whole_pool, step_pool)


@torch.inference_mode()
def test_batched_equals_alone() -> None:
    model = _model()
    prompts = _prompts(seed=3)
    batched = _prefill(model, prompts, SLOTS, StatePool(model.state_spec(), 16))
    for i, prompt in enumerate(prompts):
        alone = _prefill(model, [prompt], [0], StatePool(model.state_spec(), 1))
        torch.testing.assert_close(batched[i : i + 1], alone, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_decode_with_consecutive_slots_updates_the_pool_in_place() -> None:
    """Consecutive slots take the slice path of the linear-attention step; gaps take the gather path."""
    model = _model()
    prompts = _prompts([20, 20, 20], seed=4)
    pools = {name: StatePool(model.state_spec(), 6) for name in ("slice", "gather")}
    for name, slots in (("slice", [2, 3, 4]), ("gather", [4, 0, 2])):
        _prefill(model, [p[:12] for p in prompts], slots, pools[name])
        for t in range(12, 20):
            out = model.decode(DecodeBatch.build([int(p[t]) for p in prompts], slots, [t] * 3), pools[name].tensors)
        pools[name] = (pools[name], slots, out)
    (slice_pool, slice_slots, slice_out), (gather_pool, gather_slots, gather_out) = pools["slice"], pools["gather"]
    torch.testing.assert_close(slice_out, gather_out, atol=1e-5, rtol=1e-5)
    for name, tensor in slice_pool.tensors.items():
        torch.testing.assert_close(tensor[slice_slots], gather_pool.tensors[name][gather_slots], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_bf16_weights_keep_fp32_state() -> None:
    model = _model().to(torch.bfloat16)
    pool = StatePool(model.state_spec(), 2)
    assert all(t.dtype == torch.float32 for t in pool.tensors.values())
    logits = _prefill(model, _prompts()[4:6], [0, 1], pool)
    stepped = model.decode(DecodeBatch.build([1, 2], [0, 1], [9, 30]), pool.tensors)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all() and torch.isfinite(stepped).all()


def _analytic_state_bytes(c) -> int:
    """fp32: conv tails ``d_inner x (K - 1)``; ``S`` and ``z`` with ``1 + f + f^2`` features; rings of
    ``window_size // 2`` keys and values."""
    kinds = c.layer_kinds()
    features = 1 + c.la_feature_dim + c.la_feature_dim**2
    conv = kinds.count("conv") * (c.conv_expand * c.d_model // 2) * (c.conv_kernel - 1)
    linear_attention = kinds.count("linear_attention") * c.la_heads * features * (c.la_head_dim + 1)
    sliding = kinds.count("sliding_window") * 2 * (c.window_size // 2) * c.d_model
    return 4 * (conv + linear_attention + sliding)


@pytest.mark.parametrize("preset", ["based-360m", "based-1b"])
def test_state_bytes_equal_the_analytic_size(preset: str) -> None:
    architecture, overrides = PRESETS[preset]
    cls = MODEL_REGISTRY[architecture]
    config = cls.config_class(**overrides)
    with torch.device("meta"):  # the shapes without the weights
        model = cls(config)
    pool = StatePool(model.state_spec(), 1)
    assert pool.bytes_per_slot == _analytic_state_bytes(config)
    written_out = {  # conv layers x d_inner x 2 + LA layers x 16 x 273 x (head_dim + 1) + SW layers x 2 x 128 x d
        "based-360m": 4 * (17 * 2048 * 2 + 5 * 16 * 273 * 65 + 5 * 2 * 128 * 1024),
        "based-1b": 4 * (22 * 3584 * 2 + 7 * 16 * 273 * 113 + 7 * 2 * 128 * 1792),
    }
    assert pool.bytes_per_slot == written_out[preset]


@torch.inference_mode()
def test_state_is_constant_from_10_to_100000_tokens() -> None:
    """The pool's bytes do not depend on the length, and a 100,000-token prompt leaves the same tensors
    (shapes, dtypes, storage) in its slot."""
    model = _model()
    pool = StatePool(model.state_spec(), 2)
    before = {name: (t.shape, t.dtype, t.data_ptr()) for name, t in pool.tensors.items()}
    bytes_per_slot = pool.bytes_per_slot
    assert bytes_per_slot == _analytic_state_bytes(model.config)
    for slot, length in enumerate((10, 100_000)):
        prompt = torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(length))
        logits = _prefill(model, [prompt], [slot], pool)
        assert torch.isfinite(logits).all()
        assert {name: (t.shape, t.dtype, t.data_ptr()) for name, t in pool.tensors.items()} == before
        assert pool.bytes_per_slot == bytes_per_slot
        assert float(pool.tensors["k_sum"][slot, 0, 0, 0]) == length  # phi's constant feature counts the tokens
