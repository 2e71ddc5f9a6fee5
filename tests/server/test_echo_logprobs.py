"""Prompt logprobs over HTTP: OpenAI's ``echo`` with ``logprobs`` (``max_tokens: 0`` included) and vLLM's
``prompt_logprobs``, equal to the offline engine's, streamed or not; ``/tokenizer_info``."""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, normalizers

from rnnserve import LLM, SamplingParams
from rnnserve.engine.chat_template import DEFAULT_CHAT_TEMPLATE
from rnnserve.engine.loader import build_random, save_checkpoint
from rnnserve.engine.outputs import RequestOutput
from rnnserve.server.app import create_app
from tests.server.conftest import TINY, tiny_config
from tests.server.test_api import complete, events
from tests.server.tiny_checkpoint import EOS, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(60)

PROMPT = "Hello, world"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def offline() -> RequestOutput:
    llm = LLM(TINY, device="cpu", max_num_seqs=2)
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))[0]


def offline_logprobs(offline: RequestOutput) -> list[float | None]:
    return [None if e is None else e.logprob for e in offline.prompt_logprobs]  # type: ignore[union-attr]


def test_echo_with_logprobs_returns_the_prompt_logprobs_then_the_generated_ones(
    client: TestClient, offline: RequestOutput
) -> None:
    body = complete(client, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, **GREEDY)
    [choice] = body["choices"]
    generated = offline.outputs[0]
    assert choice["text"] == PROMPT + generated.text
    lp = choice["logprobs"]
    assert lp["tokens"][: len(PROMPT)] == list(PROMPT) and len(lp["tokens"]) == len(PROMPT) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][: len(PROMPT)] == pytest.approx(offline_logprobs(offline), abs=1e-5)
    for top, expected in zip(lp["top_logprobs"][1 : len(PROMPT)], offline.prompt_logprobs[1:], strict=True):
        assert 1 <= len(top) <= 3  # keyed by token text: ids without text share the key ""
        assert max(top.values()) == pytest.approx(expected.top[0][1], abs=1e-5)  # type: ignore[union-attr]
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert token in top  # the token itself as well (OpenAI: up to logprobs + 1 entries)
    assert lp["text_offset"] == list(accumulate((len(t) for t in lp["tokens"][:-1]), initial=0))
    plain = complete(client, prompt=PROMPT, logprobs=2, max_tokens=3, **GREEDY)["choices"][0]["logprobs"]
    assert lp["token_logprobs"][len(PROMPT) :] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    assert 0 <= body["usage"].pop("prompt_tokens_details")["cached_tokens"] < len(PROMPT)
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 3, "total_tokens": len(PROMPT) + 3}


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client: TestClient, offline: RequestOutput) -> None:
    body = complete(client, prompt=[PROMPT, "Hi"], echo=True, logprobs=1, max_tokens=0, **GREEDY)
    first, second = body["choices"]
    assert (first["text"], second["text"]) == (PROMPT, "Hi")
    assert first["finish_reason"] == second["finish_reason"] == "length"
    assert first["logprobs"]["token_logprobs"] == pytest.approx(offline_logprobs(offline), abs=1e-5)
    assert len(second["logprobs"]["tokens"]) == 2
    assert body["usage"]["completion_tokens"] == 0
    assert complete(client, prompt=PROMPT, echo=True, max_tokens=0)["choices"][0]["logprobs"] is None


