"""Looped transformers (``lt``, ``tmlt``): a checkpoint in the authors' ``ckpt.pt`` layout, converted and served,
gives the greedy tokens of the authors' forward pass (written below from the facts of ``kevin671/tmlt``'s
``model.py``); prefill == chunked prefill == decode, batched == alone; the ``block_size`` limit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rnnserve import LLM, SamplingParams
from rnnserve.engine.convert import ConvertError, convert_checkpoint, find_converter
from rnnserve.engine.loader import load_model
from rnnserve.engine.models import MODEL_REGISTRY, PRESETS
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.models.looped import LoopedConfig, timestep_frequencies
from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.tokenizer import HFTokenizer, TokenIdTokenizer

MODEL_ARGS = {"n_loop": 3, "n_layer": 12, "n_head": 4, "n_embd": 32, "block_size": 48, "bias": True,
              "vocab_size": 97, "dropout": 0.0}


# ---- the authors' layout and forward pass ------------------------------------------------------------------


def authors_state_dict(model_type: str, args: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the authors' names (``transformer.wte.weight`` tied to ``lm_head.weight``)."""
    g = torch.Generator().manual_seed(seed)
    d, v = args["n_embd"], args["vocab_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    wte = normal(v, d, std=1.0)
    sd = {"transformer.wte.weight": wte, "lm_head.weight": wte,
          "transformer.wpe.weight": normal(args["block_size"], d, std=1.0),
          "transformer.ln_f.weight": 1 + normal(d, std=0.1)}
    linears = {"transformer.attn.q": (d, d), "transformer.attn.k": (d, d), "transformer.attn.v": (d, d),
               "transformer.attn.c_proj": (d, d), "transformer.mlp.c_fc": (4 * d, d),
               "transformer.mlp.c_proj": (d, 4 * d)}
    if model_type == "tmlt":
        linears |= {"timestep_embedder.mlp.0": (d, 256), "timestep_embedder.mlp.2": (d, d),
                    "adaLN_modulation.1": (4 * d, d)}
    for name, (out, inp) in linears.items():
        sd[f"{name}.weight"] = normal(out, inp, std=inp**-0.5)
        if args["bias"] or not name.startswith("transformer."):
            sd[f"{name}.bias"] = normal(out, std=0.1)
    return sd


def save_authors_checkpoint(path: Path, model_type: str, args: dict = MODEL_ARGS, seed: int = 0) -> dict:
    """``ckpt.pt`` as the authors' train.py writes it after ``torch.compile`` (keys under ``_orig_mod.``)."""
    sd = authors_state_dict(model_type, args, seed)
    optimizer = {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.zeros(3)}},
                 "param_groups": [{"lr": 6e-4, "betas": (0.9, 0.95), "params": [0]}]}
    config = {"model_type": model_type, "n_loop": args["n_loop"], "batch_size": 12, "learning_rate": 6e-4,
              "dataset": "wikitext-103", "compile": True}
    torch.save({"model": {f"_orig_mod.{k}": t for k, t in sd.items()}, "optimizer": optimizer, "model_args": dict(args),
                "iter_num": 1000, "best_val_loss": torch.tensor(3.25), "config": config}, path)
    return sd


