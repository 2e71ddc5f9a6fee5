"""Multi-turn chat with and without the prefix state cache, and as server sessions (the shape of SGLang's
multi-turn benchmark).

``C`` clients hold ``T``-turn conversations at once against a real ``rnnserve serve`` process: every
conversation starts with the same system prompt, each turn appends a user message and then the assistant's
streamed reply, and the next turn sends the whole conversation again (as chat clients do). The same
conversations run three times in one invocation, each on a fresh server: with the prefix cache, with
``--no-prefix-cache``, and as sessions (``session_id``: each turn after the first sends only its user message,
the server stores the state on disk after every turn; prefix cache on). The table gives time to first token
(client side: from sending the request to the first token's chunk) of turn 1 and of turns >= 2, the prompt
tokens each server prefilled and the tokens its cache skipped (from ``/metrics``), and the ratios of the
cache-less server's figures to the others'. Greedy decoding, so all runs must produce the same replies; the
script checks that too.

    .venv/bin/python benchmarks/multi_turn.py                          # embedded model, 8 clients x 4 turns
    .venv/bin/python benchmarks/multi_turn.py --model random:mamba-130m --clients 32 --turns 8
    .venv/bin/python benchmarks/multi_turn.py --smoke                  # seconds: tiny model and sizes

Text is random lowercase words, sized in characters: with a byte-level tokenizer (the embedded model and
the ``random:`` presets) one character is one token.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import httpx  # noqa: E402

from rnnserve.clients.bench import resolve_model, sse_data  # noqa: E402

WORDS = (
    "state token model recurrent cache prefix server request stream layer scan chunk slot memory turn reply user "
    "system prompt answer question window kernel batch decode prefill shape vector hidden gate value"
).split()
COUNTERS = {
    "prefilled": "rnnserve_prompt_tokens_total",
    "hit_tokens": "rnnserve_prefix_cache_hit_tokens_total",
    "hits": "rnnserve_prefix_cache_hits_total",
    "queries": "rnnserve_prefix_cache_queries_total",
}


@dataclass
class Shape:
    """The workload: conversations, turns, and text sizes in characters."""

    clients: int
    turns: int
    system_chars: int
    user_chars: tuple[int, int]
    max_tokens: int
    seed: int = 0


@dataclass
class ModeResult:
    """One server's run: TTFT (seconds) per turn of every conversation, its replies and its counters."""

    ttft: list[list[float]] = field(default_factory=list)
    replies: list[list[str]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)[:chars]


def conversations(shape: Shape) -> tuple[str, list[list[str]]]:
    """The shared system prompt and every client's user messages (the same for both runs)."""
    rng = random.Random(shape.seed)
    system = text(rng, shape.system_chars)
    users = [[text(rng, rng.randint(*shape.user_chars)) for _ in range(shape.turns)] for _ in range(shape.clients)]
    return system, users


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server(model: str | None, flags: list[str], timeout: float = 600.0) -> Iterator[str]:
    """A ``rnnserve serve`` process on a free port until the block exits; yields its URL once ready."""
    port = free_port()
    command = [sys.executable, "-m", "rnnserve.server.cli", "serve", "--port", str(port), "--log-level", "warning"]
    command += (["--model", model] if model else []) + flags
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def chat_turn(http: httpx.AsyncClient, body: dict) -> tuple[float, str]:
    """Stream one chat completion; (seconds to the first token's chunk, reply text)."""
    start = time.perf_counter()
    ttft: float | None = None
    reply: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        async for data in sse_data(response):
            if data == "[DONE]":  # read on to the body's end: a response left unread closes its connection
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if "role" in delta:  # the opening chunk carries the role alone, before any token
                    continue
                if ttft is None:  # logprobs make every token's chunk count, even one with no text yet
                    ttft = time.perf_counter() - start
                reply.append(delta.get("content") or "")
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft, "".join(reply)


async def conversation(
    http: httpx.AsyncClient, model: str, system: str, users: list[str], max_tokens: int, session: bool
) -> tuple[list[float], list[str]]:
    """One client's turns, each after the previous reply; returns (TTFT per turn, replies). With ``session``
    the conversation is a server session: each turn after the first sends only its user message."""
    messages = [{"role": "system", "content": system}]
    ttfts: list[float] = []
    replies: list[str] = []
    extra: dict[str, str] = {}
    if session:
        created = await http.post("/v1/sessions", json={})
        created.raise_for_status()
        extra["session_id"] = created.json()["id"]
    for user in users:
        messages.append({"role": "user", "content": user})
        body = {
            "model": model, "messages": messages[-1:] if session and replies else messages,
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True, "logprobs": True,
            **extra,
        }  # fmt: skip
        ttft, reply = await chat_turn(http, body)
        messages.append({"role": "assistant", "content": reply})
        ttfts.append(ttft)
        replies.append(reply)
    return ttfts, replies


