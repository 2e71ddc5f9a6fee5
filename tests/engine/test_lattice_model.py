"""Lattice language models: prefill == chunked prefill == decode, batched == alone, every variant; S_0 as the
slot's initial state (a reused slot starts from it again); checkpoint round trip; the Triton path."""

from __future__ import annotations

import os

import pytest
import torch

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import ModelLoadError, load_model, save_checkpoint
from rnnserve.engine.models import MODEL_REGISTRY, PRESETS
from rnnserve.engine.models.lattice import LatticeConfig
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.kernels.backend import HAS_TRITON, force_triton
from tests.engine.conftest import run_to_completion
from tests.engine.test_model_consistency import SLOTS, _decode, _decode_stepwise, _prefill_chunked, _prefill_whole

PRESET_NAMES = ["lattice-tiny", "lattice-enc-tiny", "lattice-sim-tiny"]
LENGTHS = [1, 2, 7, 8, 33, 64, 65, 100]


def _model(preset: str, **overrides) -> torch.nn.Module:
    architecture, config = PRESETS[preset]
    cls = MODEL_REGISTRY[architecture]
    model = cls(cls.config_class(**{**config, "vocab_size": 300, **overrides}))
    model.init_weights(torch.Generator().manual_seed(0))
    if model.config.variant == "enc":
        # ENC's update scales with |v|^2: at the random init's |v| ~ sqrt(d) its dynamics are chaotic (a 1e-6
        # weight change moves logits by 1e-3 within 65 tokens), which would amplify the rounding differences
        # between GEMM paths of different row counts. A quarter of v keeps it in the regular regime.
        c = model.config
        with torch.no_grad():
            for layer in model.layers:
                layer.mixer.in_proj.weight[2 * c.qk_width : 2 * c.qk_width + c.v_width] *= 0.25
    return model.eval().requires_grad_(False)


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=gen) for n in LENGTHS]


def _pool(model: torch.nn.Module, slots: int = 16) -> StatePool:
    return StatePool(model.state_spec(), slots)


def _assert_pools_equal(a: StatePool, b: StatePool) -> None:
    for name, tensor in a.tensors.items():
        torch.testing.assert_close(b.tensors[name], tensor, atol=1e-5, rtol=1e-5)


@pytest.fixture(params=PRESET_NAMES)
def preset(request: pytest.FixtureRequest) -> str:
    return request.param


@torch.inference_mode()
def test_prefill_chunked_prefill_and_decode_agree(preset: str) -> None:
    model = _model(preset)
    prompts = _prompts()
    slots = SLOTS[: len(prompts)]
    pools = {name: _pool(model) for name in ("whole", "chunk1", "chunk7", "chunk64", "stepwise")}
    whole = _prefill_whole(model, prompts, slots, pools["whole"])
    assert whole.shape == (len(prompts), 300) and whole.dtype == torch.float32
    for chunk in (1, 7, 64):
        chunked = _prefill_chunked(model, prompts, slots, pools[f"chunk{chunk}"], chunk)
        torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
        _assert_pools_equal(pools["whole"], pools[f"chunk{chunk}"])
    stepwise = _decode_stepwise(model, prompts, slots, pools["stepwise"])
    torch.testing.assert_close(stepwise, whole, atol=1e-5, rtol=0)
    _assert_pools_equal(pools["whole"], pools["stepwise"])


