"""ASGI middleware that guards every HTTP request before any parsing: the Host header, the API key, the
content type and encoding, the body size and how long the body may take to arrive (at most until a shutdown's drain
ends)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
from collections.abc import Coroutine
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rnnserve.server.engine_core import SHUTDOWN_MESSAGE
from rnnserve.server.errors import APIError

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")  # "/tokenize" covers /tokenizer_info
# Read by probes and scrapers that name the pod by its address (kubelet, Prometheus, a container's HEALTHCHECK):
# not held to --allowed-hosts, which guards the API against DNS rebinding.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
JSON_MEDIA_TYPE = b"application/json"
STATE_UPLOAD_PATH = re.compile(r"/v1/sessions/[^/]+/state")  # PUT: a session's state, MBs, its own body limit


class BodyReads:
    """The request bodies still arriving. When a shutdown's drain ends, :meth:`refuse` answers each of them, and
    any body read after, with a 503: a request that had not arrived whole by then would never be served, and its
    client (a slow upload, a slowloris) would otherwise hold the shutdown until uvicorn cancels it with a 500."""

    def __init__(self) -> None:
        self.refused = False
        self._reads: set[asyncio.Task] = set()

    async def read(self, body: Coroutine[Any, Any, bytes | None], timeout: float) -> bytes | None:
        """``await body`` within ``timeout`` seconds (``asyncio.TimeoutError`` past it); a 503 APIError once
        refused."""
        if self.refused:
            body.close()
            raise self._refusal()
        task = asyncio.ensure_future(body)
        self._reads.add(task)
        try:
            return await asyncio.wait_for(task, timeout)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            cancelling = getattr(current, "cancelling", None)  # Python 3.11+: whether this request was cancelled
            if self.refused and task.cancelled() and not (cancelling is not None and cancelling()):
                raise self._refusal() from None
            raise
        finally:
            self._reads.discard(task)

    def refuse(self) -> None:
        """Answer the bodies still arriving, and every later one, with a 503."""
        self.refused = True
        for task in self._reads:
            task.cancel()

    @staticmethod
    def _refusal() -> APIError:
        return APIError(
            503, SHUTDOWN_MESSAGE, type="service_unavailable", headers={"Connection": "close"}, retryable=True
        )


def host_name(host: bytes) -> str:
    """``example.com:8000`` -> ``example.com``, ``[::1]:8000`` -> ``::1`` (lowercase)."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def is_ip_address(name: str) -> bool:
    """Whether ``name`` is an IPv4 or IPv6 address (not a host name)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class RequestGuard:
    """Host check (against DNS rebinding), API-key check (constant-time) on the protected routes, JSON-only
    POST bodies (a cross-origin form post cannot run a generation), and a body size limit and read timeout. A HEAD
    request is served as the GET it stands for.
    A session state upload (``PUT /v1/sessions/{id}/state``) has its own limit, ``max_state_bytes``. Bodies are
    read through ``body_reads``, which a shutdown's drain ends with a 503."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        read_timeout: float,
        trusted_hosts: tuple[frozenset[str], bool],
        max_state_bytes: int | None = None,
        body_reads: BodyReads | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_state_bytes = max(max_body_bytes, max_state_bytes or 0)
        self.read_timeout = read_timeout
        self.allowed_hosts, self.allow_ip_hosts = trusted_hosts
        self.body_reads = body_reads or BodyReads()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        error = self._check_headers(scope, headers)
        if error is None and scope["method"] in ("GET", "HEAD"):
            # HEAD is a GET whose body the server leaves out (uvicorn does, by its own copy of the scope): FastAPI's
            # GET routes answered it with a 405
            await self.app({**scope, "method": "GET"} if scope["method"] == "HEAD" else scope, receive, send)
            return
        body = None
        if error is None:
            try:
                body = await self.body_reads.read(self._read_body(receive, self._body_limit(scope)), self.read_timeout)
            except asyncio.TimeoutError:
                error = APIError(
                    408,
                    f"the request body did not arrive within {self.read_timeout:g} s",
                    code="request_timeout",
                    headers={"Connection": "close"},
                    retryable=True,
                )
            except APIError as err:
                error = err
        if error is not None:
            await error.response()(scope, receive, send)
            return
        if body is None:  # the client disconnected
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_headers(self, scope: Scope, headers: dict[str, bytes]) -> APIError | None:
        """The first error the request line and headers alone show, or None."""
        host = headers.get("host")
        if sum(name.lower() == b"host" for name, _ in scope["headers"]) > 1:  # RFC 9112 3.2: a 400, and the dict
            # above kept the last one, which the check would pass while a proxy in front routed by the first
            return APIError(400, "a request must have one Host header", code="invalid_host")
        if host is not None and scope["path"] not in PROBE_PATHS and not self._host_allowed(host_name(host)):
            return APIError(
                400, f"Host {host.decode('latin-1')!r} is not allowed (see --allowed-hosts)", code="invalid_host"
            )
        if not self._authorized(scope["path"], headers):
            return APIError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        media_type = headers.get("content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and media_type != JSON_MEDIA_TYPE:
            return APIError(
                415, "request bodies must be sent as 'Content-Type: application/json'", code="unsupported_media_type"
            )
        encoding = headers.get("content-encoding", b"").strip().lower()  # a gzip body was read as (invalid) JSON
        if encoding not in (b"", b"identity") and scope["method"] not in ("GET", "HEAD"):
            return APIError(
                415,
                f"request bodies are read as sent: Content-Encoding {encoding.decode('latin-1')[:40]!r} is not "
                "supported (send the body uncompressed)",
                code="unsupported_media_type",
            )
        declared = headers.get("content-length")
        limit = self._body_limit(scope)
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return self._too_large(limit)
        return None

    def _body_limit(self, scope: Scope) -> int:
        if scope["method"] == "PUT" and STATE_UPLOAD_PATH.fullmatch(scope["path"]):
            return self.max_state_bytes
        return self.max_body_bytes

    async def _read_body(self, receive: Receive, limit: int) -> bytes | None:
        """The whole body, or None if the client disconnected; a 413 APIError past ``limit`` bytes."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                raise self._too_large(limit)
            if not message.get("more_body", False):
                return bytes(body)

    def _host_allowed(self, name: str) -> bool:
        return "*" in self.allowed_hosts or name in self.allowed_hosts or (self.allow_ip_hosts and is_ip_address(name))

    def _authorized(self, path: str, headers: dict[str, bytes]) -> bool:
        if self.api_key is None or not path.startswith(PROTECTED_PREFIXES):
            return True
        auth = headers.get("authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(token, self.api_key)

    @staticmethod
    def _too_large(limit: int) -> APIError:
        return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
