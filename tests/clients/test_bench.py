"""``rnnserve bench`` against a live server with tiny sizes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from rnnserve.clients import bench
from rnnserve.clients.bench import BenchConfig, benchmark, summarize
from rnnserve.server import cli
from rnnserve.server.background import serve_in_thread
from tests.server.conftest import API_KEY, TINY

pytestmark = pytest.mark.timeout(90)


def test_summarize_without_values() -> None:
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_bench_with_concurrency(live_url: str) -> None:
    config = BenchConfig(url=f"{live_url}/v1", num_prompts=4, concurrency=2, input_len=16, output_len=4,
                         api_key=API_KEY, progress=False)  # fmt: skip
    figures = asyncio.run(benchmark(config))
    assert figures["completed"] == 4 and figures["failed"] == 0
    assert figures["total_output_tokens"] == 16
    assert 8 <= figures["mean_prompt_tokens"] <= 24  # words calibrated through /tokenize (byte-level here)
    assert figures["request_throughput"] > 0 and figures["output_throughput"] > 0
    assert all(figures["ttft_ms"][k] > 0 for k in ("mean", "p50", "p90", "p99"))
    assert figures["tpot_ms"]["p99"] >= figures["tpot_ms"]["p50"] > 0
    # Gaps between chunks: none when a loaded server merged each request's tokens into one chunk.
    itl = figures["itl_ms"]
    assert itl["p50"] is None or itl["p99"] >= itl["p50"] > 0


def test_bench_split_over_client_processes_sends_every_prompt_once(live_url: str) -> None:
    config = BenchConfig(url=live_url, num_prompts=5, concurrency=3, input_len=8, output_len=3, api_key=API_KEY,
                         progress=False, processes=2)  # fmt: skip
    figures = asyncio.run(benchmark(config))
    assert figures["completed"] == 5 and figures["failed"] == 0
    assert figures["total_output_tokens"] == 15
    assert figures["config"]["processes"] == 2
    assert 0 < figures["duration_s"] < 60 and figures["ttft_ms"]["p50"] > 0


def test_bench_cli_with_request_rate_writes_json(
    live_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--url", live_url, "--num-prompts", "3", "--request-rate", "50", "--input-len", "8",
            "--output-len", "3", "--api-key", API_KEY, "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed, progress = capsys.readouterr()
    assert "output throughput (tok/s)" in printed and "TTFT (ms)" in printed and "3/3" in progress
    figures = json.loads(out.read_text())
    assert figures["completed"] == 3 and figures["total_output_tokens"] == 9
    assert set(figures["itl_ms"]) == {"mean", "p50", "p90", "p99"}


def test_bench_reports_failures(live_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--url", live_url, "--num-prompts", "2", "--output-len", "2", "--api-key", "wrong",
            "--model", "x", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 1
    assert "HTTP 401" in capsys.readouterr().out


def test_bench_keeps_one_connection_per_concurrent_request() -> None:
    """Each stream is read to its end and its connection reused: a connection per request would make the server
    under test pay a TCP handshake per request (and hide its keep-alive behaviour)."""
    app = FastAPI()
    client_ports: list[int] = []

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    def completions(request: Request) -> StreamingResponse:
        assert request.client is not None
        client_ports.append(request.client.port)
        chunk = {"choices": [{"index": 0, "text": "a"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
        events = [chunk, chunk, usage]
        body = [f"data: {json.dumps(event)}\n\n" for event in events] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(body), media_type="text/event-stream")

    with serve_in_thread(app) as url:
        config = BenchConfig(url=url, num_prompts=12, concurrency=3, input_len=4, output_len=2, prompts="ids",
                             progress=False)  # fmt: skip
        figures = asyncio.run(benchmark(config))
    assert figures["completed"] == 12 and figures["total_output_tokens"] == 24
    assert len(client_ports) == 12 and len(set(client_ports)) <= 3


def fake_server(cut_off: bool, chunks: int = 2) -> tuple[FastAPI, dict[str, int]]:
    """A streaming server that counts the streams it has open at once; ``cut_off``: every stream ends after two
    chunks, without a usage chunk or ``[DONE]`` (a proxy cutting streams looks so)."""
    app = FastAPI()
    seen = {"open": 0, "most_open": 0}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            seen["open"] += 1
            seen["most_open"] = max(seen["most_open"], seen["open"])
            try:
                for _ in range(chunks):
                    await asyncio.sleep(0.05)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a'}]})}\n\n"
                if not cut_off:
                    yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 2}})}\n\ndata: [DONE]\n\n"
            finally:
                seen["open"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, seen


def test_a_stream_cut_off_before_done_is_a_failure() -> None:
    """A stream that ended cleanly but early (no [DONE]) counted as a successful request: throughput and latency
    then described requests that never finished, and the run exited 0."""
    app, _ = fake_server(cut_off=True)
    with serve_in_thread(app) as url:
        config = BenchConfig(url=url, num_prompts=3, concurrency=3, input_len=4, output_len=50, prompts="ids",
                             progress=False)  # fmt: skip
        figures = asyncio.run(benchmark(config))
    assert figures["completed"] == 0 and figures["failed"] == 3
    assert figures["failures"] == {"the stream ended early, without [DONE]": 3}


def test_timeout_bounds_the_whole_request() -> None:
    """--timeout is per request: as httpx's timeout it bounded each read, and a stream trickling a chunk every
    50 ms for a second passed a 0.3 s timeout."""
    app, _ = fake_server(cut_off=False, chunks=20)
    with serve_in_thread(app) as url:
        config = BenchConfig(url=url, num_prompts=2, concurrency=2, input_len=4, output_len=2, prompts="ids",
                             progress=False, timeout=0.3)  # fmt: skip
        figures = asyncio.run(benchmark(config))
    assert figures["failed"] == 2 and figures["failures"] == {"no complete answer within --timeout 0.3 s": 2}


def test_text_prompts_are_input_len_tokens_on_average(live_url: str) -> None:
    """The words per prompt came from the tokens per word of the 100 shortest words, while prompts draw from
    all of them: prompts overshot --input-len by 8-12% on byte-level tokenizers."""
    config = BenchConfig(url=live_url, num_prompts=300, input_len=60, api_key=API_KEY, prompts="text")

    async def prompts() -> list:
        async with httpx.AsyncClient(base_url=live_url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            return await bench.make_prompts(http, TINY, config)

    lengths = [len(prompt.encode()) for prompt in asyncio.run(prompts())]  # the tiny model's tokens are bytes
    assert abs(sum(lengths) / len(lengths) - 60) < 60 * 0.03


def test_client_processes_keep_the_concurrency_in_total() -> None:
    """With more processes than --concurrency, the processes beyond it got a concurrency of 0, read as no
    limit: 6 streams at once for --concurrency 2."""
    app, seen = fake_server(cut_off=False)
    with serve_in_thread(app) as url:
        config = BenchConfig(url=url, num_prompts=8, concurrency=2, input_len=4, output_len=2, prompts="ids",
                             progress=False, processes=4)  # fmt: skip
        figures = asyncio.run(benchmark(config))
    assert figures["completed"] == 8 and seen["most_open"] <= 2


def test_compared_runs_send_prompts_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round and side of --compare sent the same prompts, so a prefix cache answered all runs after the
    first from its snapshots (a server compared with itself came out 1.8x faster)."""
    seeds = []

    async def fake_benchmark(config: BenchConfig) -> dict:
        seeds.append(config.seed)
        return bench.report(config, "fake", [], 1.0)

    monkeypatch.setattr(bench, "benchmark", fake_benchmark)
    asyncio.run(bench.compare(BenchConfig(url="http://a", seed=5), "http://b", rounds=3))
    assert len(set(seeds)) == 6 and seeds[0] == 5


