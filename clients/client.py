"""Python clients (sync and async, over ``httpx``) for rnnserve or any OpenAI-compatible server.

::

    from rnnserve.clients import Client

    with Client("http://127.0.0.1:8000", api_key="secret") as client:
        print(client.completions("Once upon a time", max_tokens=32).choices[0].text)
        for chunk in client.stream_chat([{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.choices[0].delta.content or "", end="", flush=True)

Extra keyword arguments are sent as request fields (``temperature``, ``seed``, ``stop``, ``top_k``, ...).
Errors come back as :class:`APIError` carrying the server's OpenAI error fields.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict

Prompt = str | list[str] | list[int] | list[list[int]]
Messages = Iterable[dict[str, Any]]


class _Result(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Result):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Result):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class Completion(_Result):
    """A completion or one streamed chunk of it (``usage`` is set on the final result/chunk)."""

    id: str
    model: str
    created: int
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessage(_Result):
    role: str
    content: str | None = None


class ChatChoice(_Result):
    index: int
    message: ChatMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(_Result):
    id: str
    model: str
    created: int
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(_Result):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Result):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(_Result):
    id: str
    model: str
    created: int
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class APIError(Exception):
    """An error response (or an error event inside a stream)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def from_body(cls, status: int, body: Any) -> APIError:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return cls(status, str(body))
        return cls(
            status, str(error.get("message")), error.get("type"), error.get("param"), error.get("code")
        )


ResultT = TypeVar("ResultT", bound=_Result)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        raise APIError.from_body(response.status_code, body)


def _parse_event(line: str, result: type[ResultT]) -> ResultT | None:
    """One SSE line -> a chunk; None for blank/comment lines and ``[DONE]``; raises on error events."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    body = json.loads(data)
    if "error" in body:
        raise APIError.from_body(200, body)
    return result.model_validate(body)


def _body(model: str | None, extra: dict[str, Any], **fields: Any) -> dict[str, Any]:
    body = {k: v for k, v in fields.items() if v is not None}
    if model is not None:
        body["model"] = model
    return {**body, **extra}


class Client:
    """Synchronous client. ``base_url`` is the server root (``http://host:port``), without ``/v1``."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float | None = 600.0,
    ) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = self._http.post(path, json=body)
        _check(response)
        return response.json()

    def _stream(self, path: str, body: dict[str, Any], result: type[ResultT]) -> Iterator[ResultT]:
        with self._http.stream("POST", path, json={**body, "stream": True}) as response:
            if response.status_code >= 400:
                response.read()
                _check(response)
            for line in response.iter_lines():
                chunk = _parse_event(line, result)
                if chunk is not None:
                    yield chunk

    def models(self) -> list[str]:
        response = self._http.get("/v1/models")
        _check(response)
        return [m["id"] for m in response.json()["data"]]

    def health(self) -> bool:
        return self._http.get("/health").status_code == 200

    def completions(self, prompt: Prompt, model: str | None = None, **params: Any) -> Completion:
        return Completion.model_validate(self._post("/v1/completions", _body(model, params, prompt=prompt)))

    def stream_completions(
        self, prompt: Prompt, model: str | None = None, include_usage: bool = True, **params: Any
    ) -> Iterator[Completion]:
        body = _body(model, params, prompt=prompt, stream_options={"include_usage": include_usage})
        return self._stream("/v1/completions", body, Completion)

    def chat(self, messages: Messages, model: str | None = None, **params: Any) -> ChatCompletion:
        body = _body(model, params, messages=list(messages))
        return ChatCompletion.model_validate(self._post("/v1/chat/completions", body))

    def stream_chat(
        self, messages: Messages, model: str | None = None, include_usage: bool = True, **params: Any
    ) -> Iterator[ChatCompletionChunk]:
        body = _body(model, params, messages=list(messages), stream_options={"include_usage": include_usage})
        return self._stream("/v1/chat/completions", body, ChatCompletionChunk)

    def tokenize(self, text: str, model: str | None = None) -> list[int]:
        return self._post("/tokenize", _body(model, {}, prompt=text))["tokens"]

    def detokenize(self, tokens: list[int], model: str | None = None) -> str:
        return self._post("/detokenize", _body(model, {}, tokens=tokens))["prompt"]


class AsyncClient:
    """Asynchronous client with the same methods as :class:`Client` (streams are async iterators)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float | None = 600.0,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=timeout
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = await self._http.post(path, json=body)
        _check(response)
        return response.json()

    async def _stream(self, path: str, body: dict[str, Any], result: type[ResultT]) -> AsyncIterator[ResultT]:
        async with self._http.stream("POST", path, json={**body, "stream": True}) as response:
            if response.status_code >= 400:
                await response.aread()
                _check(response)
            async for line in response.aiter_lines():
                chunk = _parse_event(line, result)
                if chunk is not None:
                    yield chunk

    async def models(self) -> list[str]:
        response = await self._http.get("/v1/models")
        _check(response)
        return [m["id"] for m in response.json()["data"]]

    async def health(self) -> bool:
        return (await self._http.get("/health")).status_code == 200

    async def completions(self, prompt: Prompt, model: str | None = None, **params: Any) -> Completion:
        return Completion.model_validate(
            await self._post("/v1/completions", _body(model, params, prompt=prompt))
        )

    def stream_completions(
        self, prompt: Prompt, model: str | None = None, include_usage: bool = True, **params: Any
    ) -> AsyncIterator[Completion]:
        body = _body(model, params, prompt=prompt, stream_options={"include_usage": include_usage})
        return self._stream("/v1/completions", body, Completion)

    async def chat(self, messages: Messages, model: str | None = None, **params: Any) -> ChatCompletion:
        body = _body(model, params, messages=list(messages))
        return ChatCompletion.model_validate(await self._post("/v1/chat/completions", body))

    def stream_chat(
        self, messages: Messages, model: str | None = None, include_usage: bool = True, **params: Any
    ) -> AsyncIterator[ChatCompletionChunk]:
        body = _body(model, params, messages=list(messages), stream_options={"include_usage": include_usage})
        return self._stream("/v1/chat/completions", body, ChatCompletionChunk)

    async def tokenize(self, text: str, model: str | None = None) -> list[int]:
        return (await self._post("/tokenize", _body(model, {}, prompt=text)))["tokens"]

    async def detokenize(self, tokens: list[int], model: str | None = None) -> str:
        return (await self._post("/detokenize", _body(model, {}, tokens=tokens)))["prompt"]
