"""Structured outputs: a JSON schema, a regular expression, a list of choices or a Lark grammar that every sample
of a request must follow, enforced by masking the logits with llguidance (one of vLLM's backends for the same
feature).

A request's grammar is compiled once, into a matcher at its start (an invalid one is a 400 naming the field); the
server compiles it off the engine's thread (see ``EngineCore``). Each sample then walks a copy of that matcher, its
:class:`GrammarState`: the sampler masks the tokens the grammar forbids before the penalties and filters, and
advances the state by the sampled token right away (so the mask of the next step never waits for the host to
append the token). A sample whose grammar is complete ends with ``stop`` at that token, whether or not the model
would sample its end-of-text token next.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from rnnserve.engine.sampling_params import InvalidParameterError, StructuredOutputParams
from rnnserve.engine.tokenizer import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

BITS = torch.arange(32, dtype=torch.int32)
COMPACT_JSON = {"item_separator": ", ", "key_separator": ": "}
# The most symbols a grammar may have (llguidance's default is 500,000). Larger grammars took seconds to compile
# and most then failed anyway (past ~65,000 symbols llguidance panics): a schema of 8000 objects was refused after
# 3 s; with this limit, after 0.2 s. A grammar just under it compiles in ~2.5 s (2-core Zen 5).
MAX_GRAMMAR_SIZE = 100_000
# llguidance compiles a grammar recursively, in Rust: each link of a chain of rules (a Lark rule that names the next,
# a JSON schema's $ref to the next definition) took ~3.3 KB of stack, so 3000 links (a 100 KB request) overflowed a
# thread's 8 MiB stack: SIGSEGV, the whole server gone. A compile therefore runs on a thread of its own whose stack
# grows with the constraint's size (the most any link took was ~370 stack bytes per byte of constraint; this allows
# 1 KiB), and a constraint is at most MAX_CONSTRAINT_BYTES (a stack of 576 MiB at most: address space, only the
# pages a compile touches take memory, and the thread ends with the compile).
MAX_CONSTRAINT_BYTES = 512 * 1024
COMPILE_STACK_BASE_BYTES = 64 << 20
COMPILE_STACK_BYTES_PER_BYTE = 1024
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it for our thread alone
T = TypeVar("T")


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
        compiled it 20 times on the engine thread, every stream waiting. llguidance releases the GIL while it
        compiles, so other threads run meanwhile."""
        last = self._last
        if last is not None and last[0] is params:
            return last[1]
        compiled = self._compile(params)
        self._last = (params, compiled)
        return compiled

    def _compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        from llguidance import LLMatcher, LLParserLimits

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
        size = len(grammar.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidParameterError(
                params.param,
                f"the structured output constraint is too large: {size} bytes as an llguidance grammar, the limit "
                f"is {MAX_CONSTRAINT_BYTES}",
            )

        def build() -> tuple[LLMatcher, tuple[int, ...], str | None]:
            limits = LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE, verbose_errors=False)
            matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
            if matcher.is_error():
                return matcher, (), matcher_error(matcher)
            return matcher, *self._first_step(matcher)

        stack_bytes = COMPILE_STACK_BASE_BYTES + COMPILE_STACK_BYTES_PER_BYTE * size
        matcher, first_words, error = call_with_stack(build, stack_bytes)
        if error is not None:
            raise InvalidParameterError(params.param, f"invalid structured output constraint: {error}")
        return CompiledGrammar(grammar, matcher, first_words)

    def _first_step(self, matcher: LLMatcher) -> tuple[tuple[int, ...], str | None]:
        """The tokens the grammar allows first (as :attr:`CompiledGrammar.first_words`), and what stops it at its
        first token, which compiling it does not try: the lexer's and parser's size limits (a regex
        ``a{1000000}``, a choice of 2001 strings) are met there, and a request would otherwise fail after it was
        accepted. Tried on a copy: ``matcher`` stays at the grammar's start. The bits are read in Python, not
        with torch ops: this runs on a compile thread beside the engine, where a parallel op over the vocabulary would
        start a second OpenMP team, which slows every CPU decode step (see ``EngineThread``)."""
        trial = matcher.deep_copy()
        mask = torch.zeros((self._vocab_size + 31) // 32, dtype=torch.int32)
        trial.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        words = tuple(mask.tolist())
        first = next((32 * i + (word & -word).bit_length() - 1 for i, word in enumerate(words) if word), None)
        if not trial.is_error() and first is not None:
            trial.consume_token(first)
        return words, matcher_error(trial) if trial.is_error() else None


def call_with_stack(function: Callable[[], T], stack_bytes: int) -> T:
    """``function()``, run on a new thread with a stack of ``stack_bytes`` (rounded up to whole 64 KiB); what it
    raises is raised here. For native code that recurses as deep as its input goes (llguidance's compiler)."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, function()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            outcome.append((False, err))

    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(-(-stack_bytes // 65536) * 65536)
        try:
            worker = threading.Thread(target=run, name="rnnserve-grammar-compile", daemon=True)
            worker.start()
        finally:
            threading.stack_size(previous)
    worker.join()
    succeeded, value = outcome[0]
    if not succeeded:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class CompiledGrammar:
    """A request's checked grammar (llguidance's serialized form) and its ``matcher`` at the start, which each of
    its samples copies into a :class:`GrammarState` (a copy takes microseconds; compiling the grammar again for
    each sample, on the engine's thread, took as long as the first compile). ``first_words`` are the tokens it
    allows first, 32 a word (token ``t`` is bit ``t % 32`` of word ``t // 32``)."""

    grammar: str
    matcher: LLMatcher
    first_words: tuple[int, ...]

    def start(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy())

    def allows_first(self, token_ids: list[int]) -> bool:
        """Whether any of ``token_ids`` can be the grammar's first token."""
        words = self.first_words
        return any(words[t >> 5] >> (t & 31) & 1 for t in token_ids if t >> 5 < len(words))


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
    """The matcher's error without what llguidance may append (parser state, grammar, a backtrace: kilobytes)."""
    error = matcher.get_error().split("\n<", 1)[0].strip()
    if error.startswith("panic: "):  # an internal limit met in llguidance's code, e.g. its 65,000 symbols
        return f"the constraint is too large for llguidance ({error.removeprefix('panic: ')})"
    return error


def allowed_tokens(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``mask [R, ceil(V / 32)]`` (int32 bit words) as a bool ``[R, vocab_size]`` on the mask's device."""
    bits = (mask[:, :, None] >> BITS.to(mask.device)) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab_size].bool()
