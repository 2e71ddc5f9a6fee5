"""Elman RNN (tanh/ReLU), LSTM and GRU language models equal ``torch.nn`` modules run over the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.loader import load_model, save_checkpoint
from rnnserve.engine.models import MODEL_REGISTRY
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.models.classic_rnn import ClassicRNNConfig
from rnnserve.engine.state_pool import StatePool
from tests.models_hf.hf_harness import check_chunked_and_stepwise, prompts

CASES = {
    "rnn-tanh": ("rnn", {"nonlinearity": "tanh"}),
    "rnn-relu": ("rnn", {"nonlinearity": "relu", "n_layers": 1}),
    "lstm": ("lstm", {}),
    "lstm-3-layers-no-bias": ("lstm", {"n_layers": 3, "bias": False}),
    "gru": ("gru", {"d_embed": 24}),
    "gru-tied": ("gru", {"n_layers": 3, "tie_embeddings": True}),
}
VOCAB = 50


def build(case: str) -> torch.nn.Module:
    architecture, overrides = CASES[case]
    config = ClassicRNNConfig(
        **{"vocab_size": VOCAB, "d_embed": 32, "hidden_size": 32, "n_layers": 2, **overrides}
    )
    model = MODEL_REGISTRY[architecture](config)
    model.init_weights(torch.Generator().manual_seed(1))
    return model.eval().requires_grad_(False)


def reference_logits(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    """Every position's logits from a fresh ``torch.nn`` module holding the model's recurrent weights."""
    c = model.config
    cls = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[model.architecture]
    kwargs = {"nonlinearity": c.nonlinearity} if cls is nn.RNN else {}
    module = cls(c.d_embed, c.hidden_size, c.n_layers, bias=c.bias, batch_first=True, **kwargs)
    module.load_state_dict(model.rnn.state_dict())
    out, _ = module(model.embed.weight[torch.tensor([seq])])
    return out[0] @ model.lm_head.weight.t() + model.lm_head.bias


@torch.inference_mode()
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_nn(case: str) -> None:
    model = build(case)
    seqs = prompts(VOCAB, [1, 4, 30, 9])
    pool = StatePool(model.state_spec(), 6)
    slots = [5, 0, 3, 1]
    expected = [reference_logits(model, s) for s in seqs]
    torch.testing.assert_close(
        model.prefill(PrefillBatch.build(seqs, slots), pool.tensors),
        torch.stack([e[-1] for e in expected]),
        atol=1e-5,
        rtol=1e-5,
    )
    pool = StatePool(model.state_spec(), 6)
    for t in range(max(map(len, seqs))):
        active = [i for i, s in enumerate(seqs) if t < len(s)]
        batch = DecodeBatch.build([seqs[i][t] for i in active], [slots[i] for i in active], [t] * len(active))
        logits = model.decode(batch, pool.tensors)
        torch.testing.assert_close(
            logits, torch.stack([expected[i][t] for i in active]), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("case", ["rnn-relu", "lstm-3-layers-no-bias", "gru"])
def test_checkpoint_chunked_prefill_and_serving(case: str, tmp_path: Path) -> None:
    model = build(case)
    save_checkpoint(model, tmp_path)
    loaded, _ = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.architecture == model.architecture and loaded.config == model.config
    check_chunked_and_stepwise(tmp_path, VOCAB)
    seqs = prompts(VOCAB, [1, 17, 60, 5, 33, 2, 90, 8, 41, 3])
    outs = LLM(
        str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=40
    ).generate(seqs, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for seq, out in zip(seqs, outs, strict=True):
        tokens = list(seq)
        for _ in range(12):
            tokens.append(int(reference_logits(model, tokens)[-1].argmax()))
        assert out.outputs[0].token_ids == tokens[len(seq) :]


@pytest.mark.parametrize(("architecture", "nonlinearity"), [("lstm", "relu"), ("gru", "relu"), ("rnn", "gelu")])
def test_a_nonlinearity_torch_nn_does_not_have_is_refused(architecture: str, nonlinearity: str) -> None:
    """An LSTM or GRU config asking for ReLU was served as tanh: torch.nn's LSTM and GRU have tanh only."""
    config = ClassicRNNConfig(vocab_size=16, d_embed=8, hidden_size=8, n_layers=1, nonlinearity=nonlinearity)
    with pytest.raises(ValueError, match=f"nonlinearity '{nonlinearity}' is not supported"):
        MODEL_REGISTRY[architecture](config)
