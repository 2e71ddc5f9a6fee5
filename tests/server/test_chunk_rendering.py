"""A streamed chunk renders the fields every chunk shares once per response; the text must stay exactly the JSON
of the whole body, with usage (when asked for) after the choices and no line-separator character unescaped."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rnnserve.server.streaming import ChatStream, CompletionStream, json_text

CHOICES = [{"index": 0, "text": "a\u2028b \u00e9", "finish_reason": None, "logprobs": None}]


@pytest.mark.parametrize("usage", [None, "final", "continuous"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_chunk_is_the_json_of_its_whole_body(usage: str | None, kind: str) -> None:
    fields: dict = {"max_tokens": 4, "stream": True}
    if usage is not None:
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": usage == "continuous"}
    if kind == "completion":
        req, cls = CompletionRequest(prompt="hi", **fields), CompletionStream
    else:
        req, cls = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields), ChatStream
    submission = SimpleNamespace(request_id="cmpl-\u2029x", request_ids=["r"])
    stream = cls(ByteTokenizer(), submission, req, "model\u0085name", SamplingParams(max_tokens=4))
    final_usage = {"prompt_tokens": 2, "completion_tokens": 0}
    for choices, given in [(CHOICES, None), ([], final_usage), (CHOICES, None)]:
        body = stream.body(cls.chunk_object_name, choices)
        if usage is not None:
            body["usage"] = stream.usage() if given is None and usage == "continuous" else given
        rendered = stream.chunk(choices, given)
        assert rendered == f"data: {json_text(body)}\n\n"
        assert "\u2028" not in rendered and "\u2029" not in rendered and "\x85" not in rendered
        assert json.loads(rendered.removeprefix("data: ")) == body
