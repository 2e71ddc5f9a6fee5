"""Python clients for rnnserve or any OpenAI-compatible server, and the `rnnserve bench` load generator."""

from rnnserve.clients.client import (
    APIError,
    AsyncClient,
    ChatCompletion,
    ChatCompletionChunk,
    Client,
    Completion,
    Usage,
)

__all__ = [
    "APIError",
    "AsyncClient",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Client",
    "Completion",
    "Usage",
]
