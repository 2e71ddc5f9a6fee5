"""Load generator for any OpenAI-compatible server (rnnserve, vLLM, ...): ``rnnserve bench``.

Sends ``--num-prompts`` streaming ``/v1/completions`` requests of about ``--input-len`` prompt tokens that
each generate ``--output-len`` tokens (``ignore_eos``), either ``--concurrency`` at a time or arriving at
``--request-rate`` per second (a Poisson process, or gamma-distributed gaps of ``--burstiness``), and reports
request throughput, output tokens/s, time to first token (TTFT), inter-token latency (ITL: time between streamed
chunks; a chunk carries one token while the server keeps up, several on rnnserve and vLLM when a stream falls
behind the engine), time per output token (TPOT) and end-to-end latency, with ``--goodput`` the rate of
requests within given objectives. The figures mean what ``vllm bench serve``'s of the same names mean (output
tokens from the usage chunk, latency to the last token chunk, percentiles interpolated as numpy's);
docs/performance.md lists the definitions and the few differences. It needs nothing beyond ``/v1/models`` and
streamed ``/v1/completions``, so it measures llama.cpp's server or vLLM as well as rnnserve.

Prompts (``--prompts``): ``text`` sends random common words, their number calibrated to about
``--input-len`` tokens with a local ``--tokenizer tokenizer.json`` or, without one, the server's
``/tokenize`` (rnnserve and vLLM have it); ``ids`` sends ``--input-len`` random token ids below
``--max-token-id``; ``auto`` (default) is ``text`` when a tokenizer is at hand, else ``ids``. Streams are
read as the SSE specification says: lines end only at CR, LF or CRLF. ``--processes N`` splits the load over
N client processes (prompts, concurrency and request rate), for servers faster than one client can read.
``--compare URL`` runs the same load against a second server, alternating between the two for ``--rounds``
rounds, and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import re
import ssl
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter mother"
).split()


@dataclass
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    num_prompts: int = 100
    concurrency: int | None = None
    request_rate: float | None = None
    input_len: int = 128
    output_len: int = 128
    api_key: str | None = None
    seed: int = 0
    ignore_eos: bool = True
    timeout: float = 600.0
    progress: bool = True
    prompts: str = "auto"
    tokenizer: str | None = None
    max_token_id: int = 256
    processes: int = 1
    burstiness: float = 1.0
    goodput: dict[str, float] | None = None  # service level objectives in ms: ttft, tpot, e2el


@dataclass
class RequestResult:
    """One request's figures, in seconds from its sending, as ``vllm bench serve`` takes them: ``ttft`` at the
    first chunk with choices (a token chunk, also one whose text is empty), ``itl`` the gaps between such chunks,
    ``latency`` at the last one (a trailing usage chunk and ``[DONE]`` carry no token)."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    chunks: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def summarize(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean/p50/p90/p99 (in ms for seconds with the default scale); None when there are no values. Percentiles
    interpolate linearly between the two nearest ranks, as numpy's default and so ``vllm bench serve`` do (p50 of
    [1, 2] is 1.5, p99 of 1..100 is 99.01)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        position = (len(ordered) - 1) * q / 100
        below = math.floor(position)
        above = min(below + 1, len(ordered) - 1)
        return (ordered[below] + (ordered[above] - ordered[below]) * (position - below)) * scale

    return {"mean": statistics.fmean(values) * scale, "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def base_url(url: str) -> str:
    """The server root of ``url``: without a trailing slash or ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self.start = time.perf_counter()

    def advance(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:6.1f}s"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def resolve_model(http: httpx.AsyncClient, model: str | None) -> str:
    """``model``, else the first model the server lists; :class:`BenchError` for an answer that is not a model
    list (another web app at ``--url``, an error such as a 401, which names the server's own message)."""
    if model:
        return model
    response = await http.get("/v1/models")
    if response.status_code != 200:
        raise BenchError(f"{response.request.url} answered HTTP {response.status_code}: {error_message(response)}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise BenchError(f"{response.request.url} did not answer an OpenAI model list ({err!r})") from err


def error_message(response: httpx.Response) -> str:
    """The OpenAI error message of ``response``, else the start of its body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def local_token_counter(path: str) -> Callable[[str], int]:
    """Token counts of a local ``tokenizer.json`` (the ``tokenizers`` library)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(Path(path).expanduser()))
    except Exception as err:  # tokenizers raises a bare Exception for a missing or unreadable file
        raise BenchError(f"--tokenizer {path}: cannot read it: {err}") from err
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


async def server_tokens_per_word(http: httpx.AsyncClient, model: str, sample: str) -> float | None:
    """Tokens per word of the server's ``/tokenize`` (rnnserve, vLLM), or ``None`` where it has none."""
    try:
        response = await http.post("/tokenize", json={"model": model, "prompt": sample})
        if response.status_code == 200:
            return max(len(response.json()["tokens"]) / len(sample.split()), 1e-3)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return None


async def make_prompts(http: httpx.AsyncClient, model: str, config: BenchConfig) -> list[str | list[int]]:
    """The requests' prompts: calibrated text or token ids (see the module docstring)."""
    rng = random.Random(config.seed)
    if config.prompts == "ids":
        return [[rng.randrange(config.max_token_id) for _ in range(config.input_len)]
                for _ in range(config.num_prompts)]
    sample = " ".join(WORDS)  # every word once: prompts draw them uniformly (the first 100 were the shortest)
    if config.tokenizer:
        ratio: float | None = max(local_token_counter(config.tokenizer)(sample) / len(WORDS), 1e-3)
    else:
        ratio = await server_tokens_per_word(http, model, sample)
    if ratio is None:
        if config.prompts == "text":
            raise BenchError("--prompts text needs --tokenizer or a server with /tokenize")
        return await make_prompts(http, model, replace(config, prompts="ids"))
    words = max(1.0, config.input_len / ratio)  # a fraction of a word: drawn, so prompts average input_len tokens

    def count() -> int:
        return int(words) + (rng.random() < words % 1)

    return [" ".join(rng.choice(WORDS) for _ in range(count())) for _ in range(config.num_prompts)]


class BenchError(RuntimeError):
    """A benchmark that cannot run as configured."""


_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event, as the SSE specification parses it: lines end only at CR, LF
    or CRLF (never at U+2028 or U+0085), an empty line ends an event, multi-line data joins with LF."""
    pending = b""
    data: list[str] = []
    async for chunk in response.aiter_bytes():
        pending += chunk
        # A CR at the very end may be the first half of a CRLF: keep it until the next chunk decides.
        cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
        lines = _LINE_END.split(pending[:cut])
        pending = lines.pop() + pending[cut:]
        for line in lines:
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append((value[1:] if value.startswith(b" ") else value).decode("utf-8"))
    if data:
        yield "\n".join(data)


async def send_one(http: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    """Send one streamed completion request and time it: time to first token, each inter-token gap,
    latency and token counts; a request that failed, or whose stream ended before ``[DONE]``, is ``ok=False``
    with the reason in ``error``."""
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last: float | None = None
    chunks = 0
    done = False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for data in sse_data(response):
                if data == "[DONE]":  # read on to the body's end: a response left unread closes its connection
                    done = True
                    continue
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    result.error = f"a stream chunk that is not a JSON object: {data[:100]}"
                    return result
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                choices = chunk.get("choices") or []
                if choices:  # a streamed token (or the final chunk of an all-whitespace tail)
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return result
    if last is not None:
        result.latency = last - start
    result.output_tokens = result.output_tokens or chunks
    result.chunks = chunks
    result.ok = result.ttft is not None and done
    if result.ttft is None:
        result.error = "the stream ended without any chunk"
    elif not done:  # cut off (a proxy, a server dying mid-stream): its figures would describe a short request
        result.error = "the stream ended early, without [DONE]"
    return result


def http_client(config: BenchConfig, tls: ssl.SSLContext | None = None) -> httpx.AsyncClient:
    """A client for ``config.url`` that keeps one connection open between its requests (``tls``: a shared TLS
    context, which is costly to build)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.AsyncClient(
        base_url=base_url(config.url),
        headers=headers,
        timeout=config.timeout,
        limits=limits,
        verify=tls or httpx.create_ssl_context(),
    )


class Connections:
    """The load's kept-alive connections, one httpx client each: a request borrows a free one (a new one when
    none is free) and gives it back, and at most ``limit`` are in use at once. One client with many
    connections would cost more than the server it measures: httpx's pool checks every connection's socket
    on each request (at 64 connections, two thirds of the client's CPU)."""

    def __init__(self, config: BenchConfig, limit: int) -> None:
        self.config = config
        self.gate = asyncio.Semaphore(limit)
        self.free: list[httpx.AsyncClient] = []
        self.opened: list[httpx.AsyncClient] = []
        self.tls = httpx.create_ssl_context()

    @asynccontextmanager
    async def borrow(self) -> AsyncIterator[httpx.AsyncClient]:
        async with self.gate:
            client = self.free.pop() if self.free else self.open()
            try:
                yield client
            finally:
                self.free.append(client)

    def open(self) -> httpx.AsyncClient:
        self.opened.append(http_client(self.config, self.tls))
        return self.opened[-1]

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.opened))