def test_the_load_generator_imports_without_torch() -> None:
    """Each of ``--processes`` client processes imports this module: with torch (through ``rnnserve``'s engine
    exports) that took ~3 s of CPU per process."""
    code = "import sys, rnnserve.clients.bench; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_bench_answers_that_are_not_model_lists_or_objects_are_one_line_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another web app at --url, an empty model list, an error answer (whose OpenAI message is shown) and stream
    chunks that are JSON but not objects: a one-line error or a failed request, never a traceback."""
    app = FastAPI()
    answers = {"models": "not json", "chunk": "[1, 2]"}

    @app.get("/v1/models")
    def models() -> object:
        if answers["models"] == "401":
            return JSONResponse({"error": {"message": "missing or invalid API key"}}, status_code=401)
        if answers["models"] == "empty":
            return {"object": "list", "data": []}
        return PlainTextResponse(answers["models"])

    @app.post("/v1/completions")
    def completions() -> StreamingResponse:
        return StreamingResponse(iter([f"data: {answers['chunk']}\n\n", "data: [DONE]\n\n"]),
                                 media_type="text/event-stream")  # fmt: skip

    with serve_in_thread(app) as url:
        base = ["bench", "--url", url, "--num-prompts", "2", "--output-len", "2", "--no-progress"]
        for models, expected in (("not json", "did not answer an OpenAI model list"), ("empty", "model list"),
                                 ("401", "HTTP 401: missing or invalid API key")):  # fmt: skip
            answers["models"] = models
            assert cli.main(base) == 1
            assert expected in capsys.readouterr().err
        assert cli.main([*base, "--model", "m"]) == 1  # both requests failed, the report is still printed
        out = capsys.readouterr().out
        assert "not a JSON object" in out and "failed" in out


def test_bench_tokenizer_and_json_paths_that_cannot_be_used(
    live_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["bench", "--url", live_url, "--num-prompts", "1", "--output-len", "2", "--api-key", API_KEY,
            "--no-progress"]  # fmt: skip
    assert cli.main([*base, "--prompts", "text", "--tokenizer", str(tmp_path / "missing.json")]) == 1
    assert "--tokenizer" in capsys.readouterr().err
    assert cli.main([*base, "--json", str(tmp_path / "no" / "dir.json")]) == 1
    out, err = capsys.readouterr()
    assert "cannot write --json" in err and "output throughput" in out  # the figures are not lost


def test_request_rate_waits_no_gap_after_the_last_arrival(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's duration ends with its last request, not an arrival gap after it (that understated the
    throughput: one prompt at rate 0.5 measured 0.29 s for a 9 ms request)."""
    from rnnserve.clients import bench

    sleeps: list[float] = []
    real_sleep, this_thread = asyncio.sleep, threading.get_ident()

    async def record(seconds: float) -> None:
        if threading.get_ident() != this_thread:  # asyncio.sleep is patched for every thread: a server's loop
            await real_sleep(seconds)  # running beside this test (uvicorn ticks every 0.1 s) sleeps for real
            return
        sleeps.append(seconds)

    async def answer(http: object, body: dict) -> bench.RequestResult:
        return bench.RequestResult(ok=True)

    monkeypatch.setattr(bench, "send_one", answer)
    monkeypatch.setattr(bench.asyncio, "sleep", record)
    config = BenchConfig(url="http://127.0.0.1:9", num_prompts=3, request_rate=0.5, progress=False)
    asyncio.run(bench.drive("m", ["a", "b", "c"], config))
    assert len(sleeps) == 2