def authors_forward(sd: dict[str, torch.Tensor], model_type: str, args: dict, idx: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of the authors' ``LoopedGPT`` / ``TMLT`` forward over one whole sequence (fp32)."""
    d, heads = args["n_embd"], args["n_head"]

    def lin(name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))

    def attn(q_src: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor) -> torch.Tensor:
        q, k, v = (lin(f"transformer.attn.{p}", s).view(1, -1, heads, d // heads).transpose(1, 2)
                   for p, s in (("q", q_src), ("k", k_src), ("v", v_src)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return lin("transformer.attn.c_proj", y.transpose(1, 2).reshape(1, -1, d))

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return lin("transformer.mlp.c_proj", F.gelu(lin("transformer.mlp.c_fc", x)))

    def norm(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (d,))

    tokens = torch.tensor([idx])
    x = sd["transformer.wte.weight"][tokens] + sd["transformer.wpe.weight"][torch.arange(len(idx))]
    for t in range(args["n_loop"]):
        if model_type == "lt":
            n = norm(x)
            x = x + attn(n, n, x)
            x = x + mlp(x)
        else:
            half = 128
            freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
            arg = torch.tensor([float(t)])[:, None] * freqs[None]
            t_freq = torch.cat([arg.cos(), arg.sin()], -1)
            t_emb = lin("timestep_embedder.mlp.2", F.silu(lin("timestep_embedder.mlp.0", t_freq)))
            gate_msa, gate_mlp, scale_msa, scale_mlp = lin("adaLN_modulation.1", F.silu(t_emb)).chunk(4, dim=-1)
            n = norm(x) * (1 + scale_msa[:, None])
            x = x + gate_msa[:, None] * attn(n, n, n)
            x = x + gate_mlp[:, None] * mlp(norm(x) * (1 + scale_mlp[:, None]))
    x = F.rms_norm(x, (d,), sd["transformer.ln_f.weight"])
    return F.linear(x, sd["lm_head.weight"])[0]


def authors_greedy(sd: dict, model_type: str, args: dict, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(authors_forward(sd, model_type, args, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def earlier_authors_forward(sd: dict[str, torch.Tensor], args: dict, idx: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of the authors' earlier ``LoopedGPT`` (model.py at 340f627): one fused ``c_attn`` whose
    output splits into q, k, v, and a pre-norm block ``x += attn(norm1(x)); x += mlp(norm2(x))`` (weightless
    norms)."""
    d, heads = args["n_embd"], args["n_head"]

    def lin(name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))

    def attn(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (part.view(1, -1, heads, d // heads).transpose(1, 2)
                   for part in lin("transformer.attn.c_attn", x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return lin("transformer.attn.c_proj", y.transpose(1, 2).reshape(1, -1, d))

    x = sd["transformer.wte.weight"][torch.tensor([idx])] + sd["transformer.wpe.weight"][torch.arange(len(idx))]
    for _ in range(args["n_loop"]):
        x = x + attn(F.rms_norm(x, (d,)))
        x = x + lin("transformer.mlp.c_proj", F.gelu(lin("transformer.mlp.c_fc", F.rms_norm(x, (d,)))))
    x = F.rms_norm(x, (d,), sd["transformer.ln_f.weight"])
    return F.linear(x, sd["lm_head.weight"])[0]


def fuse_qkv(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights in the earlier layout: ``transformer.attn.c_attn`` = q, k, v stacked along the output."""
    fused = {k: t for k, t in sd.items() if not k.startswith(("transformer.attn.q.", "transformer.attn.k.",
                                                               "transformer.attn.v."))}
    for kind in ("weight", "bias"):
        if f"transformer.attn.q.{kind}" in sd:
            fused[f"transformer.attn.c_attn.{kind}"] = torch.cat([sd[f"transformer.attn.{p}.{kind}"] for p in "qkv"])
    return fused


def fuse_qkv_inverse(sd: dict[str, torch.Tensor], args: dict) -> dict[str, torch.Tensor]:
    """q, k, v of a fused ``c_attn`` as the authors' forward splits its output (for the current forward pass)."""
    fused = {kind: sd[f"transformer.attn.c_attn.{kind}"] for kind in ("weight", "bias")
             if f"transformer.attn.c_attn.{kind}" in sd}
    return {f"transformer.attn.{p}.{kind}": part for kind, tensor in fused.items()
            for p, part in zip("qkv", tensor.split(args["n_embd"]), strict=True)}


def rewrite_model(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Replace the ``model`` entry of the ``ckpt.pt`` at ``path`` by ``change(state dict without _orig_mod.)``."""
    data = torch.load(path, weights_only=True)
    data["model"] = change({k.removeprefix("_orig_mod."): t for k, t in data["model"].items()})
    torch.save(data, path)


# ---- conversion and exactness ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["lt", "tmlt"])
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, Path]:
    root = tmp_path_factory.mktemp(request.param)
    sd = save_authors_checkpoint(root / "ckpt.pt", request.param)
    convert_checkpoint(root / "ckpt.pt", root / "native")
    return request.param, sd, root / "native"


def test_convert_writes_native_checkpoint(converted) -> None:
    model_type, sd, dest = converted
    config = json.loads((dest / "config.json").read_text())
    assert config == {"architecture": model_type, "vocab_size": 97, "n_embd": 32, "n_head": 4, "n_loop": 3,
                      "block_size": 48, "bias": True, "tokenizer": "token_ids"}
    tensors = load_file(str(dest / "model.safetensors"))
    assert not any(k.startswith("_orig_mod.") or k == "lm_head.weight" for k in tensors)
    assert torch.equal(tensors["embed.weight"], sd["transformer.wte.weight"])
    assert torch.equal(tensors["block.o.bias"], sd["transformer.attn.c_proj.bias"])
    assert len(tensors) == len(sd) - 1  # everything but the tied head
    assert not (dest / "tokenizer.json").exists()


@pytest.mark.parametrize("bias", [True, False])
def test_served_greedy_tokens_equal_the_authors_forward(converted, bias: bool, tmp_path: Path) -> None:
    """Ragged token-id prompts, several per batch, prompts split over engine steps (16 tokens per step)."""
    model_type, sd, dest = converted
    args = MODEL_ARGS
    if not bias:
        args = {**MODEL_ARGS, "bias": False}
        sd = save_authors_checkpoint(tmp_path / "ckpt.pt", model_type, args, seed=1)
        convert_checkpoint(tmp_path, tmp_path / "native")  # the training out_dir holding ckpt.pt
        dest = tmp_path / "native"
    llm = LLM(str(dest), device="cpu", max_num_seqs=4, max_num_batched_tokens=16)
    assert isinstance(llm.engine.tokenizer, TokenIdTokenizer)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 5, 17, 30, 9)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == authors_greedy(sd, model_type, args, prompt, 10)


def test_prefill_logits_equal_the_authors_forward(converted) -> None:
    model_type, sd, dest = converted
    llm = LLM(str(dest), device="cpu", max_num_seqs=2)
    model = llm.engine.model
    prompt = list(range(3, 43))
    pool = StatePool(model.state_spec(), 2)
    with torch.inference_mode():
        logits = model.prefill(PrefillBatch.build([prompt], [1], all_logits=[True]), pool.tensors)
    torch.testing.assert_close(logits, authors_forward(sd, model_type, MODEL_ARGS, prompt), atol=2e-4, rtol=1e-5)


def test_modulation_table_equals_the_per_step_computation(tmp_path: Path) -> None:
    sd = save_authors_checkpoint(tmp_path / "ckpt.pt", "tmlt")
    convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native")
    model = LLM(str(tmp_path / "native"), device="cpu", max_num_seqs=1).engine.model
    assert model.modulation_table.shape == (3, 4, 32)
    for t in range(3):
        torch.testing.assert_close(model.modulation_table[t], model.modulation_at(torch.tensor([t]))[0],
                                   atol=1e-6, rtol=1e-6)
        hidden = F.linear(timestep_frequencies(torch.tensor([t])), sd["timestep_embedder.mlp.0.weight"],
                          sd["timestep_embedder.mlp.0.bias"])
        t_emb = F.linear(F.silu(hidden), sd["timestep_embedder.mlp.2.weight"], sd["timestep_embedder.mlp.2.bias"])
        per_step = F.linear(F.silu(t_emb), sd["adaLN_modulation.1.weight"], sd["adaLN_modulation.1.bias"])
        torch.testing.assert_close(model.modulation_table[t].flatten(), per_step[0], atol=1e-6, rtol=1e-6)


def test_token_id_text_prompts_round_trip(converted) -> None:
    _, _, dest = converted
    llm = LLM(str(dest), device="cpu", max_num_seqs=2)
    [by_ids] = llm.generate([[5, 60, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    [by_text] = llm.generate("5 60 7", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == "".join(f" {t}" for t in by_ids.outputs[0].token_ids)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=1))


def test_token_id_prompts_take_ascii_digits_only() -> None:
    """``str.isdigit`` takes "²" (int() then fails) and Arabic-Indic "١٢" (int() reads 12): both are refused."""
    tokenizer = TokenIdTokenizer(100)
    assert tokenizer.encode(" 12\t7 ") == [12, 7]
    for text in ("1 ²", "١٢ 3", "-1", "3.0"):
        with pytest.raises(ValueError, match="no tokenizer: send token ids"):
            tokenizer.encode(text)


def test_convert_with_a_tokenizer_serves_text(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: i for i, w in enumerate(["the", "cat", "sat", "on", "mat"])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="the"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    sd = save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native", tokenizer_json=tmp_path / "tokenizer.json")
    llm = LLM(str(tmp_path / "native"), device="cpu", max_num_seqs=1)
    assert isinstance(llm.engine.tokenizer, HFTokenizer)
    [out] = llm.generate("the cat sat", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out.outputs[0].token_ids == authors_greedy(sd, "lt", MODEL_ARGS, [0, 1, 2], 3)


def test_converter_refuses_other_checkpoints(tmp_path: Path) -> None:
    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    data["config"]["model_type"] = "gpt"
    torch.save(data, tmp_path / "gpt.pt")
    assert find_converter(tmp_path / "ckpt.pt").name == "looped"
    with pytest.raises(ConvertError, match="not a looped-transformer checkpoint"):
        convert_checkpoint(tmp_path / "gpt.pt", tmp_path / "out", format_name="looped")
    data["config"]["model_type"] = "tmlt"  # an lt state dict under the tmlt label
    torch.save(data, tmp_path / "mislabelled.pt")
    with pytest.raises(ConvertError, match="missing weights"):
        convert_checkpoint(tmp_path / "mislabelled.pt", tmp_path / "out")


@pytest.mark.parametrize(("stored", "bias"), [(True, True), ("True", True), ("true", True), ("False", False),
                                             ("FALSE", False)])
def test_a_string_bias_in_model_args_is_read_as_the_word_says(tmp_path: Path, stored: object, bias: bool) -> None:
    """``bias: "False"`` (a training script's string) was read as true: the converter then expected bias weights the
    checkpoint does not have and reported them missing."""
    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt", {**MODEL_ARGS, "bias": bias})
    data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    data["model_args"]["bias"] = stored
    torch.save(data, tmp_path / "ckpt.pt")
    checkpoint = convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native")
    assert checkpoint.config["bias"] is bias
    assert json.loads((tmp_path / "native" / "config.json").read_text())["bias"] is bias


def test_a_bias_that_is_no_boolean_is_refused_naming_it(tmp_path: Path) -> None:
    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    data["model_args"]["bias"] = "yes"
    torch.save(data, tmp_path / "ckpt.pt")
    with pytest.raises(ConvertError, match="model_args: bias must be true or false, got 'yes'"):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out")


@pytest.mark.parametrize("stored", [False, "False"])
def test_a_bidirectional_checkpoint_is_refused(tmp_path: Path, stored: object) -> None:
    """The authors' attention reads ``config.is_causal`` (their ``Config`` defaults it to true): a checkpoint trained
    with it false attends to later tokens too, and was converted and served as if causal."""
    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    data["model_args"]["is_causal"] = stored
    torch.save(data, tmp_path / "ckpt.pt")
    with pytest.raises(ConvertError, match="is_causal is false"):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out")
    data["model_args"]["is_causal"] = True
    torch.save(data, tmp_path / "ckpt.pt")
    assert "is_causal" not in convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native").config


@torch.inference_mode()
def test_model_args_saved_with_the_authors_defaults_convert_with_those_defaults(tmp_path: Path) -> None:
    """The authors' train.py builds ``Config(**model_args)``: a field it did not save takes the Config's default. Such
    a checkpoint was refused ("model_args lacks ['bias', 'is_causal']"). n_loop is the exception: its default changed
    between the authors' versions and the weights do not show it, so its absence is refused, naming it."""
    args = {**MODEL_ARGS, "bias": True}
    sd = save_authors_checkpoint(tmp_path / "ckpt.pt", "lt", args)
    data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    for field in ("bias", "is_causal"):
        data["model_args"].pop(field, None)
    torch.save(data, tmp_path / "ckpt.pt")
    checkpoint = convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native")
    assert (checkpoint.config["n_loop"], checkpoint.config["bias"]) == (args["n_loop"], True)
    assert any("model_args lacks ['bias', 'is_causal']" in note for note in checkpoint.notes)
    model, _ = load_model(str(tmp_path / "native"), device="cpu", dtype="float32")
    prompt = [5, 17, 3, 88, 41]
    logits = model.prefill(PrefillBatch.build([prompt], [0]), StatePool(model.state_spec(), 1).tensors)[0]
    torch.testing.assert_close(logits, authors_forward(sd, "lt", args, prompt)[-1], atol=1e-4, rtol=1e-4)
    del data["model_args"]["n_loop"]
    torch.save(data, tmp_path / "ckpt.pt")
    with pytest.raises(ConvertError, match="model_args lacks n_loop"):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out")
    data["model_args"] = {"n_loop": 2}  # every shape from the defaults: the weights are not of that size
    torch.save(data, tmp_path / "ckpt.pt")
    with pytest.raises(ConvertError, match="shape"):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out")


@pytest.mark.parametrize(("field", "value"), [("n_loop", -2), ("n_head", 0), ("n_embd", 0), ("block_size", 0)])
def test_converter_names_a_shape_that_cannot_be(tmp_path: Path, field: str, value: int) -> None:
    """n_loop -2 failed with torch's "upper bound and larger bound inconsistent with step sign" and n_head 0 with
    "integer modulo by zero", neither naming the field."""
    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    data["model_args"][field] = value
    torch.save(data, tmp_path / "ckpt.pt")
    minimum = 0 if field == "n_loop" else 1
    with pytest.raises(ConvertError, match=f"{field} must be at least {minimum}, got {value}"):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out")
    with pytest.raises(ValueError, match=f"{field} must be at least {minimum}, got {value}"):
        MODEL_REGISTRY["tmlt"](LoopedConfig(**{**PRESETS["tmlt-tiny"][1], field: value}))


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_an_unsafe_checkpoint_is_refused_with_its_reason_when_the_format_is_detected(tmp_path: Path) -> None:
    torch.save({"model": {}, "model_args": {}, "config": {"model_type": "lt"}, "hook": _Payload()}, tmp_path / "x.pt")
    with pytest.raises(ConvertError, match="holds code or a class"):
        convert_checkpoint(tmp_path / "x.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_reads_the_checkpoint_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rnnserve.engine.models import looped_checkpoint

    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    reads = []
    load = looped_checkpoint.load_pickled_tensors
    monkeypatch.setattr(looped_checkpoint, "load_pickled_tensors", lambda path: reads.append(path) or load(path))
    convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native")  # detected, then converted
    assert reads == [tmp_path / "ckpt.pt"] and looped_checkpoint._detected is None
    save_authors_checkpoint(tmp_path / "ckpt.pt", "tmlt")  # a file changed since it was detected is read again
    assert find_converter(tmp_path / "ckpt.pt").name == "looped"
    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native", format_name="looped", overwrite=True)
    assert len(reads) == 3 and json.loads((tmp_path / "native" / "config.json").read_text())["architecture"] == "lt"


# ---- consistency ---------------------------------------------------------------------------------------------


def tiny(architecture: str) -> torch.nn.Module:
    """The ``*-tiny`` preset (width 32, 4 heads, 3 loops, block size 64), random weights."""
    preset = "looped-tiny" if architecture == "lt" else "tmlt-tiny"
    model = MODEL_REGISTRY[architecture](LoopedConfig(**PRESETS[preset][1]))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval().requires_grad_(False)


LENGTHS = [1, 2, 7, 8, 30, 63]
SLOTS = [5, 0, 4, 3, 2, 1]  # out of order


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 320, (n,), generator=g).tolist() for n in LENGTHS]


def _run_chunks(model, prompts: list[list[int]], pool: StatePool, chunk: int) -> torch.Tensor:
    """Every prompt in chunks of ``chunk`` tokens, all sequences batched each round (chunk 1 = decode steps)."""
    last: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for start in range(0, max(map(len, prompts)), chunk):
        active = [i for i, p in enumerate(prompts) if start < len(p)]
        if chunk == 1:
            batch = DecodeBatch.build([prompts[i][start] for i in active], [SLOTS[i] for i in active],
                                      [start] * len(active))
            logits = model.decode(batch, pool.tensors)
        else:
            pieces = [prompts[i][start : start + chunk] for i in active]
            logits = model.prefill(PrefillBatch.build(pieces, [SLOTS[i] for i in active], [start] * len(active)),
                                   pool.tensors)
        for row, i in enumerate(active):
            last[i] = logits[row]
    return torch.stack(last)


@torch.inference_mode()
@pytest.mark.parametrize("architecture", ["lt", "tmlt"])
def test_prefill_chunked_prefill_decode_and_alone_agree(architecture: str) -> None:
    model = tiny(architecture)
    prompts = _prompts()
    pools = {name: StatePool(model.state_spec(), 6) for name in ("whole", "chunk5", "chunk16", "decode")}
    whole = model.prefill(PrefillBatch.build(prompts, SLOTS), pools["whole"].tensors)
    assert whole.shape == (len(prompts), 320) and whole.dtype == torch.float32
    results = {"chunk5": _run_chunks(model, prompts, pools["chunk5"], 5),
               "chunk16": _run_chunks(model, prompts, pools["chunk16"], 16),
               "decode": _run_chunks(model, prompts, pools["decode"], 1)}
    for name, logits in results.items():
        torch.testing.assert_close(logits, whole, atol=2e-5, rtol=0, msg=name)
        for key, tensor in pools["whole"].tensors.items():
            torch.testing.assert_close(pools[name].tensors[key], tensor, atol=2e-5, rtol=1e-5, msg=f"{name} {key}")
    for i, prompt in enumerate(prompts):
        alone = model.prefill(PrefillBatch.build([prompt], [0]), StatePool(model.state_spec(), 1).tensors)
        torch.testing.assert_close(alone[0], whole[i], atol=2e-5, rtol=0)


@torch.inference_mode()
@pytest.mark.parametrize("architecture", ["lt", "tmlt"])
def test_decode_continues_prefill_and_leaves_other_slots_alone(architecture: str) -> None:
    model = tiny(architecture)
    seq = _prompts()[-1]
    pool, reference = StatePool(model.state_spec(), 4), StatePool(model.state_spec(), 4)
    for tensor in pool.tensors.values():
        tensor.normal_()
    before = {k: v.clone() for k, v in pool.tensors.items()}
    pool.reset(torch.tensor([2]))
    model.prefill(PrefillBatch.build([seq[:40]], [2]), pool.tensors)
    for t in range(40, len(seq)):
        stepped = model.decode(DecodeBatch.build([seq[t]], [2], [t]), pool.tensors)
    whole = model.prefill(PrefillBatch.build([seq], [2]), reference.tensors)
    torch.testing.assert_close(stepped, whole, atol=2e-5, rtol=0)
    others = torch.tensor([0, 1, 3, 4])
    for name, tensor in pool.tensors.items():
        assert torch.equal(tensor[others], before[name][others])


def test_state_bytes_per_slot() -> None:
    """One K and one V row per loop and position: 2 x n_loop x block_size x n_embd values."""
    model = tiny("tmlt")
    assert StatePool(model.state_spec(), 1).bytes_per_slot == 2 * 3 * 64 * 32 * 4
    assert StatePool(model.to(torch.bfloat16).state_spec(), 1).bytes_per_slot == 2 * 3 * 64 * 32 * 2
    architecture, config = PRESETS["tmlt-wt103"]
    assert (architecture, config["n_loop"], config["n_embd"], config["block_size"]) == ("tmlt", 24, 768, 1024)


# ---- the length limit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["looped-tiny", "tmlt-tiny"])
def test_generation_fills_block_size_and_longer_requests_are_refused(preset: str) -> None:
    llm = LLM(f"random:{preset}", device="cpu", max_num_seqs=2, max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 64
    [out] = llm.generate([list(range(50))], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        llm.generate([list(range(50))], SamplingParams(max_tokens=15))
    with pytest.raises(InvalidParameterError):
        llm.generate([list(range(64))], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidParameterError, match="prompt"):
        llm.generate([list(range(65))], SamplingParams(max_tokens=1))


# ---- CUDA (make gpu-test) ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("architecture", ["lt", "tmlt"])
def test_cuda_graph_decode_equals_eager_and_the_reference_path(architecture: str) -> None:
    """All loops in one captured graph: graph == eager (Triton attention) == reference attention, over 60 decode
    steps of 5 out-of-order slots, with the scratch slot poisoned."""
    from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner
    from rnnserve.kernels.backend import force_triton

    model = tiny(architecture).cuda()
    pools = {name: StatePool(model.state_spec(), 8, "cuda") for name in ("graph", "eager", "reference")}
    pools["graph"].tensors["k"][pools["graph"].scratch_slot] = float("nan")
    runner = CUDAGraphDecodeRunner(model, pools["graph"].tensors, pools["graph"].scratch_slot, 8)
    runner.capture()
    slots = [6, 1, 3, 0, 7]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for step in range(60):
            decode = DecodeBatch.build(torch.randint(0, 320, (5,), generator=g).tolist(), slots, [step] * 5, "cuda")
            got = runner(decode)
            eager = model.decode(decode, pools["eager"].tensors)
            with force_triton(False):
                reference = model.decode(decode, pools["reference"].tensors)
            torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(eager, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("model_type", ["lt", "tmlt"])
def test_a_fused_c_attn_checkpoint_of_the_earlier_code_serves_that_codes_forward(
    model_type: str, bias: bool, tmp_path: Path
) -> None:
    """The authors' earlier model.py projected q, k, v with one ``c_attn``: such a checkpoint was refused as
    "missing weights [q, k, v], unexpected [c_attn]". It is split into q, k, v; its plain ``lt`` block (pre-norm,
    values from the norm, a norm before the MLP) converts with ``prenorm_block``, its ``tmlt`` computes as now."""
    args = {**MODEL_ARGS, "bias": bias}
    sd = fuse_qkv(save_authors_checkpoint(tmp_path / "ckpt.pt", model_type, args, seed=2))
    rewrite_model(tmp_path / "ckpt.pt", lambda _: sd)
    checkpoint = convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native")
    assert checkpoint.config.get("prenorm_block", False) is (model_type == "lt")
    assert any("c_attn" in note for note in checkpoint.notes)
    llm = LLM(str(tmp_path / "native"), device="cpu", max_num_seqs=3, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 6, 21)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(prompt)
        for _ in range(8):
            logits = (earlier_authors_forward(sd, args, tokens) if model_type == "lt"
                      else authors_forward({**sd, **fuse_qkv_inverse(sd, args)}, model_type, args, tokens))
            tokens.append(int(logits[-1].argmax()))
        assert out.outputs[0].token_ids == tokens[len(prompt):]



@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda sd: {**sd, "transformer.attn.c_attn.weight": sd["transformer.attn.c_attn.weight"][:64]},
         r"c_attn.weight has shape \(64, 32\), the fused q, k, v projection of width n_embd 32 is \(96, 32\)"),
        (lambda sd: {**sd, "transformer.attn.c_attn.bias": torch.zeros(96, 2)},  # named block.q.bias once
         r"c_attn.bias has shape \(96, 2\), the fused q, k, v projection of width n_embd 32 is \(96,\)"),
        (lambda sd: {**sd, "transformer.attn.q.weight": sd["transformer.attn.c_attn.weight"][:32]},
         "both the fused transformer.attn.c_attn projection .* and separate q, k, v projections"),
        (lambda sd: {k.replace("c_attn", "qkv_proj"): t for k, t in sd.items()},
         r"unexpected \['transformer.attn.qkv_proj.bias', .*supported are .*transformer.attn.q/k/v, or .*c_attn"),
    ],
)
def test_a_layout_neither_version_wrote_is_refused_saying_what_it_found_and_what_is_supported(
    change, message: str, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    sd = fuse_qkv(save_authors_checkpoint(tmp_path / "ckpt.pt", "lt"))
    rewrite_model(tmp_path / "ckpt.pt", lambda _: change(sd))
    with pytest.raises(ConvertError, match=message):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_prenorm_block_is_refused_for_tmlt() -> None:
    with pytest.raises(ValueError, match="prenorm_block is a setting of the plain looped transformer"):
        MODEL_REGISTRY["tmlt"](LoopedConfig(n_embd=8, n_head=2, n_loop=1, block_size=4, vocab_size=5,
                                            prenorm_block=True))