async def benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run the load test; returns every figure (latencies in ms)."""
    async with http_client(config) as http:
        model = await resolve_model(http, config.model)
        prompts = await make_prompts(http, model, config)
    if config.processes <= 1:
        results, start, end = await drive(model, prompts, config)
    else:
        results, start, end = await drive_in_processes(model, prompts, config)
    return report(config, model, results, end - start)


async def drive_in_processes(
    model: str, prompts: list[str | list[int]], config: BenchConfig
) -> tuple[list[RequestResult], float, float]:
    """The load split over ``config.processes`` client processes (each with its share of the prompts, the
    concurrency and the request rate), so that parsing streams is not what limits a fast server; the results
    of all, from the first start to the last end (wall clock)."""
    count = min(config.processes, len(prompts), config.concurrency or len(prompts)) or 1  # each process >= 1 stream
    shares = []
    for i in range(count):
        concurrency = None
        if config.concurrency:
            concurrency = config.concurrency // count + (i < config.concurrency % count)
        rate = config.request_rate / count if config.request_rate else None
        share = replace(config, concurrency=concurrency or None, request_rate=rate, processes=1, progress=False,
                        seed=config.seed + i)  # fmt: skip
        shares.append((share, model, prompts[i::count]))
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    # The processes start their loads together: each imports its modules first (about a second), and one that
    # started late would stretch the run from the first start to the last end with fewer requests in flight.
    with context.Manager() as manager, ProcessPoolExecutor(count, mp_context=context) as pool:
        barrier = manager.Barrier(count)
        runs = await asyncio.gather(*(loop.run_in_executor(pool, drive_alone, *share, barrier) for share in shares))
    return [r for results, _, _ in runs for r in results], min(r[1] for r in runs), max(r[2] for r in runs)


def drive_alone(
    config: BenchConfig, model: str, prompts: list[str | list[int]], barrier: Any
) -> tuple[list[RequestResult], float, float]:
    """One client process's share of the load (see :func:`drive_in_processes`), started once every process has
    reached ``barrier``."""
    barrier.wait(timeout=300)  # a process that died instead breaks the barrier rather than hanging the others
    return asyncio.run(drive(model, prompts, config))


async def drive(
    model: str, prompts: list[str | list[int]], config: BenchConfig
) -> tuple[list[RequestResult], float, float]:
    """Send every prompt as ``config`` says; the results and the wall-clock start and end of the load."""
    connections = Connections(config, config.concurrency or len(prompts) or 1)
    progress = Progress(len(prompts), config.progress)
    arrivals = arrival_times(len(prompts), config.request_rate, config.burstiness, random.Random(config.seed + 1))

    async def run(prompt: str | list[int]) -> RequestResult:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": config.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if config.ignore_eos:
            body["ignore_eos"] = True
        async with connections.borrow() as http:
            try:  # the whole request: httpx's own timeout bounds each read, so a trickling stream never ends
                result = await asyncio.wait_for(send_one(http, body), config.timeout)
            except asyncio.TimeoutError:
                result = RequestResult(ok=False, error=f"no complete answer within --timeout {config.timeout:g} s")
        progress.advance()
        return result

    start, schedule_start = time.time(), time.perf_counter()
    tasks = []
    for prompt, arrival in zip(prompts, arrivals, strict=True):
        # Sleep to the arrival's time, not for its gap: a loop busy reading streams wakes late, and gaps slept one
        # after another would add up those delays (the load would arrive slower than --request-rate).
        wait = schedule_start + arrival - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(run(prompt)))
    try:
        results = await asyncio.gather(*tasks)
        end = time.time()
    finally:
        await connections.aclose()
    return list(results), start, end


def arrival_times(count: int, rate: float | None, burstiness: float, rng: random.Random) -> list[float]:
    """When each of ``count`` requests is sent, in seconds from the load's start: all at once without ``rate``;
    else the first at 0 and gaps drawn from a gamma distribution of mean ``1 / rate`` and shape ``burstiness``
    (1: exponential, a Poisson process; below 1 burstier; ``inf``: every gap ``1 / rate``), as ``vllm bench
    serve --burstiness`` draws them, scaled so that the last request is sent at ``(count - 1) / rate`` (the load
    arrives at exactly ``rate`` whatever the seed; vLLM scales its ``count`` gaps, the first before the first
    request, to ``count / rate``)."""
    if not rate or count <= 1:
        return [0.0] * count
    times = [0.0]
    for _ in range(count - 1):
        gap = 1 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1 / (rate * burstiness))
        times.append(times[-1] + gap)
    scale = (count - 1) / rate / times[-1] if times[-1] > 0 else 1.0
    return [t * scale for t in times]


def time_per_output_token(result: RequestResult) -> float | None:
    """Seconds per output token after the first (vLLM's TPOT), ``None`` for fewer than two tokens."""
    if result.ttft is None or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def meets_objectives(result: RequestResult, objectives: dict[str, float]) -> bool:
    """Whether a completed request is within every objective (ms) of ``--goodput``; a request of one token has a
    TPOT of 0, as in vLLM."""
    figures = {"ttft": result.ttft or 0.0, "tpot": time_per_output_token(result) or 0.0, "e2el": result.latency}
    return all(figures[name] * 1000 <= limit for name, limit in objectives.items())


def report(config: BenchConfig, model: str, results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The figures of one run: counts, failure causes, throughputs, goodput (with ``--goodput``), and TTFT,
    inter-token, time-per-output-token and end-to-end latency statistics in ms over the successful requests."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [t for t in map(time_per_output_token, ok) if t is not None]
    goodput = {}
    if config.goodput:
        goodput["request_goodput"] = sum(meets_objectives(r, config.goodput) for r in ok) / duration
    return {
        "config": asdict(config) | {"api_key": bool(config.api_key)},
        "model": model,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(failure_cause(r.error) for r in results if r.error).most_common()),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_chunks": sum(r.chunks for r in ok),
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else 0.0,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        **goodput,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": summarize([x for r in ok for x in r.itl]),
        "tpot_ms": summarize(tpot),
        "e2e_latency_ms": summarize([r.latency for r in ok]),
    }


def failure_cause(error: str) -> str:
    """An error message without its request-specific details, so equal causes count together."""
    return re.sub(r"\d{4,}|req-[\w-]+|cmpl-[\w-]+", "N", error)[:160]


def format_report(figures: dict[str, Any]) -> str:
    """The text report of one run's :func:`report` figures, one figure a line."""
    lines = [
        f"{'model':<28}{figures['model']}",
        f"{'successful requests':<28}{figures['completed']}",
        f"{'failed requests':<28}{figures['failed']}",
        f"{'duration (s)':<28}{figures['duration_s']:.2f}",
        f"{'mean prompt tokens':<28}{figures['mean_prompt_tokens']:.1f}",
        f"{'total output tokens':<28}{figures['total_output_tokens']}",
        f"{'request throughput (req/s)':<28}{figures['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{figures['output_throughput']:.2f}",
        f"{'total throughput (tok/s)':<28}{figures['total_token_throughput']:.2f}",
    ]
    if "request_goodput" in figures:
        lines.append(f"{'request goodput (req/s)':<28}{figures['request_goodput']:.2f}")
    for key, title in (
        ("ttft_ms", "TTFT (ms)"),
        ("itl_ms", "inter-token latency (ms)"),
        ("tpot_ms", "time per output token (ms)"),
        ("e2e_latency_ms", "e2e latency (ms)"),
    ):
        stats = "  ".join(f"{name} {'n/a' if v is None else f'{v:.2f}'}" for name, v in figures[key].items())
        lines.append(f"{title:<28}{stats}")
    lines += [f"failed {count}x: {cause}" for cause, count in figures["failures"].items()]
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """An argparse type: an integer of 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def objective(text: str) -> tuple[str, float]:
    """One ``--goodput`` objective, ``METRIC:MS``."""
    name, _, limit = text.partition(":")
    if name not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(f"{text!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
    try:
        value = float(limit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: METRIC:MS, the limit a number of milliseconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the limit must be 0 or more milliseconds")
    return name, value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``rnnserve bench``."""
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server root, with or without /v1 (default: http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--model", default=None, help="model name to request (default: the server's first model)"
    )
    parser.add_argument(
        "--num-prompts", type=positive_int, default=100, help="requests to send (default: 100)"
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="keep this many requests in flight (default: send all at once)",
    )
    load.add_argument(
        "--request-rate",
        type=positive_float,
        default=None,
        metavar="R",
        help="arrivals at R requests per second, a Poisson process unless --burstiness says otherwise",
    )
    parser.add_argument(
        "--burstiness", type=positive_float, default=1.0,
        help="with --request-rate: the shape of the gamma distribution of the gaps between arrivals, as vLLM's: "
        "1 a Poisson process (default), below 1 burstier, above 1 more even, inf constant gaps",
    )
    parser.add_argument(
        "--goodput", type=objective, nargs="+", default=None, metavar="METRIC:MS",
        help="also report the rate of completed requests within every objective, e.g. ttft:500 tpot:50 "
        "(metrics: ttft, tpot, e2el), as vLLM's --goodput",
    )
    parser.add_argument(
        "--input-len", type=positive_int, default=128, help="prompt tokens, about (default: 128)"
    )
    parser.add_argument(
        "--output-len", type=positive_int, default=128, help="tokens to generate (default: 128)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("RNNSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $RNNSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="seed for prompts and arrival times; a server's prefix cache answers prompts it has seen, so change "
        "it between runs to measure cold prefill, or turn the cache off (default: 0)",
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject unknown fields)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=600.0,
        help="per-request timeout in seconds, from sending it to its stream's end (default: 600)"
    )
    parser.add_argument(
        "--prompts", choices=["auto", "text", "ids"], default="auto",
        help="text (calibrated words), ids (random token ids) or auto: text when a tokenizer is at hand "
        "(default: auto)",
    )
    parser.add_argument(
        "--tokenizer", default=None, metavar="FILE", help="a local tokenizer.json to calibrate text prompts"
    )
    parser.add_argument(
        "--max-token-id", type=positive_int, default=256, help="id prompts draw ids below this (default: 256)"
    )
    parser.add_argument(
        "--compare", default=None, metavar="URL",
        help="also run the same load against this server, alternating, and print the ratios (URL / --url)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=2, help="with --compare: runs per server, alternating (default: 2)"
    )
    parser.add_argument(
        "--processes", type=positive_int, default=1,
        help="client processes sharing the load (default: 1): one parses about 18K streamed chunks/s on a 2-core "
        "EPYC VM, so a faster server needs several, on cores the server does not use",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--json", default=None, metavar="OUT", help="also write every figure to this JSON file"
    )


def run_bench(args: argparse.Namespace) -> int:
    """``rnnserve bench``: run the load (or, with ``--compare``, alternate it between two servers), print the
    report and write it as JSON with ``--json``; 1 when the server is unreachable or any request failed."""
    config = BenchConfig(
        url=args.url,
        model=args.model,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        api_key=args.api_key,
        seed=args.seed,
        ignore_eos=not args.no_ignore_eos,
        timeout=args.timeout,
        progress=not args.no_progress,
        prompts=args.prompts,
        tokenizer=args.tokenizer,
        max_token_id=args.max_token_id,
        processes=args.processes,
        burstiness=args.burstiness,
        goodput=dict(args.goodput) if args.goodput else None,
    )
    try:
        if args.compare:
            figures = asyncio.run(compare(config, args.compare, args.rounds))
            report = format_comparison(figures)
            failed = sum(run["failed"] for side in ("base", "other") for run in figures[side])
        else:
            figures = asyncio.run(benchmark(config))
            report = format_report(figures)
            failed = figures["failed"]
    except httpx.HTTPError as err:
        print(f"rnnserve bench: cannot reach a server: {err or type(err).__name__}", file=sys.stderr)
        return 1
    except BenchError as err:
        print(f"rnnserve bench: {err}", file=sys.stderr)
        return 1
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=2)
        except OSError as err:  # the report still reaches stdout below
            print(f"rnnserve bench: cannot write --json {args.json}: {err.strerror}", file=sys.stderr)
            failed += 1
    print(report)
    return 0 if failed == 0 else 1


