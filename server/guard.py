"""ASGI middleware that guards every HTTP request before any parsing: the API key and the body size."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rnnserve.server.errors import APIError

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class RequestGuard:
    """API-key check (constant-time) on the protected routes and a request-body size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if not self._authorized(scope["path"], headers):
            error = APIError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large()(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, path: str, headers: dict[str, bytes]) -> bool:
        if self.api_key is None or not path.startswith(PROTECTED_PREFIXES):
            return True
        auth = headers.get("authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(token, self.api_key)

    def _too_large(self) -> JSONResponse:
        return APIError(
            413, f"request body is larger than {self.max_body_bytes} bytes", code="request_too_large"
        ).response()
