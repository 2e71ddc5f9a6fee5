"""A seeded storm of well-behaved and misbehaving clients against a server, and the checks that it left nothing
behind: every state slot free, the load gauges idle, the request counters consistent, no 5xx, the same greedy
text as before. Used by ``test_chaos_http.py``; the storm's mix is the seed's, what is checked does not depend
on the machine's speed."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = ["The ", "Once upon a time", "Hello there, how are", "A B C D E F G", "1, 2, 3, 4, 5, "]
# Long enough to be cached on its first use and resumed from the prefix cache afterwards.
SHARED_PREFIX = "In the beginning the server was idle and every slot of its state pool was free. " * 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def wide_schema(rng: random.Random) -> dict[str, Any]:
    """A schema that takes a while to compile (tens of ms), distinct per call so no compile is cached."""
    width = rng.randint(60, 120)
    return {"type": "object", "properties": {f"f{rng.getrandbits(32)}_{i}": {"type": "integer"} for i in range(width)}}


GREEDY = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def scrape(url: str) -> dict[str, float]:
    """The server's ``rnnserve_*`` samples without the ``model_name`` label."""
    text = re.sub(r',?model_name="[^"]*"', "", httpx.get(f"{url}/metrics", timeout=30).text).replace("{}", "")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(rnnserve_\S+) (\S+)$", text, re.M)}


IDLE_GAUGES = (
    "rnnserve_num_requests_running", "rnnserve_num_requests_waiting", "rnnserve_num_requests_compiling",
    "rnnserve_state_slots_used", "rnnserve_state_usage_perc", "rnnserve_state_memory_used_bytes",
)  # fmt: skip


def busy_gauges(metrics: dict[str, float]) -> dict[str, float]:
    """The load gauges that are not back to idle (zero)."""
    return {name: metrics[name] for name in IDLE_GAUGES if metrics.get(name, 0.0) != 0.0}


def finished_requests(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("rnnserve_request_success_total"))


def admitted_requests(metrics: dict[str, float]) -> float:
    return metrics.get("rnnserve_request_params_n_count", 0.0)


