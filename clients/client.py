"""rnnserve's Python client: the official ``openai`` client for the OpenAI routes, plus the routes it lacks.

::

    from rnnserve.clients import Client

    with Client("http://127.0.0.1:8000", api_key="secret") as client:
        completion = client.openai.completions.create(
            model=client.model, prompt="Once upon a time", max_tokens=32, extra_body={"top_k": 20}
        )
        print(completion.choices[0].text, client.tokenize("Once"), client.ready())

What stays here, and why: ``openai`` covers ``/v1`` (completions, chat, models, streaming, error classes, and
retries that honour ``Retry-After``); request fields beyond OpenAI's (``top_k``, ``ignore_eos``, ...) go in its
``extra_body``. It has no calls for the routes vLLM and rnnserve add (``/tokenize``, ``/detokenize``,
``/health``, ``/ready``, ``/version``, ``/metrics``) and no default model name, so those are here. They go
through the same ``openai`` client (its ``get``/``post`` with absolute URLs), so they share its connection pool,
auth, timeouts, retries and error classes (``openai.APIStatusError`` and subclasses). Needs the ``openai``
package: ``pip install 'rnnserve[client]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import openai

NO_KEY = "none"  # openai insists on an API key; a server without auth ignores it


def _openai() -> Any:
    try:
        import openai
    except ImportError as err:
        raise ImportError("rnnserve.clients needs the openai package: pip install 'rnnserve[client]'") from err
    return openai


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
        self.openai: openai.OpenAI = _openai().OpenAI(
            base_url=self.url("/v1"), api_key=api_key or NO_KEY, timeout=timeout, max_retries=max_retries
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
        return self.openai.get(self.url("/version"), cast_to=object)["version"]

    def metrics(self) -> str:
        """The Prometheus text page of ``/metrics``."""
        return self.openai.get(self.url("/metrics"), cast_to=str)

    def tokenize(self, text: str, model: str | None = None) -> list[int]:
        return self.openai.post(self.url("/tokenize"), body=self.body(model, prompt=text), cast_to=object)["tokens"]

    def detokenize(self, tokens: list[int], model: str | None = None) -> str:
        body = self.body(model, tokens=tokens)
        return self.openai.post(self.url("/detokenize"), body=body, cast_to=object)["prompt"]


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
        self.openai: openai.AsyncOpenAI = _openai().AsyncOpenAI(
            base_url=self.url("/v1"), api_key=api_key or NO_KEY, timeout=timeout, max_retries=max_retries
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
