"""rnnserve's Python client: the official ``openai`` client for the OpenAI routes, plus the routes it lacks.

::

    from rnnserve.clients import Client

    with Client("http://127.0.0.1:8000", api_key="secret") as client:
        completion = client.openai.completions.create(
            model=client.model, prompt="Once upon a time", max_tokens=32, extra_body={"top_k": 20}
        )
        print(completion.choices[0].text, client.tokenize("Once"), client.ready())

        session = client.create_session()["id"]          # a persistent session: send only the new text
        for text in ["Once upon", " a time"]:
            reply = client.openai.completions.create(
                model=client.model, prompt=text, max_tokens=16, extra_body=client.session_fields(session)
            )
        state = client.export_session(session)            # safetensors bytes; import them on another replica

What stays here, and why: ``openai`` covers ``/v1`` (completions, chat, models, streaming, error classes, and
retries that honour ``Retry-After``); request fields beyond OpenAI's (``top_k``, ``ignore_eos``, ...) go in its
``extra_body``. It has no calls for the routes vLLM and rnnserve add (``/tokenize``, ``/detokenize``,
``/health``, ``/ready``, ``/version``, ``/metrics``, ``/v1/sessions``) and no default model name, so those are
here; a request continues a session with :meth:`session_fields` in ``extra_body``. They go
through the same ``openai`` client (its ``get``/``post`` with absolute URLs), so they share its connection pool,
auth, timeouts, retries and error classes (``openai.APIStatusError`` and subclasses).

Retries: ``openai`` retries a request after a timeout, a lost connection, 408, 409, 429 and 5xx
(``max_retries``). A session turn (a request with ``session_id``), :meth:`create_session` and
:meth:`fork_session` are sent once: a session turn whose client timed out or lost its connection while the server
stored its state is in the session (the server finishes the write), and a retry would add its prompt and answer
a second time; a create or fork whose answer was lost has made a session that a retry would make again, under
another id. Their errors, 409 ``session_busy`` and 429 included, reach the caller. :meth:`delete_session` is
retried (a lost answer, a 409 while a turn holds the session, a 503 while a server restarts), and so made
idempotent: a retry that finds no session answers as the delete did (``"deleted": true``), since an earlier
attempt may have deleted it and lost its answer, and the session is gone either way; a 404 to the first attempt
raises ``openai.NotFoundError``. (Sent once instead, a lost answer would leave the caller not knowing whether
the session still exists.) The server marks the errors a retry cannot help (a session limit, a bug) with
``x-should-retry: false``, which ``openai`` obeys. ``timeout`` is httpx's: it
bounds the connect and each read, so it cuts a stream that stalls, not one that keeps flowing (``rnnserve bench
--timeout`` bounds the whole request). A stream whose connection is cut raises ``openai.APIConnectionError``, one
that the server ends with an error event ``openai.APIError``. Needs the ``openai`` package: ``pip install
'rnnserve[client]'``.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import openai

NO_KEY = "none"  # openai insists on an API key; a server without auth ignores it
STATE_MEDIA_TYPE = "application/octet-stream"
SESSION_ID_PATTERN = re.compile(r"sess-[A-Za-z0-9_-]{16,128}")  # the server's (server/sessions.py)


def _openai() -> Any:
    try:
        import openai
    except ImportError as err:
        raise ImportError("rnnserve.clients needs the openai package: pip install 'rnnserve[client]'") from err
    return openai


ONCE = {"max_retries": 0}  # the options of a request that must not be sent twice
RETRY_COUNT_HEADER = "x-stainless-retry-count"  # openai's count of a request's earlier attempts, on each attempt


def _sent_once(options: Any) -> Any:
    """``options`` (openai's ``FinalRequestOptions``) without retries when the request continues a session
    (``session_id`` in its body or ``extra_body``): see the module docstring."""
    if not any(isinstance(body, Mapping) and "session_id" in body for body in (options.json_data, options.extra_json)):
        return options
    options = copy.copy(options)
    options.max_retries = 0
    return options


def _openai_client() -> type:
    """``openai.OpenAI`` that sends session turns once."""

    class OpenAI(_openai().OpenAI):
        def request(self, cast_to: Any, options: Any, **kwargs: Any) -> Any:
            return super().request(cast_to, _sent_once(options), **kwargs)

    return OpenAI


def _async_openai_client() -> type:
    """``openai.AsyncOpenAI`` that sends session turns once."""

    class AsyncOpenAI(_openai().AsyncOpenAI):
        async def request(self, cast_to: Any, options: Any, **kwargs: Any) -> Any:
            return await super().request(cast_to, _sent_once(options), **kwargs)

    return AsyncOpenAI


class _Routes:
    """What both clients share: the server root and the JSON bodies of the extra routes."""

    def __init__(self, base_url: str) -> None:
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self._model: str | None = None

    def url(self, path: str) -> str:
        return f"{self.root}{path}"

    @staticmethod
    def body(model: str | None, **fields: Any) -> dict[str, Any]:
        return {**fields, "model": model} if model is not None else fields

    @staticmethod
    def session_fields(session_id: str, **extra_body: Any) -> dict[str, Any]:
        """The ``extra_body`` of a completion or chat request that continues session ``session_id``."""
        return {**extra_body, "session_id": session_id}

    @staticmethod
    def deleted_on_retry(session_id: str, err: openai.NotFoundError) -> dict[str, Any]:
        """The answer of a delete whose retry found no session (``session_not_found``): the delete's body, as
        an earlier attempt, whose answer was lost, deleted it; ``err`` raised again when the 404 answered the
        first attempt (or a route the server lacks)."""
        retries = err.response.request.headers.get(RETRY_COUNT_HEADER, "0")
        if err.code != "session_not_found" or not retries.isdigit() or int(retries) == 0:
            raise err
        return {"id": session_id, "object": "session", "deleted": True}

    def session_url(self, session_id: str, action: str = "") -> str:
        """The route of ``session_id``; ``ValueError`` for a string that is no session id: an id from elsewhere
        such as ``../../metrics`` or ``<id>/state`` would reach another route (the server decodes ``%2F``
        before routing, so percent-encoding does not keep it on this one)."""
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            raise ValueError(f"{session_id[:80]!r} is not a session id (sess- and 16 to 128 of A-Z a-z 0-9 _ -)")
        return self.url(f"/v1/sessions/{session_id}{action}")


def default_api_key(api_key: str | None) -> str:
    """``api_key``, else ``$RNNSERVE_API_KEY`` or ``$OPENAI_API_KEY`` (as ``rnnserve bench`` and the ``openai``
    client read them), else a placeholder that a server without auth ignores."""
    return api_key or os.environ.get("RNNSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY") or NO_KEY


class Client(_Routes):
    """Synchronous client for ``base_url`` (the server root, ``http://host:port``; a trailing ``/v1`` is fine).
    ``client.openai`` is the ``openai.OpenAI`` client bound to the server."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float | None = 600.0,
        max_retries: int = 2,
    ) -> None:
        super().__init__(base_url)
        self.openai: openai.OpenAI = _openai_client()(
            base_url=self.url("/v1"), api_key=default_api_key(api_key), timeout=timeout, max_retries=max_retries
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.openai.close()

    @property
    def model(self) -> str:
        """The server's default model name (the first of ``/v1/models``), fetched once."""
        if self._model is None:
            self._model = self.openai.models.list().data[0].id
        return self._model

    def _probe(self, path: str) -> bool:
        try:
            self.openai.get(self.url(path), cast_to=object, options={"max_retries": 0})
        except (_openai().APIStatusError, _openai().APIConnectionError):
            return False
        return True

    def health(self) -> bool:
        """The server process and its engine thread are alive."""
        return self._probe("/health")

    def ready(self) -> bool:
        """The server takes requests now (model loaded, kernels built, not shutting down)."""
        return self._probe("/ready")

    def version(self) -> str:
        """The server's rnnserve version (``/version``)."""
        return self.openai.get(self.url("/version"), cast_to=object)["version"]

    def metrics(self) -> str:
        """The Prometheus text page of ``/metrics``."""
        return self.openai.get(self.url("/metrics"), cast_to=str)

    def tokenize(self, text: str, model: str | None = None) -> list[int]:
        """``text``'s token ids under ``model``'s tokenizer (default: the server's first model)."""
        return self.openai.post(self.url("/tokenize"), body=self.body(model, prompt=text), cast_to=object)["tokens"]

    def detokenize(self, tokens: list[int], model: str | None = None) -> str:
        """The text of ``tokens`` under ``model``'s tokenizer (default: the server's first model)."""
        body = self.body(model, tokens=tokens)
        return self.openai.post(self.url("/detokenize"), body=body, cast_to=object)["prompt"]

    def create_session(self, model: str | None = None) -> dict[str, Any]:
        """A new empty session: ``{"id": "sess-...", "object": "session", ...}`` (sent once, not retried)."""
        return self.openai.post(self.url("/v1/sessions"), body=self.body(model), cast_to=object, options=ONCE)

    def get_session(self, session_id: str) -> dict[str, Any]:
        """``session_id``'s description (``/v1/sessions/{id}``); ``openai.NotFoundError`` when there is none."""
        return self.openai.get(self.session_url(session_id), cast_to=object)

    def delete_session(self, session_id: str) -> dict[str, Any]:
        """Delete ``session_id`` → ``{"id", "object": "session", "deleted": True}``; ``openai.NotFoundError`` when
        there is none. Retried as other requests are; a retry's 404 is the answer to a delete that took place
        (see the module docstring)."""
        try:
            return self.openai.delete(self.session_url(session_id), cast_to=object)
        except _openai().NotFoundError as err:
            return self.deleted_on_retry(session_id, err)

    def fork_session(self, session_id: str) -> dict[str, Any]:
        """A new session with a copy of ``session_id``'s state (sent once, not retried)."""
        return self.openai.post(self.session_url(session_id, "/fork"), body={}, cast_to=object, options=ONCE)

    def export_session(self, session_id: str) -> bytes:
        """The session's file (safetensors), for :meth:`import_session` here or on another replica."""
        return self.openai.get(self.session_url(session_id, "/state"), cast_to=httpx.Response).content

    def import_session(self, session_id: str, state: bytes) -> dict[str, Any]:
        """Create or replace ``session_id`` from exported bytes (the server checks model and state layout)."""
        options = {"headers": {"Content-Type": STATE_MEDIA_TYPE}}
        return self.openai.put(self.session_url(session_id, "/state"), content=state, cast_to=object, options=options)


class AsyncClient(_Routes):
    """Asynchronous twin of :class:`Client`; ``client.openai`` is an ``openai.AsyncOpenAI``."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float | None = 600.0,
        max_retries: int = 2,
    ) -> None:
        super().__init__(base_url)
        self.openai: openai.AsyncOpenAI = _async_openai_client()(
            base_url=self.url("/v1"), api_key=default_api_key(api_key), timeout=timeout, max_retries=max_retries
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.openai.close()

    async def model(self) -> str:
        """The server's default model name (the first of ``/v1/models``), fetched once."""
        if self._model is None:
            self._model = (await self.openai.models.list()).data[0].id
        return self._model

    async def _probe(self, path: str) -> bool:
        try:
            await self.openai.get(self.url(path), cast_to=object, options={"max_retries": 0})
        except (_openai().APIStatusError, _openai().APIConnectionError):
            return False
        return True

    async def health(self) -> bool:
        return await self._probe("/health")

    async def ready(self) -> bool:
        return await self._probe("/ready")

    async def version(self) -> str:
        return (await self.openai.get(self.url("/version"), cast_to=object))["version"]

    async def metrics(self) -> str:
        return await self.openai.get(self.url("/metrics"), cast_to=str)

    async def tokenize(self, text: str, model: str | None = None) -> list[int]:
        body = self.body(model, prompt=text)
        return (await self.openai.post(self.url("/tokenize"), body=body, cast_to=object))["tokens"]

    async def detokenize(self, tokens: list[int], model: str | None = None) -> str:
        body = self.body(model, tokens=tokens)
        return (await self.openai.post(self.url("/detokenize"), body=body, cast_to=object))["prompt"]

    async def create_session(self, model: str | None = None) -> dict[str, Any]:
        return await self.openai.post(self.url("/v1/sessions"), body=self.body(model), cast_to=object, options=ONCE)

    async def get_session(self, session_id: str) -> dict[str, Any]:
        return await self.openai.get(self.session_url(session_id), cast_to=object)

    async def delete_session(self, session_id: str) -> dict[str, Any]:
        try:
            return await self.openai.delete(self.session_url(session_id), cast_to=object)
        except _openai().NotFoundError as err:
            return self.deleted_on_retry(session_id, err)

    async def fork_session(self, session_id: str) -> dict[str, Any]:
        url = self.session_url(session_id, "/fork")
        return await self.openai.post(url, body={}, cast_to=object, options=ONCE)

    async def export_session(self, session_id: str) -> bytes:
        url = self.session_url(session_id, "/state")
        return (await self.openai.get(url, cast_to=httpx.Response)).content

    async def import_session(self, session_id: str, state: bytes) -> dict[str, Any]:
        options = {"headers": {"Content-Type": STATE_MEDIA_TYPE}}
        url = self.session_url(session_id, "/state")
        return await self.openai.put(url, content=state, cast_to=object, options=options)