def wait_until_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once the gauges are idle and every admitted request has finished (or the last scrape after
    ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        settled = not busy_gauges(metrics) and finished_requests(metrics) == admitted_requests(metrics)
        if settled or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


@dataclass
class Storm:
    """``clients`` concurrent clients each making ``actions`` random requests against ``url``."""

    url: str
    seed: int
    clients: int = 8
    actions: int = 12
    sessions: bool = True
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    session_ids: list[str] = field(default_factory=list)
    # Requests answered 429 queue_full as their clients read it, and requests whose client left before it read a
    # status line (the server may have answered them 429 all the same): what rnnserve_request_rejected_total is
    # checked against.
    rejected_seen: int = 0
    left_unanswered: int = 0

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def expect(self, kind: str, ok: bool, detail: str) -> None:
        self.outcomes[kind] += 1
        if not ok:
            self.problems.append(f"{kind}: {detail[:300]}")

    def answered(self, kind: str, response: httpx.Response, ok: bool) -> bool:
        """Record a well-formed request's answer: ``ok``, or a 429 ``queue_full`` with ``Retry-After`` (a full
        queue is an answer too); False for a 429, whose body the caller must not check further."""
        if response.status_code == 429:
            busy = "retry-after" in response.headers and "queue_full" in response.text
            self.rejected_seen += busy
            self.expect(f"{kind}-429", busy, response.text)
            return False
        return True

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.clients * 2, max_keepalive_connections=self.clients)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as http:
            await asyncio.gather(*(self.client(http, random.Random(self.seed * 1000 + i)) for i in range(self.clients)))

    async def client(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        session: str | None = None
        if self.sessions:
            created = await http.post("/v1/sessions", json={})
            self.expect("session-create", created.status_code == 200, created.text)
            session = created.json()["id"]
            self.session_ids.append(session)
        actions = [
            self.completion, self.completion, self.stream, self.stream, self.chat, self.structured, self.prefix,
            self.cut_before_first_byte, self.cut_mid_stream, self.cut_while_compiling, self.cut_while_queued,
            self.half_body, self.invalid_json, self.client_timeout,
        ]  # fmt: skip
        for _ in range(self.actions):
            action = rng.choice(actions + ([self.session_turn] if session else []))
            try:
                if action == self.session_turn:
                    await action(http, rng, session)
                else:
                    await action(http, rng)
            except (httpx.HTTPError, OSError) as err:
                self.expect(action.__name__, False, f"transport error {err!r}")

    def delete_sessions(self) -> None:
        """Delete the storm's sessions (once the server settled: none may still be leased)."""
        for session in self.session_ids:
            deleted = httpx.delete(f"{self.url}/v1/sessions/{session}", timeout=30)
            self.expect("session-delete", deleted.status_code == 200, deleted.text)

    # --- well-behaved clients: each must get a complete, well-formed answer ------------------------

    @staticmethod
    def sampling(rng: random.Random) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]), "seed": 7}
        if rng.random() < 0.3:
            body["n"] = 2
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(["e", "the", "\n", ", "])]
        if rng.random() < 0.2:
            body["ignore_eos"] = True
        return body

    async def completion(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        prompts = rng.sample(PROMPTS, rng.choice([1, 1, 1, 2, 3]))
        body = {"prompt": prompts if len(prompts) > 1 else prompts[0], **self.sampling(rng)}
        if "n" in body and rng.random() < 0.5:
            body["best_of"] = body["n"]
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(0, 3)
            body["echo"] = rng.random() < 0.5
        if rng.random() < 0.2:
            body["prompt_logprobs"] = 1
        r = await http.post("/v1/completions", json=body)
        if self.answered("completion", r, r.status_code == 200):
            ok = r.status_code == 200 and len(r.json()["choices"]) == body.get("n", 1) * len(prompts)
            self.expect("completion", ok, f"{r.status_code} {r.text}")

    async def read_stream(self, kind: str, response: httpx.Response, choices: int) -> None:
        text = (await response.aread()).decode()
        if not self.answered(kind, response, True):
            return
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        ok = response.status_code == 200 and events[-1:] == ["[DONE]"] and not any('"error"' in e for e in events)
        finished = sum(c.get("finish_reason") is not None for e in events[:-1] for c in json.loads(e)["choices"])
        self.expect(kind, ok and finished == choices, f"{response.status_code} finished {finished} {text[-300:]}")

    async def stream(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        prompts = rng.sample(PROMPTS, rng.choice([1, 1, 2]))
        body = {"prompt": prompts if len(prompts) > 1 else prompts[0], "stream": True, **self.sampling(rng)}
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
        if rng.random() < 0.3:
            body.update(logprobs=2, echo=rng.random() < 0.5)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            await self.read_stream("stream", r, body.get("n", 1) * len(prompts))

    async def chat(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], **self.sampling(rng)}
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=2)
        if rng.random() < 0.5:
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                await self.read_stream("chat-stream", r, body.get("n", 1))
            return
        r = await http.post("/v1/chat/completions", json=body)
        if self.answered("chat", r, True):
            self.expect("chat", r.status_code == 200 and len(r.json()["choices"]) == body.get("n", 1), r.text)

    async def structured(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 48, "temperature": 0.8, "seed": rng.getrandbits(16),
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}  # fmt: skip
        if rng.random() < 0.5:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                await self.read_stream("structured-stream", r, 1)
            return
        r = await http.post("/v1/completions", json=body)
        if self.answered("structured", r, True):
            choice = r.json()["choices"][0] if r.status_code == 200 else {}
            complete = choice.get("finish_reason") != "stop" or {"name", "age"} <= set(json.loads(choice["text"]))
            self.expect("structured", r.status_code == 200 and complete, r.text)

    async def prefix(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"prompt": SHARED_PREFIX + rng.choice(PROMPTS), "max_tokens": 4, "temperature": 0}
        r = await http.post("/v1/completions", json=body)
        if self.answered("prefix", r, True):
            self.expect("prefix", r.status_code == 200, r.text)

    async def session_turn(self, http: httpx.AsyncClient, rng: random.Random, session: str) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 8), "session_id": session}
        if rng.random() < 0.5:
            r = await http.post("/v1/completions", json=body)
            # 409 session_busy: this client's previous turn left, and the server has not yet seen it go
            busy = r.status_code == 409 and "session_busy" in r.text
            if self.answered("session-turn", r, True):
                self.expect("session-turn", r.status_code == 200 or busy, f"{r.status_code} {r.text}")
            return
        # A turn whose client leaves mid-answer: the session must be free again for the next one.
        await self.raw_cut(json.dumps({**body, "max_tokens": 4000, "ignore_eos": True, "stream": True}),
                           rng.uniform(0, 0.05))  # fmt: skip

    # --- clients that misbehave: any answer is fine, as long as it is not a 5xx --------------------

    async def raw_request(self, body: bytes | str, declared: int | None = None) -> tuple[asyncio.StreamReader,
                                                                                           asyncio.StreamWriter]:
        """A connection that has sent a POST /v1/completions head and ``body`` (``declared`` bytes long)."""
        data = body.encode() if isinstance(body, str) else body
        reader, writer = await asyncio.open_connection(*self.address)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data) if declared is None else declared}\r\n\r\n")  # fmt: skip
        writer.write(head.encode() + data)
        await writer.drain()
        return reader, writer

    async def raw_cut(self, body: str, after: float) -> None:
        """Send ``body``, read what comes for ``after`` seconds, then close the connection."""
        reader, writer = await self.raw_request(body)
        try:
            head = await asyncio.wait_for(reader.read(64), after) if after else b""
        except TimeoutError:
            head = b""
        writer.close()
        status = re.match(rb"HTTP/1.1 (\d+)", head)
        if status is None:
            self.left_unanswered += 1
        elif status.group(1) == b"429":
            self.rejected_seen += 1
        self.expect("cut", status is None or int(status.group(1)) < 500, head.decode(errors="replace"))

    async def cut_before_first_byte(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 2000, "ignore_eos": True, "stream": rng.random() < 0.5,
                **({"n": 2} if rng.random() < 0.3 else {})}  # fmt: skip
        await self.raw_cut(json.dumps(body), 0)

    async def cut_mid_stream(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 2000, "ignore_eos": True, "stream": True,
                "n": rng.choice([1, 1, 2]), "logprobs": rng.choice([None, 2])}  # fmt: skip
        wanted = rng.randint(1, 8)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            self.rejected_seen += r.status_code == 429
            self.expect("cut-mid-stream", r.status_code == 200, str(r.status_code))
            seen = 0
            async for _ in r.aiter_lines():
                seen += 1
                if seen >= wanted:
                    break

    async def cut_while_compiling(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": wide_schema(rng)}}
        body = {"prompt": "{", "max_tokens": 64, "response_format": schema, "stream": rng.random() < 0.5}
        await self.raw_cut(json.dumps(body), rng.uniform(0, 0.03))

    async def cut_while_queued(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 4000, "ignore_eos": True,
                "stream": rng.random() < 0.5}  # fmt: skip
        await self.raw_cut(json.dumps(body), rng.uniform(0, 0.1))

    async def half_body(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": 8}).encode()
        _, writer = await self.raw_request(body[: len(body) // 2], declared=len(body))
        await asyncio.sleep(rng.uniform(0, 0.02))
        writer.close()
        self.outcomes["half-body"] += 1

    async def invalid_json(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = rng.choice([b'{"prompt": "a", ', b"{not json}", b'{"prompt": "a", "max_tokens": 1e999}', b"[1, 2"])
        r = await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        self.expect("invalid-json", r.status_code == 400 and "error" in r.json(), f"{r.status_code} {r.text}")

    async def client_timeout(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": 4000, "ignore_eos": True,
                "stream": rng.random() < 0.5}  # fmt: skip

        status: list[int] = []

        async def read_all() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                status.append(r.status_code)
                async for _ in r.aiter_bytes():
                    pass

        try:  # the client gives up on the whole request (a read timeout would not fire on a flowing stream)
            await asyncio.wait_for(read_all(), rng.uniform(0.01, 0.1))
        except TimeoutError:
            pass
        self.rejected_seen += status == [429]
        self.left_unanswered += not status
        self.outcomes["client-timeout"] += 1
