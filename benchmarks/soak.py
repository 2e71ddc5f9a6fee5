"""Soak: a deployment's mixed load against one ``rnnserve serve`` for a fixed time, watching for leaks.

Workers run concurrently until ``--minutes`` are up. The load is what a real deployment sees at once: completions
and chats, streamed and not, with ``n`` > 1, ``best_of``, logprobs, stop strings, structured outputs, forced
tool calls and shared prompt prefixes (prefix-cache hits); whole session lives (create, turns, fork, export and
import, delete, or left to expire under ``--session-ttl``); clients that leave before the first byte, mid-stream,
while a grammar compiles or while queued, and that time out; half bodies, slow bodies, invalid JSON, out-of-range
fields, oversized bodies and prompts (400/413), bursts past ``--max-waiting`` (429). The well-behaved requests
and most misbehaving ones come from the chaos storm of ``tests/server/chaos.py``.

Every ``--sample-every`` seconds it samples, per server process (the engine process and each API server too),
RSS, open fds and threads; the ``/dev/shm`` files they hold, the entries of the session folder and of the server's
temp folder; and the server's load, memory, session and error metrics. At the end, with the load stopped and the server
settled, it prints them at the start (after the warm-up), the middle and the end, and their growth over the
run's second half. Exit status 1 on any 5xx, unanswered well-formed request, slot or request still in use,
engine error, or growth: RSS over 5% in the second half, or more fds, shm or temp entries at the end than in the
middle, or more threads than the event loop's executor may start.

Usage: ``python benchmarks/soak.py [--minutes 10] [--model PATH|NAME] [--concurrency 8] [--api-servers N]
[--session-ttl 20] [--port P] [--prefix-cache-memory BYTES] [--samples-json PATH]
[--probe-dir DIR [--probe-tracemalloc]]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.chaos import PROMPTS, Storm, wait_until_idle  # noqa: E402

MAX_WAITING = 16
FLAGS = ["--max-num-seqs", "8", "--max-waiting", str(MAX_WAITING), "--request-read-timeout", "3",
         "--max-body-bytes", "65536", "--max-sessions", "64"]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "time"}}]  # fmt: skip
# Sampled per process at the start (after the warm-up), the middle and the end of the run.
PROCESS_FIGURES = ("rss_mib", "fds", "threads")
# The event loop's default executor (asyncio.to_thread: session files) starts its workers, up to this many, when a
# peak needs them, late in a run too: so many threads more than at the start are that, not a leak.
EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)
PROBE = ROOT / "benchmarks" / "soak_probe"  # --probe-dir: each server process counts its objects (sitecustomize)
# The server's metrics sampled, without their model_name label.
SAMPLED_METRICS = (
    "rnnserve_num_requests_running", "rnnserve_num_requests_waiting", "rnnserve_state_slots_used",
    "rnnserve_state_memory_used_bytes", 'rnnserve_prefix_cache_memory_used_bytes{tier="device"}',
    "rnnserve_sessions", "rnnserve_session_bytes", "rnnserve_session_cache_memory_used_bytes",
    'rnnserve_request_success_total{finished_reason="error"}', "rnnserve_request_rejected_total",
    "rnnserve_session_expired_total", "rnnserve_session_rejected_total", "rnnserve_prefix_cache_hits_total",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (those of their children files ``/proc`` lists)."""
    tree, index = [pid], 0
    while index < len(tree):
        children = Path(f"/proc/{tree[index]}/task/{tree[index]}/children")
        try:
            tree += [int(child) for child in children.read_text().split()]
        except OSError:
            pass
        index += 1
    return tree


def process_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds and threads of ``pid``."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}  # fmt: skip


def process_name(pid: int) -> str:
    """A short name for one of the server's processes: its command line's tail past the interpreter."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    text = " ".join(part.decode(errors="replace") for part in argv[1:] if part)
    return f"{pid} {text[:60]}"


def shared_memory(pids: list[int]) -> int:
    """The ``/dev/shm`` files the processes ``pids`` hold open or mapped (others' on the machine not counted)."""
    held: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target)
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # a process or fd that just ended
            continue
        held.update(re.findall(r"(/dev/shm/\S+)", maps))
    return len(held)


def entries(folder: Path) -> int:
    """Files and folders under ``folder``, recursively (0 when it does not exist)."""
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(folder)) if folder.exists() else 0


def scrape_metrics(url: str) -> dict[str, float]:
    text = re.sub(r'model_name="[^"]*",?', "", httpx.get(f"{url}/metrics", timeout=30).text)
    text = text.replace(",}", "}").replace("{}", "")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(rnnserve_\S+) (\S+)$", text, re.M)}


