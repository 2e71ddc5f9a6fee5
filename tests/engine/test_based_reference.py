"""Based against an independent fp32 forward pass of the Based authors' ``GPTLMHeadModel``, written from the facts in
``docs/models.md`` (HazyResearch/based): full-sequence, one sequence at a time, no rnnserve code.

It also builds checkpoints in the authors' layout: a GPT-2-style ``config.json`` with the mixer dicts and a
random state dict under the authors' parameter names. The tests load such directories through rnnserve and
compare logits and greedy tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.loader import load_model
from rnnserve.engine.model_sources import ModelLoadError
from rnnserve.engine.models.base import PrefillBatch
from rnnserve.engine.state_pool import StatePool

TINY_HF_CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 250,
    "pad_vocab_size_multiple": 8,
    "n_embd": 64,
    "n_layer": 5,
    "n_head": 4,
    "n_inner": 96,  # rounded up to 256 by the authors' GatedMlp
    "n_positions": 0,
    "layer_norm_epsilon": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "rms_norm": True,
    "residual_in_fp32": True,
    "activation_function": "swiglu",
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "qkv_proj_bias": False,
    "out_proj_bias": False,
    "rotary_emb_fraction": 1,
    "tie_word_embeddings": True,
    "alt_mixer_layers": [1, 3],
    "alt_mixer_2_layers": [2, 3],  # layer 3 is in both lists: alt_mixer_2 wins
    "mixer": {
        "_target_": "based.models.mixers.convolution.BaseConv",
        "l_max": 2048,
        "use_bias": True,
        "expand_proj": 4,
        "kernel_sizes": 3,
    },
    "alt_mixer": {
        "_target_": "based.models.mixers.linear_attention.LinearAttention",
        "l_max": 2048,
        "feature_map": {"_target_": "based.models.mixers.linear_attention.TaylorExp", "input_dim": 8},
        "feature_dim": 8,
        "num_heads": 2,
        "parallel_implementation": "quadratic",
    },
    "alt_mixer_2": {
        "_target_": "based.models.mixers.slide_attention.SlidingAttention",
        "window_size": 16,
        "num_heads": 99,  # overridden by n_head, as in the authors' sliding_window_additions
        "causal": True,
    },
}


def _kinds(hf: dict) -> list[str]:
    return [
        "sliding" if i in hf["alt_mixer_2_layers"] else "linear" if i in hf["alt_mixer_layers"] else "conv"
        for i in range(hf["n_layer"])
    ]


def random_state_dict(hf: dict, seed: int = 0, fixed_decay: bool = False) -> dict[str, torch.Tensor]:
    """Random weights under the authors' names and shapes (``lm_head.weight`` tied to the embeddings)."""
    g = torch.Generator().manual_seed(seed)
    d = hf["n_embd"]
    vocab = math.ceil(hf["vocab_size"] / hf["pad_vocab_size_multiple"]) * hf["pad_vocab_size_multiple"]
    hidden = (hf["n_inner"] + 255) // 256 * 256
    la = hf["alt_mixer"]
    la_out = la["feature_dim"] * la["num_heads"]

    def w(*shape: int, std: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)

    sd = {"transformer.embeddings.word_embeddings.weight": w(vocab, d, std=0.5), "transformer.ln_f.weight": 1 + w(d)}
    for i, kind in enumerate(_kinds(hf)):
        p = f"transformer.layers.{i}."
        sd[p + "norm1.weight"] = 1 + 0.1 * w(d, std=1.0)
        sd[p + "norm2.weight"] = 1 + 0.1 * w(d, std=1.0)
        sd[p + "mlp.fc1.weight"] = w(2 * hidden, d)
        sd[p + "mlp.fc2.weight"] = w(d, hidden)
        if kind == "conv":
            sd[p + "mixer.in_proj.weight"] = w(4 * d, d)
            sd[p + "mixer.in_proj.bias"] = w(4 * d, std=0.1)
            sd[p + "mixer.out_proj.weight"] = w(d, 2 * d)
            sd[p + "mixer.out_proj.bias"] = w(d, std=0.1)
            sd[p + "mixer.conv.conv.weight"] = w(2 * d, 1, 3, std=0.6)
        elif kind == "linear":
            sd[p + "mixer.proj_q.weight"] = w(la_out, d)
            sd[p + "mixer.proj_k.weight"] = w(la_out, d)
            sd[p + "mixer.proj_v.weight"] = w(d, d)
            sd[p + "mixer.out_proj.weight"] = w(d, d)
        else:
            sd[p + "mixer.Wqkv.weight"] = w(3 * d, d, std=2 * d**-0.5)
            sd[p + "mixer.out_proj.weight"] = w(d, d)
    if fixed_decay:
        sd["transformer.decay.decay"] = torch.log(1 - 2.0 ** (-3 - torch.arange(hf["n_head"]).float()))
    sd["lm_head.weight"] = sd["transformer.embeddings.word_embeddings.weight"]
    return sd


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX halves on all of ``head_dim``: ``x [L, H, d]``, positions ``0 .. L-1``."""
    length, dim = x.shape[0], x.shape[-1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq)[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)


def _taylor(x: torch.Tensor, input_dim: int) -> torch.Tensor:
    x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(start_dim=-2) / math.sqrt(2)
    return torch.cat([torch.ones_like(x[..., :1]), x / input_dim**0.25, x2 / math.sqrt(input_dim)], dim=-1)


@torch.no_grad()
def reference_logits(hf: dict, sd: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Logits ``[L, padded_vocab]`` of one sequence, every position, as the authors' forward computes them."""
    d, eps = hf["n_embd"], hf["layer_norm_epsilon"]
    length = len(tokens)
    x = sd["transformer.embeddings.word_embeddings.weight"][torch.tensor(tokens)]
    for i, kind in enumerate(_kinds(hf)):
        p = f"transformer.layers.{i}."
        h = _rms_norm(x, sd[p + "norm1.weight"], eps)
        if kind == "conv":
            u = F.linear(h, sd[p + "mixer.in_proj.weight"], sd[p + "mixer.in_proj.bias"])
            u1, u2 = u.split(2 * d, dim=-1)
            conv = F.conv1d(u1.T[None], sd[p + "mixer.conv.conv.weight"], padding=2, groups=2 * d)[0, :, :length].T
            out = F.linear(F.silu(conv) * u2, sd[p + "mixer.out_proj.weight"], sd[p + "mixer.out_proj.bias"])
        elif kind == "linear":
            la = hf["alt_mixer"]
            heads, f = la["num_heads"], la["feature_dim"]
            q = F.linear(h, sd[p + "mixer.proj_q.weight"]).view(length, heads, f).transpose(0, 1)
            k = F.linear(h, sd[p + "mixer.proj_k.weight"]).view(length, heads, f).transpose(0, 1)
            v = F.linear(h, sd[p + "mixer.proj_v.weight"]).view(length, heads, d // heads).transpose(0, 1)
            q, k = _taylor(q, la["feature_map"]["input_dim"]), _taylor(k, la["feature_map"]["input_dim"])
            a = torch.tril(torch.einsum("hnd,hmd->hnm", q, k))
            y = torch.einsum("hnm,hme->hne", a, v)
            z = 1 / (torch.einsum("hld,hld->hl", q, k.cumsum(1)) + 1e-12)
            out = F.linear((y * z[..., None]).transpose(0, 1).reshape(length, d), sd[p + "mixer.out_proj.weight"])
        else:
            heads = hf["n_head"]
            qkv = F.linear(h, sd[p + "mixer.Wqkv.weight"]).view(length, 3, heads, d // heads)
            q, k, v = _rotary(qkv[:, 0]), _rotary(qkv[:, 1]), qkv[:, 2]
            scores = torch.einsum("ihd,jhd->hij", q, k) * (d // heads) ** -0.5
            i_pos, j_pos = torch.arange(length)[:, None], torch.arange(length)[None, :]
            visible = (j_pos <= i_pos) & (j_pos >= i_pos - hf["alt_mixer_2"]["window_size"] // 2)
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out = F.linear(torch.einsum("hij,jhd->ihd", weights, v).reshape(length, d), sd[p + "mixer.out_proj.weight"])
        x = x + out
        y, gate = F.linear(_rms_norm(x, sd[p + "norm2.weight"], eps), sd[p + "mlp.fc1.weight"]).chunk(2, dim=-1)
        x = x + F.linear(y * F.silu(gate), sd[p + "mlp.fc2.weight"])
    return F.linear(_rms_norm(x, sd["transformer.ln_f.weight"], eps), sd["lm_head.weight"])


def reference_greedy(hf: dict, sd: dict[str, torch.Tensor], prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generation with argmax over the padded vocabulary, as the authors' ``generate``."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        tokens.append(int(reference_logits(hf, sd, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def save_authors_layout(path: Path, hf: dict = TINY_HF_CONFIG, seed: int = 0, fixed_decay: bool = False) -> dict:
    """An authors'-layout directory: GPT-2-style config.json, safetensors weights under the authors' names (the
    tied matrix stored once, as ``lm_head.weight``) and a word-level tokenizer.json. Returns the state dict."""
    sd = random_state_dict(hf, seed, fixed_decay)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf, "fixed_decay": fixed_decay}))
    stored = {k: v.contiguous() for k, v in sd.items() if k != "transformer.embeddings.word_embeddings.weight"}
    save_file(stored, str(path / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(sd["lm_head.weight"].shape[0])}
    Tokenizer(models.WordLevel(vocab, unk_token="w1")).save(str(path / "tokenizer.json"))
    return sd


PROMPT_LENGTHS = [1, 9, 10, 23, 57, 3]  # the window shows 9 keys: most prompts are longer


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.inference_mode()
def test_authors_layout_logits_match_the_reference(tmp_path: Path) -> None:
    sd = save_authors_layout(tmp_path)
    model, _ = load_model(str(tmp_path), device="cpu", dtype="float32")
    prompts = _prompts(TINY_HF_CONFIG["vocab_size"])
    pool = StatePool(model.state_spec(), 8)
    batch = PrefillBatch.build(prompts, [5, 0, 7, 2, 3, 6], all_logits=[False, False, False, True, False, False])
    ours = model.prefill(batch, pool.tensors)
    expected = [reference_logits(TINY_HF_CONFIG, sd, p) for p in prompts]
    rows = torch.cat([e if i == 3 else e[-1:] for i, e in enumerate(expected)])
    assert ours.shape == (len(prompts) - 1 + PROMPT_LENGTHS[3], 256)
    torch.testing.assert_close(ours, rows, atol=2e-4, rtol=1e-4)


def test_authors_layout_greedy_tokens_match_the_reference(tmp_path: Path) -> None:
    """The acceptance test: ragged prompts longer than the window, greedy, fp32, served through ``LLM``."""
    sd = save_authors_layout(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=4)
    prompts = _prompts(TINY_HF_CONFIG["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference_greedy(TINY_HF_CONFIG, sd, prompt, 12)


def test_decay_buffer_of_based_1b_is_accepted_and_ignored(tmp_path: Path) -> None:
    save_authors_layout(tmp_path / "plain")
    save_authors_layout(tmp_path / "decay", fixed_decay=True)
    plain, _ = load_model(str(tmp_path / "plain"), device="cpu", dtype="float32")
    decay, _ = load_model(str(tmp_path / "decay"), device="cpu", dtype="float32")
    batch = PrefillBatch.build([list(range(30))], [0])
    logits = [m.prefill(batch, StatePool(m.state_spec(), 1).tensors) for m in (plain, decay)]
    assert torch.equal(logits[0], logits[1])


def test_plain_gpt2_config_is_refused_clearly(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    save_file({"wte.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="without Based's 'mixer' dict"):
        load_model(str(tmp_path), device="cpu")


def test_unknown_mixer_class_is_named(tmp_path: Path) -> None:
    hf = {**TINY_HF_CONFIG, "mixer": {"_target_": "based.models.mixers.hyena.Hyena"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="Hyena"):
        load_model(str(tmp_path), device="cpu")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rotary_emb_scale_base": 512}, "rotary_emb_scale_base=512"),  # xPos: the authors' rotary scales q and k
        ({"rotary_emb_interleaved": True}, "rotary_emb_interleaved=True"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"prenorm": False}, "prenorm=False"),  # post-norm blocks, no final norm
        ({"prenorm": "false"}, "prenorm=False"),
        ({"parallel_block": True}, "parallel_block=True"),  # mixer and MLP side by side
        ({"word_embed_proj_dim": 32}, "word_embed_proj_dim=32"),
        ({"head_dim": 8}, "head_dim 8"),  # the window's softmax scale and RoPE width come from it
    ],
)
def test_config_fields_the_authors_code_honours_are_refused_not_ignored(
    tmp_path: Path, change: dict, named: str
) -> None:
    """A field that changes the authors' forward pass and that rnnserve does not compute is a load error: ignored,
    the model would load and answer differently from the checkpoint it was trained as."""
    save_authors_layout(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **change}))
    with pytest.raises(ModelLoadError, match=named):
        load_model(str(tmp_path), device="cpu")