def read_counters(url: str) -> dict[str, float]:
    page = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for key, name in COUNTERS.items():
        match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", page, re.M)
        values[key] = float(match.group(1)) if match else 0.0
    return values


async def run_conversations(url: str, shape: Shape, sessions: bool) -> ModeResult:
    system, users = conversations(shape)
    result = ModeResult()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0)) as http:
        model = await resolve_model(http, None)
        start = time.perf_counter()
        outcomes = await asyncio.gather(
            *(conversation(http, model, system, turns, shape.max_tokens, sessions) for turns in users)
        )
        result.seconds = time.perf_counter() - start
    result.ttft = [ttfts for ttfts, _ in outcomes]
    result.replies = [replies for _, replies in outcomes]
    return result


def run_mode(model: str | None, shape: Shape, flags: list[str], sessions: bool = False) -> ModeResult:
    """One server's run; with ``sessions`` every conversation is a session stored in a fresh folder."""
    with tempfile.TemporaryDirectory(prefix="rnnserve-multi-turn-") as folder:
        with server(model, [*flags, "--session-dir", folder]) as url:
            result = asyncio.run(run_conversations(url, shape, sessions))
            result.counters = read_counters(url)
    return result


def ms(values: list[float], how: str) -> float:
    return 1000.0 * (statistics.median(values) if how == "p50" else statistics.fmean(values))


def summary(result: ModeResult) -> dict[str, float]:
    first = [t[0] for t in result.ttft]
    later = [x for t in result.ttft for x in t[1:]]
    row = {"t1_p50": ms(first, "p50"), "t1_mean": ms(first, "mean")}
    if later:
        row.update({"t2_p50": ms(later, "p50"), "t2_mean": ms(later, "mean")})
    row.update({"prefilled": result.counters["prefilled"], "hit_tokens": result.counters["hit_tokens"]})
    row["seconds"] = result.seconds
    return row


def print_table(shape: Shape, model: str, on: ModeResult, off: ModeResult, sessions: ModeResult) -> None:
    rows = {"cache on": summary(on), "cache off": summary(off), "sessions": summary(sessions)}
    columns = [
        ("t1_p50", "turn 1 TTFT p50 ms"), ("t1_mean", "turn 1 mean ms"), ("t2_p50", "turns>=2 TTFT p50 ms"),
        ("t2_mean", "turns>=2 mean ms"), ("prefilled", "prefilled tokens"), ("hit_tokens", "cache hit tokens"),
        ("seconds", "wall s"),
    ]  # fmt: skip
    columns = [(key, title) for key, title in columns if key in rows["cache on"]]
    print(
        f"model {model}: {shape.clients} clients x {shape.turns} turns, system prompt {shape.system_chars} chars, "
        f"user messages {shape.user_chars[0]}-{shape.user_chars[1]} chars, max_tokens {shape.max_tokens}"
    )
    print(f"{'':12}" + "".join(f"{title:>22}" for _, title in columns))
    for name, row in rows.items():
        print(f"{name:12}" + "".join(f"{row[key]:>22.1f}" for key, _ in columns))
    for against in ("cache on", "sessions"):
        ratio = {key: rows["cache off"][key] / rows[against][key] if rows[against][key] else float("inf")
                 for key, _ in columns}  # fmt: skip
        name = f"off / {against.split()[-1]}"
        cells = ["-" if key == "hit_tokens" else f"{ratio[key]:.2f}x" for key, _ in columns]  # hits: no ratio
        print(f"{name:12}" + "".join(f"{cell:>22}" for cell in cells))
    hits, queries = on.counters["hits"], on.counters["queries"]
    print(f"prefix cache: {hits:.0f} of {queries:.0f} requests resumed from a snapshot")
    print(f"replies identical with and without the cache: {'yes' if on.replies == off.replies else 'NO'}")
    print(f"replies identical in sessions: {'yes' if sessions.replies == off.replies else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="what `rnnserve serve --model` gets (default: embedded model)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-chars", type=int, default=1000, help="shared system prompt length")
    parser.add_argument("--user-chars", type=int, nargs=2, default=(100, 200), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=48, help="assistant reply length")
    parser.add_argument(
        "--server-flag",
        action="append",
        default=[],
        help="extra `rnnserve serve` argument, e.g. --server-flag=--dtype=float32 (repeat)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.model = args.model or "random:mingru-tiny"
        shape = Shape(clients=2, turns=2, system_chars=64, user_chars=(16, 24), max_tokens=4)
    else:
        shape = Shape(args.clients, args.turns, args.system_chars, tuple(args.user_chars), args.max_tokens)
    flags = [*args.server_flag, "--max-num-seqs", str(max(shape.clients, 1))]
    on = run_mode(args.model, shape, flags)
    off = run_mode(args.model, shape, [*flags, "--no-prefix-cache"])
    sessions = run_mode(args.model, shape, flags, sessions=True)
    print_table(shape, args.model or "embedded default", on, off, sessions)


if __name__ == "__main__":
    main()
