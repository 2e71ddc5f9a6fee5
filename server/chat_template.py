"""Render chat messages into a prompt with the tokenizer's Jinja chat template (sandboxed).

Models without a template (byte-level models such as the embedded default) use ``DEFAULT_CHAT_TEMPLATE``:
one ``Role: content`` line per message, then ``Assistant:`` when a generation prompt is requested. Pass a
stop string such as ``"\\nUser:"`` to end the reply at the next turn.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.tokenizer import Tokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}Assistant:{% endif -%}"
)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Apply the chat template; a template error becomes an InvalidParameterError on ``messages``."""
    source = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    try:
        text = _compile(source).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=_special_text(tokenizer, tokenizer.bos_token_id),
            eos_token=_special_text(tokenizer, tokenizer.eos_token_id),
        )
    except TemplateError as err:
        raise InvalidParameterError("messages", f"chat template error: {err}") from err
    if continue_final_message and messages:
        last = messages[-1]["content"]
        cut = text.rfind(last)
        if last and cut >= 0:
            text = text[: cut + len(last)]
    return text


def _special_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    """Text of a special token for templates that insert it (byte-level specials carry no text)."""
    if token_id is None:
        return ""
    to_token = getattr(getattr(tokenizer, "_tok", None), "id_to_token", None)
    return (to_token(token_id) or "") if to_token is not None else ""