@torch.inference_mode()
def test_batched_equals_alone(preset: str) -> None:
    model = _model(preset)
    prompts = _prompts(1)
    batched_pool = _pool(model)
    batched = _prefill_whole(model, prompts, SLOTS[: len(prompts)], batched_pool)
    next_tokens = [int(t) for t in batched.argmax(-1)]
    positions = [len(p) for p in prompts]
    batched_step = _decode(model, next_tokens, SLOTS[: len(prompts)], positions, batched_pool)
    for i, prompt in enumerate(prompts):
        alone_pool = _pool(model, 1)
        alone = _prefill_whole(model, [prompt], [0], alone_pool)
        torch.testing.assert_close(alone[0], batched[i], atol=1e-5, rtol=0)
        alone_step = _decode(model, [next_tokens[i]], [0], [positions[i]], alone_pool)
        torch.testing.assert_close(alone_step[0], batched_step[i], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_state_spec_starts_from_orthonormal_s0() -> None:
    model = _model("lattice-tiny")
    c = model.config
    spec = {s.name: s for s in model.state_spec()}["S"]
    assert spec.shape == (c.n_layers, c.n_heads, c.head_dim, c.num_slots) and spec.dtype == torch.float32
    s0 = spec.initial
    gram = s0.transpose(-1, -2) @ s0
    torch.testing.assert_close(gram, torch.eye(c.num_slots).expand_as(gram), atol=1e-6, rtol=0)
    torch.testing.assert_close(s0[0], model.layers[0].mixer.S0)
    pool = _pool(model, 3)
    assert all(torch.equal(pool.tensors["S"][i], s0) for i in range(4))


@torch.inference_mode()
def test_reused_slot_starts_from_s0_again() -> None:
    """A request runs in a slot, finishes and frees it; the next request gets the same slot, reset to S_0 (not
    zeros, not the last request's state), and so produces exactly what it produces in a fresh engine."""
    model = _model("lattice-tiny")
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine = LLMEngine(model, ByteTokenizer(), EngineConfig(max_num_seqs=1, max_num_batched_tokens=64))
    engine.add_request("the first request, somewhat longer", params)
    first = run_to_completion(engine)
    assert len(first) == 1 and engine.pool.num_free == 1
    (slot,) = engine.pool.allocate(1)
    torch.testing.assert_close(engine.pool.tensors["S"][slot], model.initial_state(), atol=0, rtol=0)
    assert torch.equal(engine.pool.tensors["conv"][slot], torch.zeros_like(engine.pool.tensors["conv"][slot]))
    engine.pool.free([slot])
    engine.add_request("second", params)
    (reused,) = run_to_completion(engine).values()
    fresh_engine = LLMEngine(model, ByteTokenizer(), EngineConfig(max_num_seqs=1, max_num_batched_tokens=64))
    fresh_engine.add_request("second", params)
    (fresh,) = run_to_completion(fresh_engine).values()
    assert reused.outputs[0].token_ids == fresh.outputs[0].token_ids


@torch.inference_mode()
def test_bf16_weights_keep_fp32_unit_norm_state() -> None:
    model = _model("lattice-tiny").to(torch.bfloat16)
    pool = _pool(model, 2)
    assert all(t.dtype == torch.float32 for t in pool.tensors.values())
    logits = _prefill_whole(model, _prompts()[3:5], [0, 1], pool)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert torch.isfinite(_decode(model, [1, 2], [0, 1], [8, 33], pool)).all()
    norms = torch.linalg.vector_norm(pool.tensors["S"][:2], dim=-2)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-5, rtol=0)


@torch.inference_mode()
def test_checkpoint_round_trip_keeps_s0(tmp_path) -> None:
    model = _model("lattice-sim-tiny")
    save_checkpoint(model, tmp_path)
    loaded, _ = load_model(str(tmp_path), device="cpu")
    assert loaded.architecture == "lattice" and loaded.config == model.config
    torch.testing.assert_close(loaded.layers[1].mixer.S0, model.layers[1].mixer.S0, atol=0, rtol=0)
    prompts = _prompts()[2:5]
    expected = _prefill_whole(model, prompts, [0, 1, 2], _pool(model, 3))
    torch.testing.assert_close(_prefill_whole(loaded, prompts, [0, 1, 2], _pool(loaded, 3)), expected)


@torch.inference_mode()
def test_a_checkpoint_whose_s0_has_a_zero_column_is_a_load_error(tmp_path) -> None:
    """S0's columns are normalised into the initial state: a zero column made every request's logits NaN."""
    model = _model("lattice-sim-tiny")
    model.layers[1].mixer.S0[0, :, 2] = 0.0
    save_checkpoint(model, tmp_path)
    with pytest.raises(ModelLoadError, match=r"initial state S is not finite at \(1, 0, 0, 2\)"):
        load_model(str(tmp_path), device="cpu")


def test_config_rejects_bad_choices() -> None:
    with pytest.raises(ValueError, match="variant"):
        LatticeConfig(variant="gd")
    with pytest.raises(ValueError, match="step_size"):
        LatticeConfig(step_size="exp")
    with pytest.raises(ValueError, match="num_slots"):
        LatticeConfig(head_dim=16, num_slots=32)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@torch.inference_mode()
def test_triton_path_matches_cpu_path() -> None:
    """The whole model with every Triton kernel (interpreter) against the CPU path: prefill, then decode."""
    model = _model("lattice-tiny", forget_gate=True)
    prompts = [p[:9] for p in _prompts(2)[2:5]]
    logits, steps = {}, {}
    for backend in ("cpu", "triton"):
        pool = _pool(model, 4)
        with force_triton(backend == "triton"):
            logits[backend] = _prefill_whole(model, prompts, [3, 0, 2], pool)
            steps[backend] = _decode(model, [5, 6, 7], [3, 0, 2], [len(p) for p in prompts], pool)
    torch.testing.assert_close(logits["triton"], logits["cpu"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps["triton"], steps["cpu"], atol=1e-4, rtol=1e-4)
