"""Render chat messages into a prompt with a Jinja chat template (sandboxed).

The template is, first found: the ``--chat-template FILE`` given to the server, ``chat_template.jinja`` in the
model's directory (next to its tokenizer, where ``transformers`` saves it), the tokenizer's own
(``chat_template`` in ``tokenizer_config.json``). Models with none (byte-level models such as the embedded
default) use ``DEFAULT_CHAT_TEMPLATE``: one ``Role: content`` line per message, then ``Assistant:`` when a
generation prompt is requested. An assistant message follows ``Assistant:`` with no space added: a reply sent
back as the model generated it (leading whitespace included) renders as the tokens it was, so the next turn
resumes from the prefix cache's snapshot after the reply, and a session's history equals the conversation's.
Pass a stop string such as ``"\\nUser:"`` to end the reply at the next turn.
A request's ``chat_template_kwargs`` (vLLM) become extra template variables.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rnnserve.engine.hf_cache import HFCacheMiss, looks_like_repo_id, resolve_repo_id
from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}:{{ '' if message['role'] == 'assistant' else ' ' }}"
    "{{ message['content'] }}{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}Assistant:{% endif -%}"
)
# What rendering a compiled template can raise on a request's values: Jinja's own errors, and the Python errors of
# the operations a template applies to them (a number added to a string, an index past a list's end, ...).
RENDER_ERRORS = (TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def model_directory(model: str) -> Path | None:
    """The folder a model name loads from (a checkpoint directory or a cached Hugging Face snapshot), if any."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if looks_like_repo_id(model):
        try:
            return resolve_repo_id(model)
        except HFCacheMiss:
            return None
    return None


def find_chat_template(tokenizer: Tokenizer, template_file: str | None, model_dir: Path | None) -> str | None:
    """The template source the server renders with (``None``: the tokenizer's or the default, see the module
    docstring). Raises ``ValueError`` for a template file that cannot be read or compiled, so a bad
    ``--chat-template`` stops the server at start-up rather than failing every chat request."""
    if template_file is not None:
        path = Path(template_file).expanduser()
    elif model_dir is not None and (model_dir / TEMPLATE_FILE).is_file():
        path = model_dir / TEMPLATE_FILE
    else:
        return tokenizer.chat_template
    try:
        source = path.read_text(encoding="utf-8")
        _compile(source)
    except OSError as err:
        raise ValueError(f"cannot read chat template {path}: {err.strerror}") from err
    except TemplateError as err:
        raise ValueError(f"chat template {path} does not compile: {err}") from err
    return source


def check_generation_prompt(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: a reply either starts after a generation prompt or continues the final message, not both
    (``add_generation_prompt`` defaults to true: continuing needs it set to false); an InvalidParameterError on
    ``continue_final_message`` otherwise (the server's 400, the offline ``LLM.chat``'s ``ValueError``)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidParameterError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt to "
            "false to continue the final message",
        )


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Apply ``template`` (default: the tokenizer's, else ``DEFAULT_CHAT_TEMPLATE``) with ``template_kwargs`` as
    extra variables; a template error becomes an InvalidParameterError on ``messages``, as does a Python error the
    template meets on the request's values (``'<call>' + name`` with a number for a tool call's name, ...), which
    Jinja raises as it is. Both ``add_generation_prompt`` and ``continue_final_message`` is an
    InvalidParameterError too (:func:`check_generation_prompt`)."""
    check_generation_prompt(add_generation_prompt, continue_final_message)
    source = template or tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    if template_kwargs and "messages" in template_kwargs:
        raise InvalidParameterError("chat_template_kwargs", "chat_template_kwargs cannot replace 'messages'")
    variables = {
        "add_generation_prompt": add_generation_prompt,
        "bos_token": special_token_text(tokenizer, tokenizer.bos_token_id),
        "eos_token": special_token_text(tokenizer, tokenizer.eos_token_id),
        **(template_kwargs or {}),
    }
    try:
        text = _compile(source).render(messages=messages, **variables)
    except RENDER_ERRORS as err:
        raise InvalidParameterError("messages", f"chat template error: {err}") from err
    if continue_final_message and messages:
        text = _cut_after_final_message(text, messages[-1]["content"])
    return text


def _cut_after_final_message(text: str, final: str) -> str:
    """``text`` up to the end of the final message's content, which the reply continues (a template that trims
    the messages has the stripped content); an InvalidParameterError when the template left it out."""
    for content in (final, final.strip()):
        cut = text.rfind(content)
        if cut >= 0:
            return text[: cut + len(content)]
    raise InvalidParameterError(
        "continue_final_message",
        "continue_final_message is set, but the chat template does not render the final message's content",
    )


def content_text(content: Any) -> str:
    """A message's OpenAI ``content`` as text: a string, ``None`` (``""``) or a list of ``text`` parts and
    ``refusal`` parts (an assistant's refusal sent back: its text), joined; :class:`InvalidParameterError` on
    ``messages`` for anything else (an image part: the models read text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameterError("messages", f"content must be text or a list of parts, got {content!r:.80}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal"):
            raise InvalidParameterError(
                "messages",
                f"content parts of type {kind!r} are not supported: this server's models read text only, "
                "so send the content as a string or as parts of type 'text'",
            )
        if not isinstance(part.get(kind), str):
            raise InvalidParameterError("messages", f"a content part of type {kind!r} needs a {kind!r} string")
        texts.append(part[kind])
    return "".join(texts)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages as a template reads them, each ``content`` as text (:func:`content_text`)."""
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidParameterError("messages", f"a message is a dict with a 'role', got {message!r:.80}")
    return [{**message, "content": content_text(message.get("content"))} for message in messages]


def special_token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    """Text of a special token for templates that insert it (byte-level specials carry no text)."""
    if token_id is None:
        return ""
    to_token = getattr(getattr(tokenizer, "_tok", None), "id_to_token", None)
    return (to_token(token_id) or "") if to_token is not None else ""