def series_sum(metrics: dict[str, float], name: str) -> float:
    """The sample ``name`` (with its labels), or the sum of the metric ``name``'s series over all their labels."""
    if name in metrics:
        return metrics[name]
    return sum(value for key, value in metrics.items() if key.startswith(name + "{"))


class Soak(Storm):
    """The chaos storm's clients plus the soak's own: limits, bursts, tool calls and whole session lives."""

    def __init__(self, url: str, deadline: float, seed: int = 0) -> None:
        super().__init__(url, seed=seed, sessions=False)
        self.deadline = deadline
        self.statuses: Counter[tuple[str, int]] = Counter()

    def expect(self, kind: str, ok: bool, detail: str) -> None:
        if kind == "cut-mid-stream" and detail == "429":  # the storm's stream cut saw a full queue (the bursts)
            kind, ok = "cut-mid-stream-429", True
        super().expect(kind, ok, detail)

    def record(self, kind: str, status: int, ok: bool = True, detail: str = "") -> None:
        self.statuses[(kind, status)] += 1
        self.expect(kind, ok and status < 500, f"{status} {detail}")

    async def malformed(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        bodies = [b'{"prompt": "a", "max_tokens": 1e300}', b'{"prompt": "a", "top_k": 1e400}',
                  b'{"prompt": "a", "temperature": -1}', b'{"prompt": "a", "n": 1000}', b'{"prompt": []}',
                  b'{"prompt": "a", "stop": ["' + b"x" * 4000 + b'"]}', b'{"prompt": [999999999999]}',
                  b'{"messages": [{"role": "user", "content": "a"}], "tools": []}']
        r = await http.post("/v1/completions", content=rng.choice(bodies), headers={"Content-Type": "application/json"})
        self.record("malformed", r.status_code, r.status_code == 400, r.text[:200])

    async def oversized(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        if rng.random() < 0.5:
            r = await http.post("/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 1})
        else:
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**9})
        self.record("oversized", r.status_code, r.status_code in (400, 413), r.text[:200])

    async def slow(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        reader, writer = await asyncio.open_connection(*self.address)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")  # fmt: skip
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.read(200), timeout=10)
            match = re.match(rb"HTTP/1.1 (\d+)", head)
            self.record("slow", int(match.group(1)) if match else 0)
        except TimeoutError:
            self.record("slow", -1)
        writer.close()

    async def burst(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        """More requests at once than slots plus the waiting queue hold: some must get 429 ``queue_full``."""
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 64, "ignore_eos": True}
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(MAX_WAITING + 12)))
        for r in answers:
            if self.answered("burst", r, True):
                self.record("burst", r.status_code, r.status_code == 200, r.text[:200])
            else:
                self.statuses[("burst", 429)] += 1

    async def tool_call(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        choice: Any = rng.choice(["required", {"type": "function", "function": {"name": "weather"}}])
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
                "tool_choice": choice, "max_tokens": 48, "temperature": 0.8, "seed": rng.getrandbits(16)}  # fmt: skip
        if rng.random() < 0.5:
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                await self.read_stream("tool-stream", r, 1)
            return
        r = await http.post("/v1/chat/completions", json=body)
        if self.answered("tool", r, True):
            self.record("tool", r.status_code, r.status_code == 200, r.text[:300])

    async def session_life(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        """Create a session, take turns (some streamed, some cut), fork it, export and import it; delete both,
        or leave them to ``--session-ttl``."""
        created = await http.post("/v1/sessions", json={})
        if created.status_code == 429:  # --max-sessions: the sweep has not caught up with expired ones yet
            self.record("session-create", 429, "session_limit_reached" in created.text, created.text)
            return
        self.record("session-create", created.status_code, created.status_code == 200, created.text)
        session = created.json()["id"]
        for _ in range(rng.randint(1, 4)):
            await self.session_turn(http, rng, session)
        ids = [session]
        forked = await http.post(f"/v1/sessions/{session}/fork", json={})
        ok = forked.status_code == 200 or (forked.status_code in (409, 429) and "session_" in forked.text)
        self.record("session-fork", forked.status_code, ok, forked.text)
        if forked.status_code == 200:
            ids.append(forked.json()["id"])
            await self.session_turn(http, rng, ids[-1])
        exported = await http.get(f"/v1/sessions/{session}/state")
        self.record("session-export", exported.status_code, exported.status_code in (200, 409), exported.text[:200])
        if exported.status_code == 200:
            target = "sess-soak" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=24))
            imported = await http.put(f"/v1/sessions/{target}/state", content=exported.content,
                                      headers={"Content-Type": "application/octet-stream"})  # fmt: skip
            ok = imported.status_code == 201 or (imported.status_code == 429 and "session_limit" in imported.text)
            self.record("session-import", imported.status_code, ok, imported.text[:200])
            if imported.status_code == 201:
                ids.append(target)
        if rng.random() < 0.3:
            return  # left for --session-ttl's sweep
        for session_id in ids:
            deleted = await http.delete(f"/v1/sessions/{session_id}")
            # 409: a turn cut mid-answer may still hold it; 404: it expired meanwhile
            self.record("session-delete", deleted.status_code, deleted.status_code in (200, 404, 409), deleted.text)

    async def worker(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        kinds = [
            self.completion, self.completion, self.stream, self.stream, self.chat, self.chat, self.structured,
            self.prefix, self.prefix, self.tool_call, self.session_life, self.cut_before_first_byte,
            self.cut_mid_stream, self.cut_while_compiling, self.cut_while_queued, self.half_body, self.invalid_json,
            self.client_timeout, self.malformed, self.oversized, self.slow,
        ]  # fmt: skip
        while time.monotonic() < self.deadline:
            kind = self.burst if rng.random() < 0.01 else rng.choice(kinds)
            try:
                await kind(http, rng)
            except (httpx.HTTPError, OSError) as err:
                self.expect(kind.__name__, False, f"transport error {err!r}")

    async def run_workers(self, concurrency: int) -> None:
        limits = httpx.Limits(max_connections=concurrency * 4 + MAX_WAITING + 12, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(self.worker(http, random.Random(self.seed * 1000 + i)) for i in range(concurrency)))


class Sampler:
    """Samples of the server's processes, shared memory, folders and metrics, every ``every`` seconds."""

    def __init__(self, url: str, pid: int, session_dir: Path, temp_dir: Path, every: float) -> None:
        self.url, self.pid, self.session_dir, self.temp_dir, self.every = url, pid, session_dir, temp_dir, every
        self.samples: list[dict[str, Any]] = []
        self.names: dict[int, str] = {}

    def sample(self, elapsed: float) -> None:
        processes = {}
        tree = process_tree(self.pid)
        for pid in tree:
            try:
                processes[pid] = process_figures(pid)
                self.names.setdefault(pid, process_name(pid))
            except (OSError, ValueError):
                pass  # a process that just ended
        metrics = scrape_metrics(self.url)
        self.samples.append({
            "t": elapsed, "processes": processes, "shm": shared_memory(tree),
            "session_files": entries(self.session_dir), "temp_entries": entries(self.temp_dir),
            "metrics": {name: series_sum(metrics, name) for name in SAMPLED_METRICS},
        })  # fmt: skip

    async def run(self, start: float, deadline: float) -> None:
        while time.monotonic() < deadline:
            await asyncio.to_thread(self.sample, time.monotonic() - start)
            await asyncio.sleep(self.every)

    def report(self, warm_up: float) -> bool:
        """Print start/middle/end figures and their growth over the run's second half; True when something grew."""
        warm = [s for s in self.samples if s["t"] >= warm_up] or self.samples
        first, middle, last = warm[0], warm[len(warm) // 2], warm[-1]
        grew = False
        print(f"samples: {len(self.samples)}; after warm-up at {first['t']:.0f} s, middle {middle['t']:.0f} s, "
              f"end {last['t']:.0f} s (settled)")  # fmt: skip
        print(f"  {'process':62s} {'figure':8s} {'start':>9s} {'middle':>9s} {'end':>9s} {'2nd half':>9s}")
        for pid, name in self.names.items():
            if not all(pid in s["processes"] for s in (first, middle, last)):
                print(f"  {name:62s} (not alive over the whole run)")
                continue
            for figure in PROCESS_FIGURES:
                a, b, c = (s["processes"][pid][figure] for s in (first, middle, last))
                print(f"  {name:62s} {figure:8s} {a:9.1f} {b:9.1f} {c:9.1f} {c - b:+9.1f}")
                limit = {"rss_mib": 0.05 * b, "threads": max(0, EXECUTOR_THREADS - (b - a))}.get(figure, 0)
                grew |= c - b > limit
        for figure in ("shm", "session_files", "temp_entries"):
            a, b, c = first[figure], middle[figure], last[figure]
            print(f"  {figure:71s} {a:9d} {b:9d} {c:9d} {c - b:+9d}")
            grew |= figure != "session_files" and c > b
        for name in SAMPLED_METRICS:
            a, b, c = (s["metrics"][name] for s in (first, middle, last))
            print(f"  {name:71s} {a:9g} {b:9g} {c:9g} {c - b:+9g}")
        return grew


async def run(url: str, pid: int, args: argparse.Namespace, session_dir: Path, temp_dir: Path) -> int:
    start = time.monotonic()
    soak = Soak(url, start + args.minutes * 60)
    sampler = Sampler(url, pid, session_dir, temp_dir, args.sample_every)
    await asyncio.gather(sampler.run(start, soak.deadline), soak.run_workers(args.concurrency))
    settled = await asyncio.to_thread(wait_until_idle, url, 60.0)
    await asyncio.to_thread(sampler.sample, time.monotonic() - start)
    busy = {name: settled.get(name) for name in ("rnnserve_num_requests_running", "rnnserve_num_requests_waiting",
                                                 "rnnserve_state_slots_used", "rnnserve_state_memory_used_bytes")}
    statuses = soak.outcomes
    five_xx = sum(n for (_, status), n in soak.statuses.items() if status >= 500)
    errors = settled.get('rnnserve_request_success_total{finished_reason="error"}', 0.0)
    print(f"{args.minutes:g} min, {sum(statuses.values())} requests, concurrency {args.concurrency}, "
          f"api servers {args.api_servers}, session ttl {args.session_ttl:g} s")
    for kind, n in sorted(statuses.items()):
        print(f"  {kind:20s} x {n}")
    print("  statuses:", ", ".join(f"{kind} {status}: {n}" for (kind, status), n in sorted(soak.statuses.items())))
    print(f"5xx: {five_xx}; problems: {len(soak.problems)}; engine errors: {errors:g}; settled: {busy}")
    rejected = settled.get("rnnserve_request_rejected_total", 0.0)
    # one count per 429 answered: those the clients read, and some of those whose clients left before the status
    miscounted = not soak.rejected_seen <= rejected <= soak.rejected_seen + soak.left_unanswered
    print(f"429 queue_full: {soak.rejected_seen} read by clients, {soak.left_unanswered} clients left before a status; "
          f"rnnserve_request_rejected_total {rejected:g}{' (MISCOUNTED)' if miscounted else ''}")
    for line in soak.problems[:10]:
        print("  problem:", line)
    grew = sampler.report(warm_up=min(120.0, args.minutes * 30))
    if args.samples_json:
        Path(args.samples_json).write_text(json.dumps({"processes": sampler.names, "samples": sampler.samples}))
    leaked = any(value != 0 for value in busy.values())
    return int(five_xx > 0 or soak.problems != [] or errors > 0 or leaked or grew or miscounted)


def wait_until_listening(url: str, server: subprocess.Popen, timeout: float = 1800.0) -> None:
    """Until ``/health`` answers 200 (a first start on a CPU builds the kernels, minutes on a busy machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not start (exit code {server.poll()})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--api-servers", type=int, default=1, help="> 1: that many API servers and an engine process")
    parser.add_argument("--session-ttl", type=float, default=20.0, help="small, so that the expiry sweep runs")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--port", type=int, default=None, help="default: a free one")
    parser.add_argument("--prefix-cache-memory", default=None, help="the server's budget (default: its own, 1GiB): "
                        "a small one fills within the warm-up, so its filling is not taken for growth")
    parser.add_argument("--probe-dir", default=None, help="each server process writes its objects by type here "
                        "every 150 s (benchmarks/soak_probe)")
    parser.add_argument("--probe-tracemalloc", action="store_true", help="with --probe-dir: tracemalloc snapshots too "
                        "(slower; diff them with tracemalloc.Snapshot.load(...).compare_to)")
    parser.add_argument("--samples-json", default=None, help="write every sample here (the growth curves)")
    args = parser.parse_args()
    port = args.port or free_port()
    work = Path(tempfile.mkdtemp(prefix="rnnserve-soak-"))
    session_dir, temp_dir = work / "sessions", work / "tmp"
    temp_dir.mkdir()
    command = [sys.executable, "-m", "rnnserve.server.cli", "serve", "--port", str(port), *FLAGS,
               "--session-dir", str(session_dir), "--session-ttl", str(args.session_ttl),
               "--api-servers", str(args.api_servers)]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if args.prefix_cache_memory:
        command += ["--prefix-cache-memory", args.prefix_cache_memory]
    log_path = work / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    env = {**os.environ, "TMPDIR": str(temp_dir)}
    if args.probe_dir:
        Path(args.probe_dir).mkdir(parents=True, exist_ok=True)
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(PROBE), env.get("PYTHONPATH")])),
                   SOAK_PROBE_DIR=str(Path(args.probe_dir).resolve()),
                   SOAK_PROBE_TRACEMALLOC=str(int(args.probe_tracemalloc)))  # fmt: skip
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_listening(url, server)
        status = asyncio.run(run(url, server.pid, args, session_dir, temp_dir))
    finally:
        server.send_signal(2)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    tracebacks = log_path.read_text().count("Traceback")
    print(f"server log ({log_path}) tracebacks: {tracebacks}; left in its temp folder after exit: {entries(temp_dir)}")
    print(json.dumps({"exit": status or int(tracebacks > 0)}))
    return status or int(tracebacks > 0)


if __name__ == "__main__":
    sys.exit(main())
