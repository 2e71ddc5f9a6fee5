"""Structured outputs: a JSON schema, a regular expression, a list of choices or a Lark grammar that every sample
of a request must follow, enforced by masking the logits with llguidance (one of vLLM's backends for the same
feature).

The engine compiles a request's grammar once when it is added (an invalid one is a 400 naming the field); each
sample then walks it with its own :class:`GrammarState`: the sampler masks the tokens the grammar forbids before
the penalties and filters, and advances the state by the sampled token right away (so the mask of the next step
never waits for the host to append the token). A sample whose grammar is complete ends with ``stop`` at that
token, whether or not the model would sample its end-of-text token next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rnnserve.engine.sampling_params import InvalidParameterError, StructuredOutputParams
from rnnserve.engine.tokenizer import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

BITS = torch.arange(32, dtype=torch.int32)
COMPACT_JSON = {"item_separator": ", ", "key_separator": ": "}


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


class _TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer that is not a Hugging Face one: each id's
    bytes, the special ids, EOS/BOS, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [t for t in (self.eos_token_id, self.bos_token_id) if t is not None]
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


class GrammarCompiler:
    """Compiles requests' constraints for one engine's tokenizer and vocabulary (llguidance is imported and the
    token table built on first use)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lltokenizer: LLTokenizer | None = None
        # the last constraint compiled: a request's prompts share one (compiled once, not once per prompt)
        self._last: tuple[StructuredOutputParams, CompiledGrammar] | None = None

    def _llguidance_tokenizer(self, param: str) -> LLTokenizer:
        if self._lltokenizer is None:
            try:
                from llguidance import LLTokenizer, TokenizerWrapper
            except ImportError as err:
                raise InvalidParameterError(param, "structured outputs need the llguidance package") from err
            tok = self._tokenizer
            if tok.eos_token_id is None:
                raise InvalidParameterError(param, "structured outputs need a tokenizer with an end-of-text token")
            if isinstance(tok, HFTokenizer):
                self._lltokenizer = LLTokenizer(tok.to_json(), n_vocab=self._vocab_size, eos_token=tok.eos_token_id)
            else:
                table = TokenizerWrapper(_TokenTable(tok, self._vocab_size))
                self._lltokenizer = LLTokenizer(table, n_vocab=self._vocab_size)
        return self._lltokenizer

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """The constraint as a checked llguidance grammar; :class:`InvalidParameterError` if it is invalid. The
        prompts of one request share its compiled grammar (immutable): a 20-prompt request with a large enum
        compiled it 20 times on the engine thread, every stream waiting."""
        if self._last is not None and self._last[0] is params:
            return self._last[1]
        compiled = self._compile(params)
        self._last = (params, compiled)
        return compiled

    def _compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        from llguidance import LLMatcher

        tokenizer = self._llguidance_tokenizer(params.param)
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else {"type": "object"}
            whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
            try:
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults={**COMPACT_JSON, **whitespace})
            except ValueError as err:
                raise InvalidParameterError(params.param, f"invalid JSON schema: {err}") from err
        elif params.regex is not None:
            grammar = LLMatcher.grammar_from_regex(params.regex)
        elif params.choice is not None:
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(map(_lark_string, params.choice)))
        else:
            grammar = LLMatcher.grammar_from_lark(params.grammar)  # type: ignore[arg-type]
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if not error:
            first_tokens, error = self._first_step(tokenizer, grammar)
        if error:
            raise InvalidParameterError(params.param, f"invalid structured output constraint: {error.strip()}")
        return CompiledGrammar(tokenizer, grammar, first_tokens)

    def _first_step(self, tokenizer: LLTokenizer, grammar: str) -> tuple[torch.Tensor, str | None]:
        """The tokens the grammar allows first (bool ``[vocab]``), and what stops it at its first token, which
        :meth:`LLMatcher.validate_grammar` does not try: the lexer's and parser's size limits (a regex
        ``a{1000000}``, a choice of 2001 strings) are met there, and a request would otherwise fail after it was
        accepted."""
        from llguidance import LLMatcher

        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        mask = torch.zeros((self._vocab_size + 31) // 32, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        first_tokens = allowed_tokens(mask[None], self._vocab_size)[0]
        allowed = first_tokens.nonzero()
        if not matcher.is_error() and len(allowed):
            matcher.consume_token(int(allowed[0]))
        return first_tokens, matcher_error(matcher) if matcher.is_error() else None


@dataclass(frozen=True)
class CompiledGrammar:
    """A request's checked grammar; each of its samples starts a :class:`GrammarState` from it.
    ``first_tokens`` (bool ``[vocab]``) are the tokens it allows first."""

    tokenizer: LLTokenizer
    grammar: str
    first_tokens: torch.Tensor

    def start(self) -> GrammarState:
        from llguidance import LLMatcher

        return GrammarState(LLMatcher(self.tokenizer, self.grammar, log_level=0))

    def allows_first(self, token_ids: list[int]) -> bool:
        """Whether any of ``token_ids`` can be the grammar's first token."""
        return any(bool(self.first_tokens[t]) for t in token_ids if t < len(self.first_tokens))


class GrammarState:
    """One sample's place in its grammar. ``end`` is the number of output tokens at which the grammar ended
    (complete, or ``error`` set when a token it forbids was sampled anyway); ``None`` while it goes on."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        self.end: int | None = None
        self.error: str | None = None

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens as bits into ``mask[row]`` (int32, CPU, contiguous)."""
        words = mask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def advance(self, token: int, num_tokens: int) -> None:
        """Consume the sampled ``token``, the sample's ``num_tokens``-th output token."""
        if not self.matcher.consume_token(token):
            self.error = matcher_error(self.matcher) or f"token {token} is not allowed here"
            self.end = num_tokens
        elif self.matcher.is_stopped():
            self.end = num_tokens


def matcher_error(matcher: LLMatcher) -> str:
    """The matcher's error without the parser state and grammar llguidance appends (kilobytes of them)."""
    return matcher.get_error().split("\n<state>", 1)[0].strip()


def allowed_tokens(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``mask [R, ceil(V / 32)]`` (int32 bit words) as a bool ``[R, vocab_size]`` on the mask's device."""
    bits = (mask[:, :, None] >> BITS.to(mask.device)) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab_size].bool()
