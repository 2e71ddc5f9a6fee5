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


ODD_TEXTS = ["", "plain", 'quote " backslash \\ newline \n tab \t nul \x00 \x1f', "\u00e9\U0001f600\u4e2d",
             "\u2028\u2029\x85"]
SHAPES = [
    *({"index": i, "text": t, "finish_reason": f, "logprobs": None} for i, t, f in
      zip(range(5), ODD_TEXTS, [None, "stop", "length", None, "abort"], strict=True)),
    *({"index": 3, "delta": d, "finish_reason": f, "logprobs": None} for d, f in
      [({}, "stop"), ({"content": ODD_TEXTS[2]}, None), ({"content": ODD_TEXTS[4]}, None),
       ({"role": "assistant", "content": ""}, None)]),
    {"index": 0, "text": "x", "finish_reason": None, "logprobs": {"tokens": ["x"], "token_logprobs": [-0.5]}},
    {"index": 0, "delta": {"content": "x"}, "finish_reason": None, "logprobs": {"content": []}},
    {"index": 1, "text": "x", "finish_reason": None, "logprobs": None, "prompt_logprobs": [None]},
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("choices", [[c] for c in SHAPES] + [SHAPES[:2], SHAPES[5:7]])
def test_every_choice_shape_renders_as_the_encoder_would(kind: str, choices: list[dict]) -> None:
    """The one-choice chunks each stream writes without the JSON encoder (its own usual shape) are the encoder's
    text to the character; every other shape, or the other stream's, goes through the encoder."""
    cls = CompletionStream if kind == "completion" else ChatStream
    stream = cls.__new__(cls)
    assert stream.choices_json(choices) == json_text(choices)
