"""Mamba-1 and FalconMamba checkpoints in Hugging Face format match ``transformers`` token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models_hf import hf_harness

transformers = pytest.importorskip("transformers")

CASES = {
    "mamba-default": ("mamba", {}, {}),
    "mamba-biases-untied-sharded": (
        "mamba",
        {
            "use_bias": True,
            "use_conv_bias": False,
            "tie_word_embeddings": False,
            "conv_kernel": 3,
            "time_step_rank": 5,
            "state_size": 4,
            "expand": 3,
        },
        {"max_shard_size": "40KB"},
    ),
    "falcon-mamba": ("falcon_mamba", {"state_size": 6, "mixer_rms_eps": 1e-5}, {}),
    # widths the fused CPU decode ops do not take (2-4): the unfused path, not a failed request
    "mamba-conv1": ("mamba", {"conv_kernel": 1}, {}),
    "mamba-conv5": ("mamba", {"conv_kernel": 5}, {}),
}


def build(model_type: str, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    base = {"vocab_size": 96, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 2, "expand": 2}
    if model_type == "mamba":
        return transformers.MambaForCausalLM(transformers.MambaConfig(**{**base, **overrides})).eval()
    config = transformers.FalconMambaConfig(**{**base, **overrides})
    return transformers.FalconMambaForCausalLM(config).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    model_type, overrides, save_kwargs = CASES[case]
    reference = build(model_type, overrides)
    path = hf_harness.save_hf(reference, tmp_path, **save_kwargs)
    if save_kwargs:
        assert (path / "model.safetensors.index.json").exists()
    hf_harness.run_all(reference, path)


def test_eos_from_generation_config(tmp_path: Path) -> None:
    reference = build("mamba", {})
    hf_harness.check_eos_agrees(reference, hf_harness.save_hf(reference, tmp_path))


def test_the_tokenizers_eos_ends_a_sample_beside_the_configured_ones(tmp_path: Path) -> None:
    """A chat fine-tune whose ``tokenizer_config.json`` names ``<|im_end|>`` as EOS and whose config.json keeps
    the base model's id: both end a sample (vLLM's stop set), and the tokenizer's is the EOS that chat templates
    write, as ``transformers``' ``apply_chat_template`` renders ``{{ eos_token }}``."""
    from rnnserve.engine.loader import load_model

    reference = build("mamba", {})
    reference.generation_config.eos_token_id = 3
    path = hf_harness.save_hf(reference, tmp_path)
    (path / "tokenizer_config.json").write_text('{"eos_token": "w9"}')
    _, tokenizer = load_model(str(path), device="cpu", dtype="float32")
    assert tokenizer.eos_token_id == 9 and tokenizer.eos_token_ids == {9, 3}
    (path / "tokenizer_config.json").write_text('{"eos_token": "w3"}')
    _, tokenizer = load_model(str(path), device="cpu", dtype="float32")
    assert tokenizer.eos_token_id == 3 and tokenizer.eos_token_ids == {3}


def test_state_is_conv_tail_and_ssm_state_in_fp32(tmp_path: Path) -> None:
    from rnnserve.engine.loader import load_model

    reference = build("mamba", {})
    model, _ = load_model(str(hf_harness.save_hf(reference, tmp_path)), device="cpu", dtype="bfloat16")
    specs = {s.name: s for s in model.state_spec()}
    assert specs["conv"].shape == (2, 64, 3) and specs["ssm"].shape == (2, 64, 8)
    assert all(s.dtype == torch.float32 for s in specs.values())
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_bf16_residual_stream_follows_the_config(residual_in_fp32: bool, tmp_path: Path) -> None:
    """As in ``transformers``' blocks, ``residual_in_fp32`` (default True) keeps the residual stream of a bf16
    model in fp32; prefill and decode agree either way."""
    from rnnserve.engine.loader import load_model
    from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
    from rnnserve.engine.state_pool import StatePool

    reference = build("mamba", {"residual_in_fp32": residual_in_fp32})
    model, _ = load_model(str(hf_harness.save_hf(reference, tmp_path)), device="cpu", dtype="bfloat16")
    assert model.config.residual_in_fp32 is residual_in_fp32
    ids = torch.tensor([3, 1, 4, 1, 5, 9])
    assert model._stream(ids).dtype == (torch.float32 if residual_in_fp32 else torch.bfloat16)
    with torch.inference_mode():
        pools = [StatePool(model.state_spec(), 2) for _ in range(2)]
        whole = model.prefill(PrefillBatch.build([ids], [1]), pools[0].tensors)
        for position, token in enumerate(ids.tolist()):
            stepwise = model.decode(DecodeBatch.build([token], [1], [position]), pools[1].tensors)
    torch.testing.assert_close(stepwise, whole, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_fp32_parameters_follow_weight_updates(dtype: str) -> None:
    """The mixer converts A_log, D, dt_bias and the conv parameters to fp32 once; an in-place update or a
    ``load_state_dict`` must reach the kernels."""
    from rnnserve.engine.loader import load_model
    from rnnserve.engine.models.base import DecodeBatch
    from rnnserve.engine.state_pool import StatePool

    model, _ = load_model("random:mamba-tiny", device="cpu", dtype=dtype)
    original = {k: v.clone() for k, v in model.state_dict().items()}

    def logits() -> torch.Tensor:  # two steps: A only acts on a non-zero state
        pool = StatePool(model.state_spec(), 2)
        with torch.inference_mode():
            model.decode(DecodeBatch.build([7], [1], [0]), pool.tensors)
            return model.decode(DecodeBatch.build([9], [1], [1]), pool.tensors)

    before = logits()
    mixer = model.backbone.layers[0].mixer
    for param in (mixer.D, mixer.dt_proj.bias, mixer.conv1d.bias, mixer.A_log):
        with torch.no_grad():
            param.add_(0.5)
        changed = logits()
        assert not torch.equal(changed, before)
        model.load_state_dict(original)
        assert torch.equal(logits(), before)


def test_decode_step_raises_no_exceptions_with_inference_weights() -> None:
    """A decode step of a model built under ``inference_mode`` (as the benchmarks and servers build them) runs
    without raising and catching: each caught C++ error costs ~10 us with its backtrace, and reading
    ``_version`` of the mixers' inference-tensor parameters once cost 120 of them per step of mamba-130m."""
    import sys
    from types import FrameType

    from rnnserve.engine.loader import load_model
    from rnnserve.engine.models.base import DecodeBatch
    from rnnserve.engine.state_pool import StatePool

    with torch.inference_mode():
        model, _ = load_model("random:mamba-tiny", device="cpu", dtype="float32")
        pool = StatePool(model.state_spec(), 2)
        batch = DecodeBatch.build([7, 3], [0, 1], [0, 0])
        model.decode(batch, pool.tensors)
        raised: list[str] = []

        def trace(frame: FrameType, event: str, arg: object) -> object:
            if event == "exception":
                raised.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {arg[0].__name__}")  # type: ignore[index]
            return trace

        sys.settrace(trace)
        try:
            model.decode(batch, pool.tensors)
        finally:
            sys.settrace(None)
    assert raised == []