COMPARED = (
    ("output_throughput", "output throughput (tok/s)", "higher"),
    ("request_throughput", "request throughput (req/s)", "higher"),
    ("ttft_ms.p50", "TTFT p50 (ms)", "lower"),
    ("ttft_ms.p99", "TTFT p99 (ms)", "lower"),
    ("itl_ms.p50", "inter-token latency p50 (ms)", "lower"),
    ("itl_ms.p99", "inter-token latency p99 (ms)", "lower"),
)


def _figure(run: dict[str, Any], key: str) -> float | None:
    value: Any = run
    for part in key.split("."):
        value = value[part]
    return value


RUN_SEED_STEP = 1000  # --compare's runs use seeds this far apart (a process of a run adds its index to its seed)


async def compare(config: BenchConfig, other_url: str, rounds: int) -> dict[str, Any]:
    """The same load against ``config.url`` and ``other_url``, alternating for ``rounds`` rounds (so slow
    drift of the machine hits both); per figure the median of each side's runs and their ratio. Each run sends
    prompts of its own (the same lengths, other words or ids): repeated prompts would be answered from a
    server's prefix cache, so later rounds would not measure what the first did."""
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "other": []}
    for round_ in range(rounds):  # prompts of their own in every run: a prefix cache answered repeated ones
        seeds = [config.seed + RUN_SEED_STEP * (2 * round_ + side) for side in (0, 1)]
        runs["base"].append(await benchmark(replace(config, seed=seeds[0])))
        runs["other"].append(await benchmark(replace(config, url=other_url, model=None, seed=seeds[1])))
    summary = {}
    for key, _, _ in COMPARED:
        medians = []
        for side in ("base", "other"):
            values = [v for v in (_figure(run, key) for run in runs[side]) if v is not None]
            medians.append(statistics.median(values) if values else None)
        base, other = medians
        summary[key] = {"base": base, "other": other, "ratio": other / base if base and other is not None else None}
    return {"base_url": config.url, "other_url": other_url, "rounds": rounds, **runs, "summary": summary}


def format_comparison(figures: dict[str, Any]) -> str:
    """The text report of :func:`compare`: each figure's medians for both servers and their ratio, then
    each side's failure causes."""
    lines = [f"base  {figures['base_url']}", f"other {figures['other_url']}",
             f"{figures['rounds']} alternating rounds each; medians", "",
             f"{'':<32}{'base':>12}{'other':>12}{'other/base':>12}"]
    for key, title, better in COMPARED:
        row = figures["summary"][key]
        cells = [f"{v:12.2f}" if v is not None else f"{'n/a':>12}" for v in (row["base"], row["other"], row["ratio"])]
        lines.append(f"{title:<32}{''.join(cells)}  ({better} is better)")
    for side in ("base", "other"):
        failures = Counter()
        for run in figures[side]:
            failures.update(run["failures"])
        lines += [f"{side} failed {count}x: {cause}" for cause, count in failures.most_common()]
    return "\n".join(lines)
