"""Soak: mixed hostile and normal load against one ``rnnserve serve`` process for a fixed time.

Workers run concurrently until ``--minutes`` are up: normal completions (streamed and not) and chats,
streams cancelled after a few chunks, malformed and out-of-range bodies, oversized bodies and prompts, and
slow clients that stall mid-body. Reported at the end: requests per kind and status, 5xx count, well-formed
requests that were not answered completely, state slots still in use once the load stops, and the server's
RSS over time (after a warm-up minute). Exit status 1 when any 5xx, leak, unanswered well-formed request or
RSS growth over 10% is seen.

Usage: ``python benchmarks/soak.py [--minutes 10] [--model PATH|NAME] [--concurrency 8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--max-num-seqs", "8", "--max-waiting", "64", "--request-read-timeout", "3", "--max-body-bytes", "65536"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Soak:
    def __init__(self, url: str, deadline: float) -> None:
        self.url = url
        self.deadline = deadline
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.unanswered: list[str] = []
        self.rng = random.Random(0)

    def record(self, kind: str, status: int) -> None:
        self.statuses[(kind, status)] += 1

    async def normal(self, client: httpx.AsyncClient) -> None:
        body = {"prompt": "The " * self.rng.randint(1, 40), "max_tokens": self.rng.randint(1, 48),
                "temperature": self.rng.choice([0, 0.8])}
        if self.rng.random() < 0.5:
            r = await client.post("/v1/completions", json=body)
            self.record("normal", r.status_code)
            if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] not in ("length", "stop"):
                self.unanswered.append(f"completion {r.status_code} {r.text[:200]}")
            return
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            text = "".join([line async for line in r.aiter_lines()])
            self.record("stream", r.status_code)
            if r.status_code != 200 or not text.endswith("data: [DONE]") or '"error"' in text:
                self.unanswered.append(f"stream {r.status_code} {text[-200:]}")

    async def chat(self, client: httpx.AsyncClient) -> None:
        body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16}
        r = await client.post("/v1/chat/completions", json=body)
        self.record("chat", r.status_code)
        if r.status_code != 200:
            self.unanswered.append(f"chat {r.status_code} {r.text[:200]}")

    async def cancelled(self, client: httpx.AsyncClient) -> None:
        body = {"prompt": "Once", "max_tokens": 400, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            self.record("cancelled", r.status_code)
            count = 0
            async for _ in r.aiter_lines():
                count += 1
                if count > self.rng.randint(1, 6):
                    break

    async def malformed(self, client: httpx.AsyncClient) -> None:
        bodies = [b"{not json", b'{"prompt": "a", "max_tokens": 1e300}', b'{"prompt": "a", "top_k": 1e400}',
                  b'{"prompt": "a", "temperature": -1}', b'{"prompt": "a", "n": 1000}', b'{"prompt": []}',
                  b'{"prompt": "a", "stop": ["' + b"x" * 4000 + b'"]}', b'{"prompt": [999999999999]}']
        r = await client.post("/v1/completions", content=self.rng.choice(bodies),
                              headers={"Content-Type": "application/json"})
        self.record("malformed", r.status_code)

    async def oversized(self, client: httpx.AsyncClient) -> None:
        if self.rng.random() < 0.5:
            r = await client.post("/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 1})
        else:
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**9})
        self.record("oversized", r.status_code)

    async def slow(self, _: httpx.AsyncClient) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.read(200), timeout=10)
            match = re.match(rb"HTTP/1.1 (\d+)", head)
            self.record("slow", int(match.group(1)) if match else 0)
        except TimeoutError:
            self.record("slow", -1)
        writer.close()

    async def worker(self, client: httpx.AsyncClient) -> None:
        kinds = [self.normal] * 5 + [self.chat, self.cancelled, self.cancelled, self.malformed, self.oversized,
                                     self.slow]
        while time.monotonic() < self.deadline:
            try:
                await self.rng.choice(kinds)(client)
            except httpx.HTTPError as err:
                self.unanswered.append(f"transport error {err!r}")


async def slots_used(url: str) -> float:
    async with httpx.AsyncClient(base_url=url) as client:
        text = (await client.get("/metrics")).text
    return float(re.search(r"^rnnserve_state_slots_used (\S+)$", text, re.M).group(1))


async def run(url: str, pid: int, minutes: float, concurrency: int) -> int:
    start = time.monotonic()
    soak = Soak(url, start + minutes * 60)
    rss: list[tuple[float, float]] = []

    async def sample_rss() -> None:
        while time.monotonic() < soak.deadline:
            rss.append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(5)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(sample_rss(), *(soak.worker(client) for _ in range(concurrency)))
    await asyncio.sleep(1)
    leaked = await slots_used(url)
    warm = [m for t, m in rss if t >= 60] or [m for _, m in rss]
    growth = (warm[-1] - warm[0]) / warm[0]
    five_xx = sum(n for (_, status), n in soak.statuses.items() if status >= 500)
    print(f"{minutes:g} min, {sum(soak.statuses.values())} requests, concurrency {concurrency}")
    for (kind, status), n in sorted(soak.statuses.items()):
        print(f"  {kind:10s} {status:4d} x {n}")
    print(f"5xx: {five_xx}; well-formed requests not answered: {len(soak.unanswered)}; slots in use after: {leaked:g}")
    print(f"RSS after warm-up: {warm[0]:.1f} -> {warm[-1]:.1f} MiB (min {min(warm):.1f}, max {max(warm):.1f}, "
          f"{growth:+.1%})")
    for line in soak.unanswered[:10]:
        print("  unanswered:", line)
    return int(five_xx > 0 or leaked > 0 or soak.unanswered != [] or growth > 0.10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "rnnserve.server.cli", "serve", "--port", str(port), *FLAGS]
    if args.model:
        command += ["--model", args.model]
    log = open(ROOT / "soak-server.log", "w")  # noqa: SIM115 - lives as long as the server
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        status = asyncio.run(run(url, server.pid, args.minutes, args.concurrency))
    finally:
        server.send_signal(2)
        server.wait(30)
        log.close()
    tracebacks = (ROOT / "soak-server.log").read_text().count("Traceback")
    print(f"server log tracebacks: {tracebacks}")
    print(json.dumps({"exit": status or int(tracebacks > 0)}))
    return status or int(tracebacks > 0)


if __name__ == "__main__":
    sys.exit(main())
