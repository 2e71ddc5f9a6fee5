"""The sync and async Python clients against a live server."""

from __future__ import annotations

import asyncio

import pytest

from rnnserve.clients import APIError, AsyncClient, ChatCompletion, Client, Completion
from tests.server.conftest import API_KEY, TINY

pytestmark = pytest.mark.timeout(60)

GREEDY = {"temperature": 0, "max_tokens": 6}
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_sync_client_endpoints(live_url: str) -> None:
    with Client(live_url, api_key=API_KEY) as client:
        assert client.health() and client.models() == [TINY]
        completion = client.completions("Hello", **GREEDY)
        assert isinstance(completion, Completion) and completion.usage is not None
        assert completion.usage.completion_tokens == 6 and completion.choices[0].finish_reason == "length"
        chunks = list(client.stream_completions("Hello", **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 11
        chat = client.chat(MESSAGES, model=TINY, **GREEDY)
        assert isinstance(chat, ChatCompletion) and chat.choices[0].message.role == "assistant"
        streamed = list(client.stream_chat(MESSAGES, **GREEDY))
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == chat.choices[0].message.content
        assert client.detokenize(client.tokenize("héllo")) == "héllo"


def test_sync_client_errors(live_url: str) -> None:
    with Client(live_url, api_key=API_KEY) as client:
        with pytest.raises(APIError) as err:
            client.completions("Hello", temperature=-1)
        assert err.value.status == 400 and err.value.param == "temperature"
        with pytest.raises(APIError) as err:
            list(client.stream_completions("Hello", model="gpt-17"))
        assert err.value.status == 404 and err.value.code == "model_not_found"
    with Client(live_url, api_key="wrong") as client, pytest.raises(APIError) as err:
        client.completions("Hello")
    assert err.value.status == 401


def test_async_client_endpoints(live_url: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(live_url, api_key=API_KEY) as client:
            assert await client.health() and await client.models() == [TINY]
            completion, chat = await asyncio.gather(
                client.completions("Hello", **GREEDY), client.chat(MESSAGES, **GREEDY)
            )
            chunks = [c async for c in client.stream_completions("Hello", **GREEDY)]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
            streamed = [c async for c in client.stream_chat(MESSAGES, **GREEDY)]
            text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            assert text == chat.choices[0].message.content
            assert await client.tokenize("ab") == [97, 98] and await client.detokenize([97, 98]) == "ab"
            with pytest.raises(APIError) as err:
                await client.chat([], **GREEDY)
            assert err.value.status == 400 and err.value.param == "messages"

    asyncio.run(scenario())
