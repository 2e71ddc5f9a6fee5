"""Seeded differential checks of the OpenAI API's answers: a generator of valid completion and chat requests over
the sampling fields, and the invariants their answers must keep, alone and against each other (streamed against
not streamed, repeated alone and inside a busy batch, a stop string or stop token taken from an answer against
the answer cut there, sample ``i`` of ``n`` against a request seeded ``seed + i``, chat against the completion of
its rendered prompt). Used by ``test_api_invariants.py``; ``python -m tests.server.api_invariants --cases 2000``
runs a larger storm for local use.

Every check returns the violations it found as strings (empty: none), naming the case's seed and request body so
a violation can be replayed and minimised."""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fastapi.testclient import TestClient

TEXTS = ["The ", "Once upon a time", "Hello there, how are", "1, 2, 3, 4, 5, ", "naïve café ", "€ and ¥ and 日本 ",
         "A B C D E F G", "Water boils at one hundred degrees.", "", "x"]  # fmt: skip
STOPS = [" ", "e", "\n", "é", "日本", "€", "the", "a b", ".", "0", "zz", "\ufffd"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# Logprobs from one run to the next, alone or in a batch, agree to fp32 rounding (docs/api.md).
LOGPROB_TOLERANCE = 1e-3
MIN_JSON_LOGPROB = -9999.0  # a ruled-out token's logprob in JSON
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class Vocabulary:
    """The served tokenizer as the API shows it: each token id's text (``/detokenize``), its EOS id."""

    texts: dict[int, str]
    eos_token_id: int | None

    @classmethod
    def read(cls, client: TestClient) -> Vocabulary:
        info = client.get("/tokenizer_info").json()
        texts = {}
        for token_id in range(info["vocab_size"]):
            response = client.post("/detokenize", json={"tokens": [token_id]})
            if response.status_code == 200:
                texts[token_id] = response.json()["prompt"]
        return cls(texts, info["eos_token_id"])

    @cached_property
    def shared_texts(self) -> set[str]:
        """Texts of more than one id, and the empty text of ids the tokenizer lacks (a model's padding rows)."""
        seen: set[str] = set()
        shared = {""}
        for text in self.texts.values():
            (shared if text in seen else seen).add(text)
        return shared

    @property
    def ids(self) -> list[int]:
        return sorted(self.texts)

    def plain_ids(self) -> list[int]:
        """Ids whose text is printable and no other id's: their text in logprobs names them."""
        counts: dict[str, int] = {}
        for text in self.texts.values():
            counts[text] = counts.get(text, 0) + 1
        return [i for i, t in self.texts.items() if counts[t] == 1 and t.isprintable() and t and i != self.eos_token_id]


@dataclass
class Case:
    """One generated request: ``path`` and JSON ``body`` (without ``stream``), from ``seed``."""

    seed: int
    path: str
    body: dict[str, Any]

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: the same answer every time, alone or in any batch."""
        return self.body.get("temperature") == 0 or "seed" in self.body

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    def describe(self) -> str:
        return f"case seed={self.seed} {self.path} {json.dumps(self.body, ensure_ascii=False)}"


def random_case(seed: int, vocab: Vocabulary) -> Case:
    """A valid request drawn from ``seed``: completions or chat, over the sampling, stopping, logprobs, echo,
    structured output and streaming fields."""
    rng = random.Random(seed)
    chat = rng.random() < 0.35
    plain = vocab.plain_ids()
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 20)}
    if chat:
        messages = [{"role": "user", "content": rng.choice(TEXTS) or "Hi"}]
        if rng.random() < 0.3:
            messages = [{"role": "system", "content": rng.choice(TEXTS)}, *messages]
        body["messages"] = messages
    else:
        kind = rng.choice(["text", "ids", "texts", "id lists"])
        if kind == "text":
            body["prompt"] = rng.choice(TEXTS[:-2])
        elif kind == "ids":
            body["prompt"] = [rng.choice(vocab.ids) for _ in range(rng.randint(1, 8))]
        elif kind == "texts":
            body["prompt"] = [rng.choice(TEXTS[:-2]) for _ in range(2)]
        else:
            body["prompt"] = [[rng.choice(vocab.ids) for _ in range(rng.randint(1, 5))] for _ in range(2)]
    body["n"] = rng.choice([1, 1, 2, 3])
    if rng.random() < 0.4:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.3, 1.5), 3)
        if rng.random() < 0.9:
            body["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.3:
            body["top_p"] = round(rng.uniform(0.3, 1.0), 3)
        if rng.random() < 0.3:
            body["top_k"] = rng.randint(1, 40)
        if rng.random() < 0.2:
            body["min_p"] = round(rng.uniform(0.0, 0.2), 3)
    if rng.random() < 0.15:
        body["presence_penalty"] = round(rng.uniform(-1, 1), 3)
    if rng.random() < 0.15:
        body["frequency_penalty"] = round(rng.uniform(-1, 1), 3)
    if rng.random() < 0.15:
        body["repetition_penalty"] = round(rng.uniform(0.8, 1.3), 3)
    if rng.random() < 0.2:
        body["logit_bias"] = {str(i): rng.choice([-100, 100, round(rng.uniform(-5, 5), 2)])
                              for i in rng.sample(plain, 3)}  # fmt: skip
    structured = rng.random() < 0.08
    if rng.random() < 0.15 and not structured:
        body["allowed_token_ids"] = sorted(rng.sample(plain, rng.randint(2, 20)))
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3)) if rng.random() < 0.7 else rng.choice(STOPS)
    if rng.random() < 0.15:
        body["stop_token_ids"] = rng.sample(plain, 2)
    if rng.random() < 0.2:
        body["include_stop_str_in_output"] = True
    if rng.random() < 0.2 and not structured:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.2:
        body["skip_special_tokens"] = False
    if rng.random() < 0.5:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if not chat and rng.random() < 0.2:
        body["echo"] = True
        if rng.random() < 0.3:
            body["max_tokens"] = 0
            body.pop("min_tokens", None)
    if not chat and rng.random() < 0.15:
        body["prompt_logprobs"] = rng.randint(0, 3)
    if structured:
        body["max_tokens"] = 40
        body["response_format"] = (
            {"type": "json_object"} if rng.random() < 0.5
            else {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        )  # fmt: skip
    if "allowed_token_ids" in body and "min_tokens" in body:
        stopping = set(body.get("stop_token_ids", [])) | ({vocab.eos_token_id} - {None})
        if set(body["allowed_token_ids"]) <= stopping:
            body.pop("min_tokens")
    return Case(seed, CHAT if chat else COMPLETIONS, body)


# --- answers -------------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One choice of an answer, streamed or not, in one shape for both endpoints."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tokens: list[str] | None = None  # the logprobs' token strings
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | list | None] | None = None
    text_offset: list[int] | None = None
    prompt_logprobs: list | None = None
    token_bytes: list[list[int]] | None = None  # chat's


@dataclass
class Answer:
    """An answer: its choices by index, its usage (less the cached tokens, which the prefix cache decides)."""

    choices: dict[int, Choice]
    usage: dict[str, int] | None
    prompt_logprobs: list | None = None  # chat's, at the top level
    problems: list[str] = field(default_factory=list)  # the shape's own violations (a choice ended twice, ...)


def plain_usage(usage: dict | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def chat_logprobs(choice: Choice, logprobs: dict | None) -> None:
    if logprobs is None:
        return
    content = logprobs["content"]
    choice.tokens = (choice.tokens or []) + [e["token"] for e in content]
    choice.token_logprobs = (choice.token_logprobs or []) + [e["logprob"] for e in content]
    choice.top_logprobs = (choice.top_logprobs or []) + [[(t["token"], t["logprob"]) for t in e["top_logprobs"]]
                                                         for e in content]  # fmt: skip
    choice.token_bytes = (choice.token_bytes or []) + [e["bytes"] for e in content]


def completion_logprobs(choice: Choice, logprobs: dict | None) -> None:
    if logprobs is None:
        return
    choice.tokens = (choice.tokens or []) + logprobs["tokens"]
    choice.token_logprobs = (choice.token_logprobs or []) + logprobs["token_logprobs"]
    choice.top_logprobs = (choice.top_logprobs or []) + logprobs["top_logprobs"]
    choice.text_offset = (choice.text_offset or []) + logprobs["text_offset"]


def read_answer(body: dict, chat: bool) -> Answer:
    """A non-streamed response body as an :class:`Answer`."""
    choices: dict[int, Choice] = {}
    problems = []
    for raw in body["choices"]:
        if raw["index"] in choices:
            problems.append(f"choice index {raw['index']} twice")
        choice = Choice(raw["index"], finish_reason=raw["finish_reason"], stop_reason=raw.get("stop_reason"))
        if chat:
            choice.text = raw["message"]["content"] or ""
            chat_logprobs(choice, raw["logprobs"])
        else:
            choice.text = raw["text"]
            completion_logprobs(choice, raw["logprobs"])
            choice.prompt_logprobs = raw.get("prompt_logprobs")
        choices[raw["index"]] = choice
    return Answer(choices, plain_usage(body.get("usage")), body.get("prompt_logprobs"), problems)


def read_stream(events: list[dict], chat: bool, continuous: bool) -> Answer:
    """Streamed chunks (without ``[DONE]``) assembled into an :class:`Answer`, with what the stream's shape
    violated: a choice's delta after its ``finish_reason``, a ``finish_reason`` twice, running usage that falls."""
    choices: dict[int, Choice] = {}
    problems: list[str] = []
    usage = None
    last_completion_tokens = -1
    for event in events:
        if continuous and event.get("usage") is not None:
            tokens = event["usage"]["completion_tokens"]
            if tokens < last_completion_tokens:
                problems.append(f"running usage fell from {last_completion_tokens} to {tokens}")
            last_completion_tokens = tokens
        if not event["choices"]:
            usage = event["usage"]
            continue
        if continuous:
            usage = event["usage"]
        for raw in event["choices"]:
            if chat and raw["index"] not in choices and raw["delta"] != {"role": "assistant", "content": ""}:
                problems.append(f"choice {raw['index']} opens with {raw['delta']}, not the role alone")
            choice = choices.setdefault(raw["index"], Choice(raw["index"]))
            if choice.finish_reason is not None:
                problems.append(f"choice {raw['index']} has a chunk after its finish_reason: {raw}")
            if chat:
                choice.text += raw["delta"].get("content") or ""
                chat_logprobs(choice, raw["logprobs"])
            else:
                choice.text += raw["text"]
                completion_logprobs(choice, raw["logprobs"])
                if "prompt_logprobs" in raw:
                    if choice.prompt_logprobs is not None:
                        problems.append(f"choice {raw['index']} has prompt_logprobs twice")
                    choice.prompt_logprobs = raw["prompt_logprobs"]
            if raw["finish_reason"] is not None:
                choice.finish_reason = raw["finish_reason"]
                choice.stop_reason = raw.get("stop_reason")
    return Answer(choices, plain_usage(usage), None, problems)


def sse_events(text: str) -> list[dict]:
    """The JSON events of an SSE body; a missing ``[DONE]`` or an error event raises."""
    datas = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", f"stream without [DONE]: {text[-300:]!r}"
    events = [json.loads(d) for d in datas[:-1]]
    errors = [e for e in events if "error" in e]
    assert not errors, f"error event: {errors}"
    return events


def post(client: TestClient, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, f"{response.status_code} {response.text} for {path} {body}"
    return response.json()


def ask(client: TestClient, case: Case, stream: bool = False, **changes: Any) -> Answer:
    """The answer to ``case`` with ``changes`` to its body (a value of ``None`` removes the field), streamed or
    not."""
    body = {k: v for k, v in {**case.body, **changes}.items() if v is not None}
    if stream:
        return ask_streamed(client, Case(case.seed, case.path, body), {"include_usage": True})
    return read_answer(post(client, case.path, body), case.chat)


def ask_streamed(client: TestClient, case: Case, stream_options: dict | None) -> Answer:
    body = {**case.body, "stream": True}
    if stream_options is not None:
        body["stream_options"] = stream_options
    response = client.post(case.path, json=body)
    assert response.status_code == 200, f"{response.status_code} {response.text} for {case.describe()}"
    continuous = bool(stream_options and stream_options.get("continuous_usage_stats"))
    return read_stream(sse_events(response.text), case.chat, continuous)


# --- comparisons ---------------------------------------------------------------------------------------------


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: exactly, but floats to :data:`LOGPROB_TOLERANCE`."""
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        if a == b or (isinstance(a, float) or isinstance(b, float)) and abs(a - b) <= LOGPROB_TOLERANCE:
            return []
        return [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def comparable(choice: Choice) -> dict[str, Any]:
    """A choice's fields, its top alternatives without those ruled out (``-9999.0``): their order among
    themselves is arbitrary."""
    fields = dict(vars(choice))
    if choice.top_logprobs is not None:
        fields["top_logprobs"] = [
            None if top is None
            else {t: v for t, v in top.items() if v > MIN_JSON_LOGPROB} if isinstance(top, dict)
            else [(t, v) for t, v in top if v > MIN_JSON_LOGPROB]
            for top in choice.top_logprobs
        ]  # fmt: skip
    return fields


def same_answers(a: Answer, b: Answer, what: str, usage: bool = True) -> list[str]:
    found = differences(sorted(a.choices), sorted(b.choices), f"{what} choice indexes")
    for index in sorted(set(a.choices) & set(b.choices)):
        found += differences(comparable(a.choices[index]), comparable(b.choices[index]), f"{what} choice {index}")
    if usage and a.usage is not None and b.usage is not None:
        found += differences(a.usage, b.usage, f"{what} usage")
    return found[:5]


# --- invariants of one answer --------------------------------------------------------------------------------


@dataclass
class Oracle:
    """What the checks ask the server besides the answer: prompts' token counts (``/tokenize``), token-id
    prompts' text (``/detokenize``), a chat's rendered prompt."""

    client: TestClient
    vocab: Vocabulary

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return post(self.client, "/tokenize", {"prompt": prompt})["tokens"]

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        return post(self.client, "/tokenize", {"messages": messages, "add_generation_prompt": True})["tokens"]

    def prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return post(self.client, "/detokenize", {"tokens": prompt})["prompt"]


def prompts_of(body: dict) -> list[str | list[int]]:
    prompt = body["prompt"]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def completion_count(case: Case, choice: Choice, prompt_length: int) -> int | None:
    """How many tokens the choice generated, as its logprobs list them (``None`` without logprobs)."""
    if choice.tokens is None:
        return None
    return len(choice.tokens) - (prompt_length if case.body.get("echo") else 0)


def check_answer(case: Case, answer: Answer, oracle: Oracle) -> list[str]:
    """The invariants one answer keeps on its own."""
    body = case.body
    found = list(answer.problems)
    n = body.get("n", 1)
    prompts = [oracle.chat_prompt_ids(body["messages"])] if case.chat else [oracle.prompt_ids(p)
                                                                            for p in prompts_of(body)]  # fmt: skip
    if sorted(answer.choices) != list(range(len(prompts) * n)):
        found.append(f"choice indexes {sorted(answer.choices)} for {len(prompts)} prompts x n={n}")
    if answer.usage is not None:
        expected_prompt_tokens = sum(len(p) for p in prompts)
        if answer.usage["prompt_tokens"] != expected_prompt_tokens:
            found.append(f"usage.prompt_tokens {answer.usage['prompt_tokens']} != /tokenize's {expected_prompt_tokens}")
        if answer.usage["total_tokens"] != answer.usage["prompt_tokens"] + answer.usage["completion_tokens"]:
            found.append(f"usage.total_tokens is not the sum: {answer.usage}")
    counts = []
    max_tokens = body["max_tokens"]
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop", [])
    for index, choice in sorted(answer.choices.items()):
        prompt_ids = prompts[index // n] if index // n < len(prompts) else []
        where = f"choice {index}"
        count = completion_count(case, choice, len(prompt_ids))
        counts.append(count)
        if choice.finish_reason not in ("stop", "length"):
            found.append(f"{where}: finish_reason {choice.finish_reason!r}")
        if count is not None:
            if count > max_tokens:
                found.append(f"{where}: {count} tokens > max_tokens {max_tokens}")
            if choice.finish_reason == "length" and count != max_tokens:
                found.append(f"{where}: finish_reason length after {count} of max_tokens {max_tokens}")
            if choice.finish_reason == "stop" and count == 0 and max_tokens > 0:
                found.append(f"{where}: stopped without a token")
            if count < body.get("min_tokens", 0) and choice.finish_reason != "length":
                found.append(f"{where}: {count} tokens < min_tokens {body['min_tokens']}")
            found += check_logprobs(case, choice, count, oracle.vocab, where)
        found += check_token_texts(case, choice, oracle.vocab, where)
        if choice.finish_reason == "length" and choice.stop_reason is not None:
            found.append(f"{where}: stop_reason {choice.stop_reason!r} with finish_reason length")
        if isinstance(choice.stop_reason, str) and choice.stop_reason not in stops:
            found.append(f"{where}: stop_reason {choice.stop_reason!r} is none of the stop strings {stops}")
        if isinstance(choice.stop_reason, int) and choice.stop_reason not in body.get("stop_token_ids", []):
            found.append(f"{where}: stop_reason {choice.stop_reason!r} is none of the stop token ids")
        if body.get("ignore_eos") and choice.finish_reason == "stop" and choice.stop_reason is None:
            if "response_format" not in body:
                found.append(f"{where}: stopped by EOS although ignore_eos")
        text = choice.text
        if body.get("echo"):
            echoed = oracle.prompt_text(prompts_of(body)[index // n])
            if not text.startswith(echoed):
                found.append(f"{where}: echoed text {text!r} does not start with the prompt {echoed!r}")
            text = text[len(echoed) :]
            if max_tokens == 0 and text:
                found.append(f"{where}: max_tokens 0 generated {text!r}")
        if not body.get("min_tokens"):
            kept = body.get("include_stop_str_in_output", False) and isinstance(choice.stop_reason, str)
            if kept and not text.endswith(choice.stop_reason):  # type: ignore[arg-type]
                found.append(f"{where}: text {text!r} does not end with its stop string {choice.stop_reason!r}")
            for stop in stops:
                at = text.find(stop)
                if at != -1 and not (kept and at + len(stop) >= len(text)):
                    found.append(f"{where}: stop string {stop!r} inside the text {text!r}")
        if "allowed_token_ids" in body and choice.tokens is not None:
            allowed = {oracle.vocab.texts[i] for i in body["allowed_token_ids"]}
            generated = choice.tokens[len(prompt_ids) if body.get("echo") else 0 :]
            outside = [t for t in generated if t not in allowed]
            if outside:
                found.append(f"{where}: tokens {outside} outside allowed_token_ids")
        # -100 all but bans a token: one that the allowed tokens or a grammar leave alone is still taken
        banned = {oracle.vocab.texts[int(i)] for i, b in body.get("logit_bias", {}).items() if b == -100}
        if banned and choice.tokens is not None and "allowed_token_ids" not in body and "response_format" not in body:
            generated = choice.tokens[len(prompt_ids) if body.get("echo") else 0 :]
            if banned & set(generated):
                found.append(f"{where}: banned tokens {banned & set(generated)} generated")
        if choice.finish_reason == "stop" and choice.stop_reason is None and "response_format" in body:
            found += check_structured(body["response_format"], text, where)
        found += check_prompt_logprobs(case, choice.prompt_logprobs or answer.prompt_logprobs, prompt_ids, where)
    if answer.usage is not None and all(c is not None for c in counts):
        if sum(counts) != answer.usage["completion_tokens"]:  # type: ignore[arg-type]
            found.append(f"usage.completion_tokens {answer.usage['completion_tokens']} != tokens returned {counts}")
    return found


def check_logprobs(case: Case, choice: Choice, count: int, vocabulary: Vocabulary, where: str) -> list[str]:
    """The logprobs of one choice: at most 0, the top alternatives sorted and of the asked size (plus the chosen
    token), greedy's token the most likely, offsets rising along the text."""
    body = case.body
    found: list[str] = []
    top_n = body.get("top_logprobs", 0) if case.chat else body["logprobs"]
    skip = len(choice.tokens or []) - count
    for i, (token, logprob, top) in enumerate(zip(choice.tokens or [], choice.token_logprobs or [],
                                                  choice.top_logprobs or [], strict=True)):  # fmt: skip
        if i < skip:
            continue
        if logprob is None or logprob > 1e-6:
            found.append(f"{where}: token {i} {token!r} has logprob {logprob}")
            continue
        pairs = list(top.items()) if isinstance(top, dict) else list(top)
        values = [v for _, v in pairs]
        alternatives = values if case.chat else values[:top_n]
        if alternatives != sorted(alternatives, reverse=True):
            found.append(f"{where}: token {i} top_logprobs not sorted: {pairs}")
        if case.chat and len(pairs) != top_n:
            found.append(f"{where}: token {i} has {len(pairs)} top_logprobs, asked {top_n}")
        shared = any(text in vocabulary.shared_texts for text, _ in pairs)  # ids of one text share one key
        if not case.chat and not (top_n - (top_n if shared else 0)) <= len(pairs) <= top_n + 1:
            found.append(f"{where}: token {i} has {len(pairs)} top_logprobs, asked {top_n}")
        if not case.chat and token not in dict(pairs):
            found.append(f"{where}: token {i} {token!r} is not among its top_logprobs {pairs}")
        if body.get("temperature") == 0 and alternatives and logprob < alternatives[0] - 1e-5:
            found.append(f"{where}: greedy token {i} {token!r} ({logprob}) is not the most likely {pairs[0]}")
    if choice.text_offset is not None:
        offsets = choice.text_offset
        if offsets != sorted(offsets):
            found.append(f"{where}: text_offset not monotone: {offsets}")
        if offsets and (offsets[0] != 0 or offsets[-1] > len(choice.text) and choice.finish_reason == "length"):
            found.append(f"{where}: text_offset {offsets} does not fit the text {choice.text!r}")
    return found


def check_token_texts(case: Case, choice: Choice, vocabulary: Vocabulary, where: str) -> list[str]:
    """An answer cut by ``max_tokens`` is its tokens' text: chat's token bytes decode to it; a completion's
    token strings make it up, each at its ``text_offset`` (where no token is a split character's byte)."""
    if choice.finish_reason != "length" or choice.tokens is None or case.body.get("echo"):
        return []
    specials = {vocabulary.texts.get(vocabulary.eos_token_id, None)} if vocabulary.eos_token_id is not None else set()
    if case.body.get("skip_special_tokens", True) and specials & set(choice.tokens):
        return []
    if choice.token_bytes is not None:
        decoded = b"".join(bytes(b) for b in choice.token_bytes).decode("utf-8", "replace")
        return [] if decoded == choice.text else [f"{where}: token bytes decode to {decoded!r}, text {choice.text!r}"]
    if "\ufffd" in choice.text or "\ufffd" in "".join(choice.tokens):
        return []
    found = differences("".join(choice.tokens), choice.text, f"{where} tokens joined vs text")
    offsets = [sum(len(t) for t in choice.tokens[:i]) for i in range(len(choice.tokens))]
    return found + differences(choice.text_offset, offsets, f"{where} text_offset vs the tokens' lengths")


def check_prompt_logprobs(case: Case, entries: list | None, prompt_ids: list[int], where: str) -> list[str]:
    top_n = case.body.get("prompt_logprobs")
    if top_n is None:
        return [f"{where}: prompt_logprobs not asked for but returned"] if entries is not None else []
    if entries is None or len(entries) != len(prompt_ids) or (entries and entries[0] is not None):
        return [f"{where}: prompt_logprobs {entries} for the prompt {prompt_ids}"]
    found = []
    for position, (token_id, entry) in enumerate(zip(prompt_ids[1:], entries[1:], strict=True), start=1):
        own = entry.get(str(token_id))
        if own is None or own["logprob"] > 1e-6 or own["rank"] < 1:
            found.append(f"{where}: prompt token {position} ({token_id}) entry {entry}")
            continue
        ranked = sorted((e for e in entry.values()), key=lambda e: e["rank"])
        if ranked[0]["rank"] == 1 and any(e["logprob"] > ranked[0]["logprob"] + 1e-6 for e in ranked):
            found.append(f"{where}: prompt token {position}: rank 1 is not the most likely: {entry}")
        if not top_n <= len(entry) <= top_n + 1:
            found.append(f"{where}: prompt token {position} has {len(entry)} entries for prompt_logprobs {top_n}")
    return found


def check_structured(response_format: dict, text: str, where: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        return [f"{where}: completed structured output is not JSON: {text!r}"]
    if not isinstance(value, dict):
        return [f"{where}: completed structured output is not an object: {text!r}"]
    if response_format["type"] == "json_schema":
        if not {"name", "age"} <= set(value) or not isinstance(value["name"], str) or type(value["age"]) is not int:
            return [f"{where}: {text!r} does not follow the schema"]
        if len(value["name"]) > 6:
            return [f"{where}: {text!r} breaks maxLength"]
    return []


# --- differential checks -------------------------------------------------------------------------------------


def stream_options_for(case: Case) -> dict | None:
    rng = random.Random(case.seed + 1)
    return rng.choice([None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True},
                       {"include_usage": False}])  # fmt: skip


def check_streamed(client: TestClient, case: Case, answer: Answer, oracle: Oracle) -> list[str]:
    """A streamed answer equals the non-streamed one (deterministic cases), keeps the same invariants, and its
    usage chunk is there exactly when asked for."""
    if case.chat and "prompt_logprobs" in case.body:
        return []
    options = stream_options_for(case)
    streamed = ask_streamed(client, case, options)
    found = list(streamed.problems)
    if (streamed.usage is not None) != bool(options and options.get("include_usage")):
        found.append(f"streamed usage {streamed.usage} with stream_options {options}")
    if case.deterministic:
        found += same_answers(answer, streamed, "streamed vs not")
    else:
        found += check_answer(case, streamed, oracle)
    return found


def derived_checks(client: TestClient, case: Case, answer: Answer, oracle: Oracle) -> list[str]:
    """Requests derived from a deterministic case whose answers follow from the case's, each that applies; half
    of them streamed (by the case's seed)."""
    rng = random.Random(case.seed + 2)
    body = case.body
    checks: list[Callable[[bool], list[str]]] = []
    first = answer.choices.get(0)
    if first is None:
        return []
    restricted = any(k in body for k in ("stop", "stop_token_ids", "min_tokens", "echo", "response_format"))
    if not restricted and first.text:
        checks.append(lambda stream: stop_string_cut(client, case, first, rng, stream))
    if not restricted and first.tokens and oracle.vocab.plain_ids():
        checks.append(lambda stream: stop_token_cut(client, case, first, oracle, rng, stream))
    if body.get("n", 1) > 1 and "seed" in body:
        checks.append(lambda stream: seeded_sample_alone(client, case, answer, stream))
    if "logprobs" in body:
        checks.append(lambda stream: same_without_logprobs(client, case, answer, stream))
    if not case.chat and not body.get("echo"):
        checks.append(lambda stream: echoed(client, case, answer, oracle, stream))
    if case.chat and "prompt_logprobs" not in body:
        checks.append(lambda stream: chat_as_completion(client, case, answer, oracle))
    if body.get("temperature") == 0 and "response_format" not in body:
        checks.append(lambda stream: top_k_one_is_greedy(client, case, answer, stream))
    if not case.chat:
        checks.append(lambda stream: prefill_matches_decode(client, case, oracle, stream))
    streamable = not (case.chat and "prompt_logprobs" in body)
    return [v for check in checks for v in check(streamable and rng.random() < 0.5)]


def stop_string_cut(client: TestClient, case: Case, first: Choice, rng: random.Random, stream: bool) -> list[str]:
    """A stop string taken from the answer's text ends the same answer at its first match; with ``min_tokens``
    (greedy answers whose characters can be placed in tokens), at its first match that ends after the first
    ``min_tokens`` tokens (as vLLM counts them)."""
    start = rng.randrange(len(first.text))
    stop = first.text[start : start + rng.randint(1, 3)]
    include = rng.random() < 0.5
    min_tokens = 0
    placed = first.text_offset is not None and "\ufffd" not in first.text and first.finish_reason == "length"
    if placed and case.body.get("temperature") == 0 and rng.random() < 0.5:  # a sample's draws see EOS masked
        min_tokens = rng.randint(1, len(first.text_offset or []))
    cut = ask(client, case, stream, stop=[stop], include_stop_str_in_output=include, n=1, min_tokens=min_tokens or None)
    at = first.text.find(stop)
    while min_tokens and at != -1 and sum(o < at + len(stop) for o in first.text_offset or []) <= min_tokens:
        at = first.text.find(stop, at + 1)
    end = at + len(stop) if include else at
    expected = (first.text, "length", None) if at == -1 else (first.text[:end], "stop", stop)
    what = f"stop {stop!r} min_tokens {min_tokens}"
    choice = cut.choices[0]
    found = differences((choice.text, choice.finish_reason, choice.stop_reason), expected, what)
    if first.tokens is not None and choice.tokens is not None and choice.tokens != first.tokens[: len(choice.tokens)]:
        found.append(f"{what}: tokens {choice.tokens} are not a prefix of {first.tokens}")
    return found


def stop_token_cut(
    client: TestClient, case: Case, first: Choice, oracle: Oracle, rng: random.Random, stream: bool
) -> list[str]:
    """A stop token id taken from the answer's tokens ends the same answer at that token."""
    by_text = {oracle.vocab.texts[i]: i for i in oracle.vocab.plain_ids()}
    positions = [i for i, t in enumerate(first.tokens or []) if t in by_text]
    if not positions:
        return []
    position = rng.choice(positions)
    token = (first.tokens or [])[position]
    position = (first.tokens or []).index(token)
    include = rng.random() < 0.5
    cut = ask(client, case, stream, stop_token_ids=[by_text[token]], include_stop_str_in_output=include, n=1)
    cut = cut.choices[0]
    tokens = (first.tokens or [])[: position + 1]
    found = differences((cut.tokens, cut.finish_reason, cut.stop_reason), (tokens, "stop", by_text[token]),
                        f"stop token {by_text[token]} ({token!r})")  # fmt: skip
    if first.text_offset is not None and cut.text_offset is not None:
        end = first.text_offset[position] + (len(token) if include else 0)
        if not first.text.startswith(cut.text) or len(cut.text) != end and "\ufffd" not in first.text:
            found.append(f"stop token {token!r}: text {cut.text!r} is not {first.text[:end]!r}")
    return found


def seeded_sample_alone(client: TestClient, case: Case, answer: Answer, stream: bool) -> list[str]:
    """Sample ``i`` of ``n`` draws from ``seed + i``: it equals the one sample of a request seeded so."""
    prompts = 1 if case.chat else len(prompts_of(case.body))
    n = case.body["n"]
    i = random.Random(case.seed + 3).randrange(n)
    alone = ask(client, case, stream, n=1, seed=case.body["seed"] + i)
    found: list[str] = []
    for p in range(prompts):
        mine = vars(answer.choices[p * n + i]) | {"index": p}
        found += differences(mine, vars(alone.choices[p]), f"sample {i} of n={n} vs seed+{i} alone, prompt {p}")
    return found


def same_without_logprobs(client: TestClient, case: Case, answer: Answer, stream: bool) -> list[str]:
    """Asking for logprobs does not change what is generated."""
    plain = ask(client, case, stream, logprobs=None, top_logprobs=None)
    return [d for i in answer.choices for d in differences(
        (answer.choices[i].text, answer.choices[i].finish_reason, answer.choices[i].stop_reason),
        (plain.choices[i].text, plain.choices[i].finish_reason, plain.choices[i].stop_reason),
        f"choice {i} with and without logprobs")]  # fmt: skip


def chat_as_completion(client: TestClient, case: Case, answer: Answer, oracle: Oracle) -> list[str]:
    """A chat answers as the completion of its rendered prompt (``/tokenize`` of its messages) does."""
    body = {k: v for k, v in case.body.items() if k not in ("messages", "logprobs", "top_logprobs")}
    if "logprobs" in case.body:
        body["logprobs"] = case.body.get("top_logprobs", 0)
    body["prompt"] = oracle.chat_prompt_ids(case.body["messages"])
    completion = read_answer(post(client, COMPLETIONS, body), chat=False)
    found = []
    for i, choice in answer.choices.items():
        other = completion.choices[i]
        found += differences((choice.text, choice.finish_reason, choice.stop_reason, choice.tokens),
                             (other.text, other.finish_reason, other.stop_reason, other.tokens),
                             f"chat choice {i} vs its completion")  # fmt: skip
    return found + differences(answer.usage, completion.usage, "chat vs completion usage")


def top_k_one_is_greedy(client: TestClient, case: Case, answer: Answer, stream: bool) -> list[str]:
    """Sampling from the top token alone is greedy decoding."""
    sampled = ask(client, case, stream, temperature=0.8, top_k=1, seed=case.seed, top_p=None, min_p=None)
    return same_answers(answer, sampled, "top_k=1 vs greedy", usage=not stream)


def prefill_matches_decode(client: TestClient, case: Case, oracle: Oracle, stream: bool) -> list[str]:
    """The logprobs of the generated tokens (decode steps) of the case's first prompt, without what shapes the
    distribution, are the prompt logprobs (prefill) of the prompt followed by them."""
    shaping = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
               "response_format", "min_tokens", "echo", "prompt_logprobs")  # fmt: skip
    prompt = prompts_of(case.body)[0]
    changes = {**dict.fromkeys(shaping), "max_tokens": max(case.body["max_tokens"], 1)}
    first = ask(client, case, stream, **changes, prompt=prompt, n=1, logprobs=3).choices[0]
    by_text = {oracle.vocab.texts[i]: i for i in oracle.vocab.plain_ids()}
    generated = [by_text.get(t) for t in first.tokens or []]
    if None in generated:
        return []
    prompt = oracle.prompt_ids(prompt)
    body = {"prompt": prompt + generated, "max_tokens": 1, "prompt_logprobs": 1}
    entries = post(client, COMPLETIONS, body)["choices"][0]["prompt_logprobs"][len(prompt) :]
    found = []
    for i, (token_id, entry) in enumerate(zip(generated, entries, strict=True)):
        best = min(entry.values(), key=lambda e: e["rank"])["logprob"]
        decoded = (first.token_logprobs[i], max(dict(first.top_logprobs[i]).values()))  # type: ignore[index, arg-type]
        found += differences(decoded, (entry[str(token_id)]["logprob"], best), f"decode vs prefill token {i}")
    return found


def echoed(client: TestClient, case: Case, answer: Answer, oracle: Oracle, stream: bool) -> list[str]:
    """With ``echo`` each choice's text is the prompt's followed by the same generated text, its logprobs the
    prompt's tokens' followed by the same generated ones."""
    with_echo = ask(client, case, stream, echo=True)
    prompts = prompts_of(case.body)
    found = []
    for index, choice in answer.choices.items():
        prompt = prompts[index // case.body.get("n", 1)]
        other = with_echo.choices[index]
        found += differences(other.text, oracle.prompt_text(prompt) + choice.text, f"echo choice {index} text")
        if choice.tokens is not None and other.tokens is not None:
            length = len(oracle.prompt_ids(prompt))
            found += differences(other.tokens[length:], choice.tokens, f"echo choice {index} tokens")
            found += differences(other.token_logprobs[length:], choice.token_logprobs,  # type: ignore[index]
                                 f"echo choice {index} token_logprobs")  # fmt: skip
            offsets = [o + len(oracle.prompt_text(prompt)) for o in choice.text_offset or []]
            found += differences(other.text_offset[length:], offsets,  # type: ignore[index]
                                 f"echo choice {index} text_offset")  # fmt: skip
    return found


# --- sessions ------------------------------------------------------------------------------------------------


def check_session(client: TestClient, seed: int, vocab: Vocabulary) -> list[str]:
    """Two sessions given the same seeded turns, one streamed and one not, answer alike; the second turn
    continues as the whole history sent as one prompt does."""
    rng = random.Random(seed)
    turns = [rng.choice(TEXTS[:-2]) for _ in range(2)]
    params = {"max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.9]), "seed": rng.randint(0, 99),
              "ignore_eos": True, "logprobs": 1}  # fmt: skip
    answers: list[list[Answer]] = []
    for stream in (False, True):
        session = post(client, "/v1/sessions", {})["id"]
        case = Case(seed, COMPLETIONS, {})
        turn_answers = []
        for text in turns:
            case.body = {**params, "prompt": text, "session_id": session}
            if stream:
                turn_answers.append(ask_streamed(client, case, {"include_usage": True}))
            else:
                turn_answers.append(ask(client, case))
        answers.append(turn_answers)
        assert client.delete(f"/v1/sessions/{session}").status_code == 200
    found = [d for a, b in zip(*answers, strict=True) for d in same_answers(a, b, f"session seed={seed} turn")]
    first = answers[0][0].choices[0]
    history = Case(seed, COMPLETIONS, {**params, "prompt": turns[0]})
    whole = post(client, "/tokenize", {"prompt": turns[0]})["tokens"]
    by_text = {vocab.texts[i]: i for i in vocab.plain_ids()}
    ids = [by_text.get(t) for t in first.tokens or []]
    if None not in ids:
        prompt = whole + ids + post(client, "/tokenize", {"prompt": turns[1]})["tokens"]
        replay = ask(client, history, prompt=prompt)
        second = answers[0][1].choices[0]
        found += differences((second.text, second.tokens), (replay.choices[0].text, replay.choices[0].tokens),
                             f"session seed={seed} second turn vs the whole history")  # fmt: skip
    return found


# --- the storm -----------------------------------------------------------------------------------------------


@dataclass
class Report:
    cases: int = 0
    violations: list[str] = field(default_factory=list)

    def add(self, case: Case, found: list[str]) -> None:
        self.violations += [f"{case.describe()}: {v}" for v in found]


def run_cases(client: TestClient, seeds: range, workers: int = 8, sessions: int = 0) -> Report:
    """Each seed's case: its answer's invariants, the streamed answer, one derived request; then every
    deterministic case again, all at once (a busy batch), against its first answer; and ``sessions`` seeded
    session checks."""
    vocab = Vocabulary.read(client)
    oracle = Oracle(client, vocab)
    report = Report()
    answers: dict[int, tuple[Case, Answer]] = {}
    for seed in seeds:
        case = random_case(seed, vocab)
        try:
            answer = ask(client, case)
            found = check_answer(case, answer, oracle) + check_streamed(client, case, answer, oracle)
            if case.deterministic:
                answers[seed] = (case, answer)
                found += derived_checks(client, case, answer, oracle)
        except AssertionError as err:
            found = [f"request failed: {err}"]
        report.add(case, found)
        report.cases += 1
    with ThreadPoolExecutor(workers) as pool:
        again = list(pool.map(lambda item: ask(client, item[0]), answers.values()))
    for (case, answer), repeated in zip(answers.values(), again, strict=True):
        report.add(case, same_answers(answer, repeated, "in a busy batch vs alone"))
    for seed in range(sessions):
        report.violations += check_session(client, seeds.start + seed, vocab)
    return report


@contextmanager
def served(model: str | None, **options: Any) -> Iterator[TestClient]:
    """An in-process server of ``model`` (``None``: the embedded default) with test-sized limits, its sessions
    in a temporary folder."""
    from rnnserve.server.app import ServerConfig, create_app

    with tempfile.TemporaryDirectory(prefix="rnnserve-invariants-") as sessions:
        config = ServerConfig.build(**{"model": model, "max_num_seqs": 16, "max_body_bytes": 65536, "api_key": None,
                                       "session_dir": sessions, **options})  # fmt: skip
        with TestClient(create_app(config)) as client:
            yield client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:mingru-tiny", help="default: random:mingru-tiny; '' for the "
                        "embedded default model")
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=10)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # tiny models: one thread is fastest, and immune to OpenMP stalls on a busy machine
    with served(args.model or None) as client:
        report = run_cases(client, range(args.first_seed, args.first_seed + args.cases), sessions=args.sessions)
    for violation in report.violations:
        print(violation)
    print(f"{report.cases} cases, {len(report.violations)} violations")
    sys.exit(1 if report.violations else 0)


if __name__ == "__main__":
    main()
