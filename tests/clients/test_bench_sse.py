"""``rnnserve bench`` reads streams as the SSE specification says, measures servers without rnnserve-only
routes, and compares two servers; the server never writes a character that a line reader could split on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer, models

from rnnserve.clients.bench import BenchConfig, benchmark, failure_cause, sse_data
from rnnserve.engine.loader import build_random, save_checkpoint
from rnnserve.server import cli
from tests.server.conftest import API_KEY
from tests.server.server_process import running_server

pytestmark = pytest.mark.timeout(120)

LINE_BREAKERS = ("\u2028", "\u2029", "\x85")


async def _events(chunks: list[bytes]) -> list[str]:
    async def stream():
        for chunk in chunks:
            yield chunk

    response = httpx.Response(200, content=stream())
    return [data async for data in sse_data(response)]


@pytest.mark.parametrize("cut", range(1, 40))
def test_sse_lines_end_only_at_cr_lf(cut: int) -> None:
    body = 'data: {"t": "a\u2028b\u2029c\x85d"}\r\n\r\ndata: 1\rdata: 2\r\rdata: x\n\n'.encode()
    events = asyncio.run(_events([body[:cut], body[cut:]]))  # every split point, CRLF halves included
    assert events == ['{"t": "a\u2028b\u2029c\x85d"}', "1\n2", "x"]
    assert json.loads(events[0])["t"] == "a\u2028b\u2029c\x85d"


def test_failure_causes_group_request_details() -> None:
    assert failure_cause("HTTP 429: request req-123abc queue 12345 full") == "HTTP 429: request N queue N full"


def test_id_prompts_and_compare_need_no_tokenizer_route(live_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = BenchConfig(url=live_url, num_prompts=3, concurrency=3, input_len=7, output_len=2, api_key=API_KEY,
                         progress=False, prompts="ids")
    figures = asyncio.run(benchmark(config))
    assert figures["failed"] == 0 and figures["mean_prompt_tokens"] == 7  # exactly the ids sent
    argv = ["bench", "--url", live_url, "--compare", live_url, "--rounds", "1", "--num-prompts", "2",
            "--input-len", "4", "--output-len", "2", "--api-key", API_KEY, "--no-progress", "--prompts", "ids"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "other/base" in printed and "output throughput (tok/s)" in printed and "TTFT p50 (ms)" in printed


def _line_breaker_checkpoint(path: Path) -> Path:
    """Random mingru-tiny weights and a word-level tokenizer whose every token's text holds U+2028, U+2029 or
    U+0085: whatever the model generates, each streamed chunk carries one of them."""
    model, _ = build_random("mingru-tiny", torch.device("cpu"), None)
    vocab = {f"w{i}{LINE_BREAKERS[i % 3]}": i for i in range(model.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0\u2028"))
    save_checkpoint(model, path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_line_separators_survive_the_real_server_and_bench(tmp_path: Path) -> None:
    checkpoint = _line_breaker_checkpoint(tmp_path / "model")
    with running_server("--model", str(checkpoint)) as server:
        body = {"prompt": [1, 2, 3], "max_tokens": 6, "stream": True, "ignore_eos": True}
        raw = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).content
        assert not any(c.encode() in raw for c in LINE_BREAKERS)  # escaped as \\u2028 ...
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in raw.decode().split("\n\n")
                 if line.startswith("data: {")]
        assert any(c in "".join(texts) for c in LINE_BREAKERS)
        config = BenchConfig(url=server.url, num_prompts=8, concurrency=4, input_len=5, output_len=6,
                             progress=False, prompts="ids", max_token_id=300)
        figures = asyncio.run(benchmark(config))
    assert figures["failed"] == 0, figures["failures"]
    assert figures["total_output_tokens"] == 8 * 6