def test_streamed_echo_logprobs_equal_the_non_streamed_ones(client: TestClient) -> None:
    request = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, **GREEDY}
    whole = complete(client, **request)["choices"][0]
    chunks = events(client.post("/v1/completions", json={**request, "stream": True}).text)
    choices = [c["choices"][0] for c in chunks[:-1]]  # type: ignore[index]
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = [lp for c in choices if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-6)
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    only_prompt = events(client.post("/v1/completions", json={**request, "max_tokens": 0, "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in only_prompt[:-1]) == PROMPT  # type: ignore[index]


def test_vllm_prompt_logprobs_on_completions_and_chat(client: TestClient, offline: RequestOutput) -> None:
    [choice] = complete(client, prompt=PROMPT, prompt_logprobs=2, max_tokens=2, **GREEDY)["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    for token, entry, expected in zip(PROMPT[1:], entries[1:], offline.prompt_logprobs[1:], strict=True):
        mine = entry[str(ord(token))]
        assert mine["logprob"] == pytest.approx(expected.logprob, abs=1e-5)  # type: ignore[union-attr]
        assert mine["decoded_token"] == token and mine["rank"] == expected.rank  # type: ignore[union-attr]
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2] and len(entry) in (2, 3)
    request = {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2, "stream": True, **GREEDY}
    streamed = events(client.post("/v1/completions", json=request).text)
    assert streamed[0]["choices"][0]["prompt_logprobs"] == entries  # type: ignore[index]
    assert all("prompt_logprobs" not in c["choices"][0] for c in streamed[1:-1])  # type: ignore[index]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0, "max_tokens": 2}
    body = client.post("/v1/chat/completions", json=chat).json()
    prompt_ids = client.post("/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    assert len(body["prompt_logprobs"]) == len(prompt_ids) and body["prompt_logprobs"][0] is None
    for entry, token in zip(body["prompt_logprobs"][1:], prompt_ids[1:], strict=True):
        assert list(entry) == [str(token)] and entry[str(token)]["rank"] >= 1
    streamed_chat = client.post("/v1/chat/completions", json={**chat, "stream": True})  # silently dropped them
    assert streamed_chat.status_code == 400 and streamed_chat.json()["error"]["param"] == "prompt_logprobs"
    assert "prompt_logprobs" not in complete(client, prompt=PROMPT, max_tokens=1)["choices"][0]


BAD = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_out_of_range_prompt_logprob_requests_are_400(client: TestClient, body: dict, param: str) -> None:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_tokenizer_info_and_tokenize_as_lm_eval_calls_them(client: TestClient) -> None:
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "ByteTokenizer" and info["eos_token_id"] == 256
    assert "eos_token" in info and info["model_max_length"] > 0
    assert info["chat_template"] == DEFAULT_CHAT_TEMPLATE  # what chat requests are rendered with
    tokens = client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert tokens == list(b"test")
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "test"


def llama_style_checkpoint(path: Path) -> Path:
    """mingru-tiny weights under a Llama-2-style tokenizer: ``▁`` put before the first word and stripped again by
    the decoder, byte fallback, and a special token a prompt may type."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁h", "▁he", "ll", "llo"]
    vocab.update({piece: 256 + i for i, piece in enumerate(pieces)})
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("ll", "o")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<|end|>"])
    model, _ = build_random("mingru-tiny", torch.device("cpu"), None)
    save_checkpoint(model, path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return path


@pytest.mark.parametrize("prompt", ["hello world", "hi<|end|>x y", "héllo"])
def test_echoed_text_offsets_index_the_returned_text(tmp_path: Path, prompt: str) -> None:
    """``text[text_offset[i]:]`` starts with token ``i``'s text. Counting the tokens' bytes placed every echoed
    token one character too far after a Metaspace ``▁`` the returned text does not hold, and ignored a special
    token typed in the prompt (it counted no character, though the echoed text holds it)."""
    config = tiny_config(model=str(llama_style_checkpoint(tmp_path / "llama")))
    with TestClient(create_app(config)) as client:
        [choice] = complete(client, prompt=prompt, echo=True, logprobs=1, max_tokens=2, **GREEDY)["choices"]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith(prompt)
    echoed = len(lp["tokens"]) - 2
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for token, offset in zip(lp["tokens"][:echoed], offsets[:echoed], strict=True):
        if token.strip() and "\ufffd" not in token:
            assert text[offset:].startswith(token.strip()), (token, offset, text)
    assert offsets[echoed] == len(prompt)


def test_special_tokens_in_logprobs_are_named_by_their_own_text(tmp_path: Path) -> None:
    """A special token's logprob string was its decoded text, empty: every special token shared one
    ``top_logprobs`` key and a client could not tell which came. As in vLLM it is the token's own text (the
    response's text still leaves it out), and chat's ``bytes`` are that text's."""
    path = write_tiny_checkpoint(tmp_path / "hf")
    eos = json.loads((path / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    body = {"max_tokens": 2, "ignore_eos": True, "logit_bias": {str(eos): 100}, **GREEDY}
    with TestClient(create_app(tiny_config(model=str(path)))) as client:
        [choice] = complete(client, prompt="Hi", logprobs=2, **body)["choices"]
        messages = [{"role": "user", "content": "Hi"}]
        chat_body = {"messages": messages, "logprobs": True, "top_logprobs": 2, **body}
        chat = client.post("/v1/chat/completions", json=chat_body).json()
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == [EOS, EOS]
    assert all(EOS in top and len(top) >= 2 for top in choice["logprobs"]["top_logprobs"])
    [content] = chat["choices"][0]["logprobs"]["content"][:1]
    assert content["token"] == EOS and bytes(content["bytes"]) == EOS.encode()
    assert chat["choices"][0]["message"]["content"] == ""


def test_skip_special_tokens_false_keeps_their_text(tmp_path: Path) -> None:
    """vLLM's ``skip_special_tokens: false`` was ignored (with a log line): special tokens' text stays in the
    output, streamed as not, and ``text_offset`` counts it."""
    path = write_tiny_checkpoint(tmp_path / "hf")
    eos = json.loads((path / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "logit_bias": {str(eos): 100}, "logprobs": 0,
            "skip_special_tokens": False, **GREEDY}  # fmt: skip
    with TestClient(create_app(tiny_config(model=str(path)))) as client:
        [choice] = complete(client, **body)["choices"]
        streamed = events(client.post("/v1/completions", json={**body, "stream": True}).text)
        [skipped] = complete(client, **{**body, "skip_special_tokens": True})["choices"]
    assert choice["text"] == EOS * 3 and skipped["text"] == ""
    chunks = [c for c in streamed if isinstance(c, dict) and c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == EOS * 3
    assert choice["logprobs"]["text_offset"] == [0, len(EOS), 2 * len(EOS)]
    llm = LLM(str(path), device="cpu", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={eos: 100},
                            skip_special_tokens=False)  # fmt: skip
    assert llm.generate("Hi", params)[0].outputs[0].text == EOS * 2


def test_detokenize_and_an_echoed_token_id_prompt_keep_special_tokens(tmp_path: Path) -> None:
    """As vLLM (and ``transformers``' default decode): ``/detokenize`` of ``/tokenize``'s ids gives the text back,
    special tokens included, and a prompt sent as ids echoes as the same prompt sent as text."""
    text = f"Hi{EOS}there"
    with TestClient(create_app(tiny_config(model=str(write_tiny_checkpoint(tmp_path / "hf"))))) as client:
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
        echoes = [complete(client, prompt=p, echo=True, max_tokens=0, logprobs=0)["choices"][0] for p in (text, ids)]
    assert echoes[0]["text"] == echoes[1]["text"] == text
    assert echoes[0]["logprobs"]["text_offset"] == echoes[1]["logprobs"]["text_offset"]
