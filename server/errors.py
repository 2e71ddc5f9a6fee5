"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import json
import logging
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger("rnnserve.server")


# OpenAI's SDKs retry 408, 409, 429 and 5xx answers unless this header says "false" (or "true": retry any)
SHOULD_RETRY_HEADER = "x-should-retry"


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields. ``retryable``: the same
    request sent again may succeed (a full queue, a busy session, a server shutting down or a failed engine
    step); every other error's response carries ``x-should-retry: false``, so that OpenAI's SDKs do not send
    again a request that would get the same answer (a session limit, a bug) or repeat what it did."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers
        self.retryable = retryable

    def body(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response_headers(self) -> dict[str, str]:
        """The response's headers: ``headers`` and, unless ``retryable``, ``x-should-retry: false``."""
        return dict(self.headers or {}) if self.retryable else {**(self.headers or {}), SHOULD_RETRY_HEADER: "false"}

    def response(self) -> JSONResponse:
        """The error as a JSON response with its status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.response_headers())

    def sse(self) -> str:
        """The error as a server-sent event (for failures after a stream has started)."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` with ``message``, naming ``param`` and ``code`` when given."""
    return APIError(400, message, param=param, code=code)


class InternalErrors:
    """ASGI middleware: an exception no handler took, raised before the response started, becomes OpenAI's
    500 body as a complete response (not ``retryable``: a bug answers the request the same way again), and the
    connection stays open. (Starlette's last-resort handler sends its 500 and then raises again, and uvicorn
    closes the connection without a ``Connection: close``: a client reusing it had its next, valid request
    fail.) One raised after the response started is raised again (the server refuses a second response start):
    the response is cut short, and the connection has to close. No wrapper of ``send`` tracks the start: every
    streamed event would pay for it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception as err:
            try:
                await APIError(500, "internal server error", type="internal_error").response()(scope, receive, send)
            except Exception:
                raise err from None
            logger.error("unhandled error", exc_info=err)


# A step of an error's location after a union-typed field: the member the value was tried as (``prompt.list[int]``)
UNION_MEMBER = re.compile(r"str|int|float|bool|(list|dict)\[.*\]")
# What each union-typed request field takes, for the error of a value it does not take
ACCEPTED_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string, null or a list of content parts ({"type": "text", "text": ...})',
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
    "function_call": "a string or an object",
    "guided_json": "a JSON schema: an object, or its text",
}


def union_error(loc: list[str]) -> APIError | None:
    """The 400 for a value that none of a union-typed field's members take (pydantic reports the first member's
    complaint, ``prompt.str: Input should be a valid string`` for ``[1.5]``), naming what the field takes; ``None``
    where ``loc`` is no union member's."""
    member = next(
        (i for i in range(1, len(loc)) if loc[i - 1] in ACCEPTED_FORMS and UNION_MEMBER.fullmatch(loc[i])), None
    )
    if member is None:
        return None
    field = loc[:member]
    accepted = ACCEPTED_FORMS[field[-1]]
    return bad_request(f"invalid value for {'.'.join(field)}: expected {accepted}", param=loc[0], code="invalid_type")


def from_validation_error(err: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    first = err.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ())]
    if first["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "extra_forbidden":
        return bad_request(
            f"unrecognized request argument supplied: {'.'.join(loc)}", param=loc[0] if loc else None
        )
    union = union_error(loc)
    if union is not None:
        return union
    if first["type"] == "missing":
        return bad_request(f"missing required parameter: {'.'.join(loc)}", param=loc[0] if loc else None)
    where = ".".join(loc) or "body"
    return bad_request(
        f"invalid value for {where}: {first['msg']}",
        param=loc[0] if loc else None,
        code="invalid_type" if "type" in first["type"] else "invalid_value",
    )
