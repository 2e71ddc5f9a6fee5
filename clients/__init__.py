"""Python clients for rnnserve or any OpenAI-compatible server (built on the ``openai`` package), and the
`rnnserve bench` load generator."""

from rnnserve.clients.client import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]
