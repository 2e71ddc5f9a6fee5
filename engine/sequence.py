"""A request and its samples as the scheduler sees them."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NoReturn

import torch

from rnnserve.engine.models.base import long_tensor
from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from rnnserve.engine.sampling_params import InvalidParameterError, OutputKind, SamplingParams
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.engine.structured_output import CompiledGrammar, GrammarState
from rnnserve.engine.tokenizer import Tokenizer

TEXT_TAIL_CHARS = 4096  # characters a sample's text string grows by (past its longest stop string) between freezes
# the most steps a steady batch keeps for the batch (SteadyAppend.steps) before it settles them: settling is a pass
# over the samples, and one over thousands of steps at once would stall the batch's streams for milliseconds
MAX_KEPT_STEPS = 64


class Sequence:
    """One sample of a request: its slot, generated tokens, text and per-sample sampling state."""

    def __init__(self, group: SequenceGroup, index: int, tokenizer: Tokenizer) -> None:
        self.group = group
        self.params: SamplingParams = group.params
        self.index = index
        self.slot: int | None = None
        # The generated tokens (read through ``output_token_ids``): a steady batch of lazy samples, or of streams,
        # keeps its latest steps' tokens (and texts) for the whole batch (``_appender``, a SteadyAppend) until
        # something reads them (_settle).
        self._output: list[int] = []
        self._appender: SteadyAppend | None = None
        self.num_pending = 0  # tokens sampled on the device and not yet appended (at most one: async scheduling)
        self.num_fed = 0  # output tokens the slot's state has consumed, or will once the queued steps ran
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's)
        # The text is ``"".join(_frozen) + _text``: appending to one long string copies it whole each time, so
        # every TEXT_TAIL_CHARS all but what a stop string may still reach moves to ``_frozen`` (its length:
        # ``_frozen_len``). Text positions (``_emitted_text``) count from the start of the whole text.
        self._text = ""
        self._frozen: list[str] = []
        self._frozen_len = 0
        self._stop_reach = max(map(len, self.params.stop), default=0)
        self._detokenizer = tokenizer.stream_decoder(group.prompt_token_ids, self.params.skip_special_tokens)
        # A FINAL_ONLY sample without stop strings decodes its text when its output is read, once, instead of
        # token by token (``_text_tokens`` tokens are in ``_text``); a stream reads it every step anyway.
        self._lazy_text = (
            not self.params.stop and self.params.output_kind is OutputKind.FINAL_ONLY
            and group.grammar is None
        )  # fmt: skip
        self._text_tokens = 0
        self._flushed = False
        self._emitted_text = 0
        self._emitted_tokens = 0
        self._stop_matched = [0] * len(self.params.stop)
        self.generator: torch.Generator | None = None
        self.token_counts: torch.Tensor | None = None
        self.seen_mask: torch.Tensor | None = None
        self.logit_bias: torch.Tensor | None = None
        self.grammar: GrammarState | None = None
        # the tokens that end the sample (not part of its text)
        self.end_ids = frozenset(self.params.stop_token_ids) | (
            tokenizer.eos_token_ids if not self.params.ignore_eos else frozenset()
        )
        # stop token ids whose text the output keeps (vLLM's include_stop_str_in_output)
        self._kept_stop_ids = frozenset(self.params.stop_token_ids if self.params.include_stop_str_in_output else ())
        self.max_tokens = self.params.max_tokens
        # Sampling is a plain argmax: no draw, bias, penalties, banned stop tokens or logprobs (the sampler's fast
        # path)
        self.argmax_only = (
            self.params.greedy and not self.params.uses_penalties and not self.params.min_tokens
            and self.params.logprobs is None and not self.params.biases_logits
            and group.grammar is None
        )  # fmt: skip

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (those a steady batch appended for the whole batch put in first)."""
        appender = self._appender
        if appender is not None and appender.steps:
            appender.settle()
        return self._output

    def _settle(self) -> None:
        """Put the tokens and texts a steady batch keeps for the whole batch into its samples (this one's among
        them): every method that reads the text or the emitted positions runs it first."""
        appender = self._appender
        if appender is not None and appender.steps:
            appender.settle()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The sample's text so far (a stop string and what follows it cut off)."""
        self._settle()
        if self._lazy_text:
            self._decode_pending()
        return "".join(self._frozen) + self._text if self._frozen else self._text

    def abandon_text(self) -> None:
        """End the sample as failed because decoding its text raised: the text stays what was decoded."""
        self._lazy_text = False
        self.finish_reason = "error"

    def _decode_pending(self) -> None:
        """Lazy text: decode the tokens appended since the last read (not a stop token that ended the sample),
        then, once the sample ended with ``stop`` or ``length``, what the decoder still holds."""
        output = self.output_token_ids
        reason = self.finish_reason
        end = len(output)
        if reason == "stop" and output[-1] not in self._kept_stop_ids:  # a stop token has no text
            end -= 1
        if end > self._text_tokens:
            self._text += self._detokenizer.push_many(output[self._text_tokens : end])
            self._text_tokens = end
        if (reason == "stop" or reason == "length") and not self._flushed:
            self._text += self._detokenizer.flush()
            self._flushed = True

    @property
    def num_sampled(self) -> int:
        """Tokens sampled so far, including one the host has not read yet."""
        return len(self.output_token_ids) + self.num_pending

    def init_sampling_state(self, vocab_size: int, device: torch.device) -> None:
        """Create the seeded generator, penalty counters, logit bias (constant size: vocab-sized rows) and
        grammar state."""
        params = self.params
        if self.group.grammar is not None:
            self.grammar = self.group.grammar.start()
        if params.biases_logits:
            self.logit_bias = self.group.logit_bias_row(vocab_size, device)
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed + self.index)
        if params.uses_penalties:
            self.token_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self.seen_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt = long_tensor(self.group.prompt_token_ids, device)
            self.seen_mask.index_fill_(0, prompt.clamp(0, vocab_size - 1), True)

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """Record a sampled token, update text and decide whether the sample is finished: EOS (unless ignored)
        or a stop token id ends it with ``stop``, ``max_tokens`` with ``length``, a stop string in the text or a
        completed grammar with ``stop`` (the penalty counters and the grammar state were updated when it was
        sampled)."""
        output = self.output_token_ids
        output.append(token_id)
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
        if token_id in self.end_ids:
            self.finish_reason = "stop"
            if token_id in self.params.stop_token_ids:
                self.stop_reason = token_id
            if not self._lazy_text:
                old_len = len(self._text)
                if token_id in self._kept_stop_ids:
                    self._text += self._detokenizer.push(token_id)
                self._text += self._detokenizer.flush()
                if self.params.stop and len(self._text) > old_len:  # a stop string the kept text completes cuts it
                    self._truncate_at_stop_string(old_len, len(output) > self.params.min_tokens)
            return
        at_limit = len(output) >= self.max_tokens
        if self._lazy_text:
            if at_limit:
                self.finish_reason = "length"
            return
        old_len = len(self._text)
        self._text += self._detokenizer.push(token_id)
        if at_limit:
            self._text += self._detokenizer.flush()
        if self.params.stop and self._truncate_at_stop_string(old_len, len(output) > self.params.min_tokens):
            self.finish_reason = "stop"
        elif self.grammar is not None and self.grammar.end == len(output):
            if self.grammar.error is not None:
                raise InvalidParameterError(
                    self.params.structured_outputs.param,  # type: ignore[union-attr]
                    f"the structured output failed after {len(output) - 1} tokens: {self.grammar.error}",
                )
            if not at_limit:
                self._text += self._detokenizer.flush()
            self.finish_reason = "stop"
        elif at_limit:
            self.finish_reason = "length"
        if len(self._text) > TEXT_TAIL_CHARS + self._stop_reach:
            self._freeze()

    def _add_text(self, text: str) -> None:
        """Append decoded text (a steady batch's kept steps), freezing the text's head once it grows long."""
        self._text += text
        if len(self._text) > TEXT_TAIL_CHARS + self._stop_reach:
            self._freeze()

    def _freeze(self) -> None:
        """Move the text a stop string can no longer reach (all but the last ``_stop_reach`` characters: a
        match in progress is shorter than its stop string) from ``_text`` to ``_frozen``."""
        cut = len(self._text) - self._stop_reach
        self._frozen.append(self._text[:cut])
        self._frozen_len += cut
        self._text = self._text[cut:]

    def _truncate_at_stop_string(self, old_len: int, active: bool) -> bool:
        """Cut ``text`` before the earliest stop string that the new text ``text[old_len:]`` completes (stop
        strings are not emitted; with ``include_stop_str_in_output``, after it). While not ``active`` (up to
        ``min_tokens`` output tokens, as vLLM counts them) matches are passed over, and one that ends in a later
        token's text still stops the sample.

        Each stop string is matched incrementally (Knuth-Morris-Pratt): ``_stop_matched[i]`` is the length of
        the longest prefix of stop string ``i`` that ends the text, so only the new characters are read, at an
        amortised O(number of stop strings) per character, whatever the length of the output so far.
        """
        new_text = self._text[old_len:]
        first: tuple[int, int, int] | None = None  # the earliest match's start, end and stop string
        for i, (stop, fallback) in enumerate(zip(self.params.stop, self.group.stop_fallbacks, strict=True)):
            matched = self._stop_matched[i]
            for pos, char in enumerate(new_text, old_len + 1):
                while matched and stop[matched] != char:
                    matched = fallback[matched - 1]
                if stop[matched] == char:
                    matched += 1
                    if matched == len(stop):
                        if active:
                            found = (pos - matched, pos, i)
                            first = min(first, found) if first is not None else found
                            break
                        matched = fallback[matched - 1]
            self._stop_matched[i] = matched
        if first is None:
            return False
        self._text = self._text[: first[1] if self.params.include_stop_str_in_output else first[0]]
        self.stop_reason = self.params.stop[first[2]]
        return True

    def take_delta(self) -> tuple[str, list[int]]:
        """The text and the tokens the sample added since the previous take (text held back where a stop string
        may start), marked as taken: what a ``DELTA`` output of a sample without logprobs needs."""
        self._settle()
        if self._lazy_text:
            self._decode_pending()
        emitted, frozen = self._emitted_text, self._frozen_len
        safe = frozen + len(self._text)
        if self._stop_matched and self.finish_reason is None:  # hold back what may start a stop string
            safe -= max(self._stop_matched)
        if safe < emitted:
            safe = emitted
        self._emitted_text = safe
        tokens = self.output_token_ids
        new_ids = tokens[self._emitted_tokens :]
        self._emitted_tokens = len(tokens)
        if emitted >= frozen:  # a stream's usual take: all of it in the tail
            return self._text[emitted - frozen : safe - frozen], new_ids
        return self.text[emitted:safe], new_ids

    def take_output(self, kind: OutputKind) -> CompletionOutput:
        """What the sample added since the previous call (text held back where a stop string may start), with
        the whole text, tokens and logprobs so far unless ``kind`` is ``DELTA``: then those fields hold only
        the delta too, so a step's output costs what the step added, not what the sample holds."""
        return CompletionOutput(*self.take_output_fields(kind))

    def take_output_fields(self, kind: OutputKind) -> tuple:
        """:meth:`take_output` as the tuple of :class:`CompletionOutput`'s fields, in order (the engine process
        sends them so, without building the object)."""
        new_logprobs = self.logprobs[self._emitted_tokens :] if self.logprobs is not None else []
        delta, new_ids = self.take_delta()
        safe = self._emitted_text
        if kind is OutputKind.DELTA:
            text, token_ids, logprobs = delta, new_ids, new_logprobs if self.logprobs is not None else None
        else:
            text, token_ids = self.text[:safe], list(self.output_token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        return (self.index, text, token_ids, self.finish_reason, logprobs, self.cumulative_logprob, delta, new_ids,
                new_logprobs, self._emitted_tokens, self.stop_reason)  # fmt: skip


class SteadyAppend:
    """:meth:`Sequence.append_token` for a whole steady batch at once: the same samples step after step, each
    plain (no logprobs, stop strings or grammar, not finished). While no token of a step is an end token of
    the batch and no sample reaches its ``max_tokens``, appending a step's tokens is appending each token and,
    for a sample that decodes as it goes (not ``FINAL_ONLY``), its text: :meth:`append` does just that, with
    both checks made once for the batch; any other step is left to ``append_token``.

    A batch whose samples all decode their text lazily (``FINAL_ONLY``) does not even append each token: it keeps
    each step's token list (``steps``) and puts them into the samples' lists (:meth:`settle`) when one is read
    (``Sequence.output_token_ids``, which every reader goes through) or the batch ends (:meth:`end`). A batch of
    streams keeps each step's texts too (``texts``: what each sample's decoder gave), settled with the tokens
    whenever a sample's text, tokens or emitted positions are read (``Sequence._settle``); meanwhile the stream
    plan of the engine process takes the kept steps' outputs as they are (:meth:`take_kept`)."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        self.outputs = [s.output_token_ids for s in seqs]
        self.lazy = all(s._lazy_text for s in seqs)  # no text to decode per token
        self.end_ids = frozenset().union(*(s.end_ids for s in seqs))
        self.room = min(s.max_tokens - len(s.output_token_ids) for s in seqs)  # before the limit, the fewest left
        self.streaming = not any(s._lazy_text for s in seqs)  # every sample a stream (plain: no stop strings)
        # the kept steps' tokens and (streams) texts, in the samples' order, not in the samples yet
        self.steps: list[list[int]] = []
        self.texts: list[list[str]] = []
        # Streams' texts: each step's from one look-up per token (``Tokenizer.plain_texts``), where the tokenizer
        # has plain texts, pushed into a sample's decoder only where its token has none or the decoder does not take
        # plain texts now (``pushed``: those samples, by position; see ``StreamDecoder.takes_plain``).
        self.decoders = [s._detokenizer for s in seqs] if self.streaming else []
        self.plain_texts = self.decoders[0].tokenizer.plain_texts if self.decoders else None
        self.pushed = {i for i, decoder in enumerate(self.decoders) if not decoder.takes_plain}
        # Streams: the parts whose kept steps :meth:`take_kept` takes on their own (``part_of``: each sample's part,
        # by position; None: one part, all of them; see :meth:`split`), and per part how many of the kept steps it
        # took and whether each of its samples had emitted all it held before the first kept step (its emitted
        # positions at its end): only then are the kept steps' texts and tokens its delta.
        self.part_of: list[int] | None = None
        self.taken = [0]
        self.emitted_all = [False]
        if self.lazy or self.streaming:
            for seq in seqs:
                seq._appender = self

    def split(self, part_of: list[int] | None, num_parts: int) -> None:
        """Let :meth:`take_kept` take the kept steps of ``num_parts`` parts of the samples on its own, each sample
        in part ``part_of[position]`` (``None``: one part): the engine process's stream plan, one part per API
        server, takes a server's part only while that server keeps up. Settles the steps kept so far; a part's
        samples have emitted all they held where every sample had."""
        self.settle()
        self.part_of = part_of
        self.taken = [0] * num_parts
        self.emitted_all = [all(self.emitted_all)] * num_parts

    def settle(self) -> None:
        """Append the tokens of the steps kept for the batch to each sample's list, and (streams) their texts to
        its text, its emitted positions past what :meth:`take_kept` took of its part."""
        steps, self.steps = self.steps, []
        if not self.streaming:
            if len(steps) == 1:
                for output, token in zip(self.outputs, steps[0], strict=True):
                    output.append(token)
            elif steps:
                for output, tokens in zip(self.outputs, zip(*steps, strict=True), strict=True):
                    output += tokens
            return
        texts, self.texts = self.texts, []
        taken_of_part, self.taken = self.taken, [0] * len(self.taken)
        kept = len(steps)  # a part that took fewer holds kept text it never emitted
        self.emitted_all = [emitted and taken == kept
                            for emitted, taken in zip(self.emitted_all, taken_of_part, strict=True)]
        if not steps:
            return
        part_of = self.part_of
        if part_of is None:
            taken_per_seq = [taken_of_part[0]] * len(self.seqs)
        else:
            taken_per_seq = list(map(taken_of_part.__getitem__, part_of))
        for seq, taken, tokens, pieces in zip(self.seqs, taken_per_seq, zip(*steps, strict=True),
                                              zip(*texts, strict=True), strict=True):  # fmt: skip
            seq._output += tokens
            text = "".join(pieces)
            if taken:
                seq._emitted_text += len(text) if taken == kept else len("".join(pieces[:taken]))
                seq._emitted_tokens += taken
            seq._add_text(text)

    def take_kept(self, part: int = 0) -> tuple[list[list[int]], list[list[str]]]:
        """Streams whose samples of ``part`` had all emitted what they held (``emitted_all[part]``): the kept steps
        that part did not take yet, their tokens and their texts, each step's of all the samples, in their order (a
        sample's delta, what ``Sequence.take_delta`` would give, is its tokens and its texts joined, without
        settling), marked as taken for the part."""
        taken = self.taken
        start = taken[part]
        taken[part] = len(self.steps)
        return self.steps[start:], self.texts[start:]

    def end(self) -> None:
        """The batch ends (its samples change): its samples take their tokens and texts and leave it."""
        self.settle()
        if self.lazy or self.streaming:
            for seq in self.seqs:
                seq._appender = None

    @staticmethod
    def plain(seq: Sequence) -> bool:
        """Whether ``seq`` may be in a steady append: appending a token that ends nothing only records it."""
        return seq.finish_reason is None and seq.logprobs is None and not seq.params.stop and seq.grammar is None

    def append(self, token_ids: list[int]) -> bool:
        """Append one token to each sample (``token_ids`` in the samples' order) when none ends a sample or
        reaches ``max_tokens``; returns whether it did (else nothing changed). Decoding a sample's text may raise
        (a tokenizer's error): :class:`SteadyAppendError` then says which sample; the samples before it have their
        tokens, it has its token as ``append_token`` leaves it when it raises, the others have nothing."""
        if self.room <= 1 or not self.end_ids.isdisjoint(token_ids):
            return False
        self.room -= 1
        if len(self.steps) >= MAX_KEPT_STEPS:  # before this step's: the stream plan took the others (a part whose
            # server is behind takes what it did not as its samples' deltas)
            self.settle()
        if self.lazy:
            self.steps.append(token_ids)
            return True
        if self.streaming:
            texts = self._stream_texts(token_ids)
            self.steps.append(token_ids)
            self.texts.append(texts)
            return True
        seq = self.seqs[0]
        try:
            for seq, output, token in zip(self.seqs, self.outputs, token_ids, strict=True):
                output.append(token)
                if seq._lazy_text:
                    continue
                text = seq._text + seq._detokenizer.push(token)
                seq._text = text
                if len(text) > TEXT_TAIL_CHARS + seq._stop_reach:
                    seq._freeze()
        except Exception as err:
            raise SteadyAppendError(self.seqs.index(seq), err) from err
        return True

    def _stream_texts(self, token_ids: list[int]) -> list[str]:
        """The text each stream's decoder gives for its token (``token_ids`` in the samples' order): its plain text
        where the tokenizer has one and the decoder takes it, else what pushing the token gives. A decoder that
        raises ends it (:meth:`_append_failed`)."""
        texts = self.plain_texts(token_ids) if self.plain_texts is not None else None
        if texts is None:
            texts = []
            try:
                for decoder, token in zip(self.decoders, token_ids, strict=True):
                    texts.append(decoder.push(token))
            except Exception as err:
                self._append_failed(token_ids, texts, len(texts), err)
            return texts
        pushed = self.pushed
        if not pushed and None not in texts:  # the usual step: no decoder pushed
            return texts  # type: ignore[return-value]
        for index in sorted(pushed.union(i for i, text in enumerate(texts) if text is None)):
            decoder = self.decoders[index]
            try:
                texts[index] = decoder.push(token_ids[index])
            except Exception as err:
                self._append_failed(token_ids, texts, index, err)  # type: ignore[arg-type]
            if decoder.takes_plain:
                pushed.discard(index)
            else:
                pushed.add(index)
        return texts  # type: ignore[return-value]

    def _append_failed(self, token_ids: list[int], texts: list[str], index: int, error: Exception) -> NoReturn:
        """Sample ``index``'s decoder raised on its token: the samples before it take their tokens and texts
        (``texts``), it its token (as ``append_token`` leaves it), the others nothing; :class:`SteadyAppendError` says
        which."""
        self.settle()
        for seq, token, text in zip(self.seqs[:index], token_ids, texts, strict=False):
            seq._output.append(token)
            seq._add_text(text)
        self.seqs[index]._output.append(token_ids[index])
        raise SteadyAppendError(index, error) from error


def take_stream_deltas(seqs: list[Sequence], handles: list[int], column: list[Any]) -> None:
    """:meth:`Sequence.take_delta` of each of ``seqs`` (unfinished samples whose text decodes as it goes, not
    ``FINAL_ONLY``'s lazy text) in one pass, appended to ``column`` as ``handle, text, token_ids`` after one another
    (``handles``: one per sample). A sample without stop strings holds no text back: its delta is all of its text
    and tokens past what it emitted, sliced here without a call per sample."""
    for seq, handle in zip(seqs, handles, strict=True):
        seq._settle()  # a steady batch's kept steps go into its samples first
        if seq._stop_matched:  # stop strings: what may start one is held back
            column.append(handle)
            column += seq.take_delta()
            continue
        text = seq._text
        frozen = seq._frozen_len
        emitted = seq._emitted_text
        seq._emitted_text = frozen + len(text)
        tokens = seq._output  # settled above
        start = seq._emitted_tokens
        seq._emitted_tokens = len(tokens)
        column += (handle, text[emitted - frozen :] if emitted >= frozen else seq.text[emitted:], tokens[start:])


class SteadyAppendError(Exception):
    """Appending a steady batch's tokens stopped at sample ``index``, whose appending raised ``error``."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


@dataclass(eq=False)
class SequenceGroup:
    """A request: one prompt, ``n`` samples. The prompt is prefilled once into the first sample's slot and
    forked into the others.

    ``prompt_token_ids`` is the whole sequence before the output. A request that continues a client's state
    (``from_context``) starts with ``initial_state`` (written into its first slot at admission) and
    ``num_prefilled`` at the tokens that state consumed; such a request neither reads nor feeds the prefix
    cache, so a state a client sent can never reach another request.
    ``return_state`` asks for ``final_state`` when the sample finishes with ``stop`` or ``length``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    seqs: list[Sequence] = field(default_factory=list)
    num_prefilled: int = 0
    error: str | None = None
    error_param: str | None = None  # the parameter that made the request fail, when it is the request's own
    prompt_logprobs: list[TokenLogprob | None] | None = None
    from_context: bool = False
    initial_state: dict[str, torch.Tensor] | None = None
    num_cached_tokens: int = 0
    branch_point: int = 0  # where the prompt leaves a sequence the prefix cache holds: a snapshot is taken there
    return_state: bool = False
    final_state: StateSnapshot | None = None
    final_state_copied: torch.cuda.Event | None = None  # on CUDA: once done, ``final_state`` holds the state
    grammar: CompiledGrammar | None = None  # the compiled ``structured_outputs`` each sample follows

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # whether its caller reads each step's progress (else only the end: a sample's end is all it reports)
        self.reads_every_step = self.params.output_kind is not OutputKind.FINAL_ONLY
        self._logit_bias_row: torch.Tensor | None = None

    def logit_bias_row(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """The ``[vocab_size]`` row the sampler adds to this request's logits: ``logit_bias`` at its tokens and,
        with ``allowed_token_ids``, ``-inf`` at every other token (built once, shared by the ``n`` samples)."""
        if self._logit_bias_row is None:
            params = self.params
            row = torch.zeros(vocab_size, dtype=torch.float32)
            if params.allowed_token_ids is not None:
                row.fill_(float("-inf"))
                row[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = 0.0
            if params.logit_bias:
                tokens = torch.tensor(list(params.logit_bias), dtype=torch.long)
                row[tokens] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
            self._logit_bias_row = row.to(device)
        return self._logit_bias_row

    @cached_property
    def stop_fallbacks(self) -> list[array]:
        """The KMP failure function of each stop string (built once, shared by the ``n`` samples): entry
        ``k`` is the length of the longest proper prefix of ``stop[: k + 1]`` that is also its suffix."""
        return [_failure_function(stop) for stop in self.params.stop]

    def record_prompt_logprobs(self, start: int, logits: torch.Tensor) -> None:
        """Append the logprobs of the prompt tokens that ``logits`` (the rows of prompt positions ``start``,
        ``start + 1``, ...) predict: each row's next prompt token, with its rank and the top
        ``params.prompt_logprobs`` alternatives. Log-softmax runs in fp32 (fp64 for fp64 logits)."""
        if self.prompt_logprobs is None:
            return
        targets = self.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        if not targets:
            return
        logp = torch.log_softmax(logits[: len(targets)].to(torch.promote_types(logits.dtype, torch.float32)), -1)
        target = torch.tensor(targets, device=logp.device)[:, None]
        chosen = logp.gather(1, target)
        ranks = (logp > chosen).sum(1).add_(1).tolist()
        top_vals, top_ids = logp.topk(min(self.params.prompt_logprobs, logp.shape[-1]), dim=-1)
        for token, lp, rank, ids, vals in zip(
            targets, chosen[:, 0].tolist(), ranks, top_ids.tolist(), top_vals.tolist(), strict=True
        ):
            self.prompt_logprobs.append(TokenLogprob(token, lp, list(zip(ids, vals, strict=True)), rank))

    @property
    def cacheable(self) -> bool:
        """Whether the prefix cache may serve and store this request's states (not for a client's context)."""
        return not self.from_context

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(): this runs for every request on every step
            if seq.finish_reason is None:
                return False
        return True

    def release_samples(self) -> None:
        """Drop the samples once the request's final output is built. Each sample points back at its request,
        and that cycle waited for a full garbage collection, which a serving process (its young generation's
        threshold raised by ``freeze_startup_heap``) almost never runs: every request's tokens and logprobs
        piled up until then (a server grew by hundreds of MB over minutes)."""
        self.seqs = []

    def output(self) -> RequestOutput:
        """What the request produced since the previous call (see :class:`OutputKind`); the metrics are copied
        (the engine keeps updating them)."""
        kind = self.params.output_kind
        outputs = [s.take_output(kind) for s in self.seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.metrics.copy(), self.error, self.prompt_logprobs, self.num_cached_tokens,
                             self.final_state, self.error_param)  # fmt: skip


def _failure_function(pattern: str) -> array:
    """KMP failure function of ``pattern`` in O(len(pattern))."""
    fallback = array("q", bytes(8 * len(pattern)))
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fallback[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fallback[i] = k
    return fallback
