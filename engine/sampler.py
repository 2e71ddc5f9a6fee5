"""Batched sampling on the logits' device: penalties, temperature, top-k/top-p/min-p, seeded draws.

Everything is computed for the whole batch at once, and nothing waits for the device: :func:`sample` returns
the tokens as a device tensor (which the next decode step reads directly) and starts their copy to the host;
the host waits only when it reads them (:meth:`SampledTokens.result`), which lets an engine queue the next step
first. A seeded row draws its uniform number from its own generator, so its token depends only on its own
logits, never on the other rows.
"""

from __future__ import annotations

import time
from operator import attrgetter

import torch

from rnnserve.engine.models.base import long_tensor
from rnnserve.engine.outputs import TokenLogprob
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.sequence import Sequence
from rnnserve.engine.structured_output import allowed_tokens
from rnnserve.kernels.row_argmax import row_argmax


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory (a CPU tensor is returned as it is)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class SampledTokens:
    """One batch's sampled tokens (``tokens [N]`` on the device) and the log-probabilities the rows asked for.

    The copies to the host start when it is built; :meth:`result` waits for them (the host's one wait for the
    device per step) and turns them into Python values, once. ``device_wait``: the seconds that wait took (a CUDA
    event's ``synchronize``, which spins: the process shows busy meanwhile); 0.0 on the CPU, where the tokens
    are ready when sampled.
    """

    def __init__(
        self, tokens: torch.Tensor, wanted: list[int | None], logprob_parts: tuple[torch.Tensor, ...] = ()
    ) -> None:
        self.tokens = tokens
        self._wanted = wanted
        self._host = [_copy_to_host(t) for t in (tokens, *logprob_parts)]
        self._ready: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._result: tuple[list[int], list[TokenLogprob | None]] | None = None
        self.device_wait = 0.0

    @classmethod
    def from_host(
        cls, token_ids: list[int], logprobs: list[TokenLogprob | None], device: torch.device
    ) -> SampledTokens:
        """Tokens already known on the host (the row-by-row path after a batch failed to sample)."""
        sampled = cls(long_tensor(token_ids, device), [None] * len(token_ids))
        sampled._result = (list(token_ids), list(logprobs))
        return sampled

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """``(token ids, logprobs)``, one entry per row; waits for the device the first time."""
        if self._result is None:
            if self._ready is not None:
                start = time.perf_counter()
                self._ready.synchronize()
                self.device_wait = time.perf_counter() - start
            self._result = self._to_python()
        return self._result

    @property
    def token_ids(self) -> list[int]:
        return self.result()[0]

    @property
    def logprobs(self) -> list[TokenLogprob | None]:
        return self.result()[1]

    def _to_python(self) -> tuple[list[int], list[TokenLogprob | None]]:
        token_list = self._host[0].tolist()
        if len(self._host) == 1:
            return token_list, [None] * len(token_list)
        chosen, top_vals, top_ids = (t.tolist() for t in self._host[1:])
        out: list[TokenLogprob | None] = []
        for row, n in enumerate(self._wanted):
            if n is None:
                out.append(None)
                continue
            top = list(zip(top_ids[row][:n], top_vals[row][:n], strict=True))
            out.append(TokenLogprob(token_list[row], chosen[row], top))
        return token_list, out


def _to_device(values: list[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Host values as a device tensor, copied without waiting for the device."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _column(seqs: list[Sequence], attr: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A per-row parameter as a device tensor."""
    return _to_device([float(getattr(s.params, attr)) for s in seqs], device, dtype)


def _top_k_column(seqs: list[Sequence], vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Each row's ``top_k`` clamped to the vocabulary (disabled = the whole vocabulary), so no value overflows."""
    return _to_device([float(k if 0 < k < vocab else vocab) for k in (s.params.top_k for s in seqs)], device, dtype)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Add each biased row's ``logit_bias`` row (``-inf`` outside its ``allowed_token_ids``)."""
    rows = [i for i, s in enumerate(seqs) if s.logit_bias is not None]
    if not rows:
        return logits
    bias = torch.stack([seqs[i].logit_bias for i in rows])  # type: ignore[misc]
    if len(rows) == len(seqs):
        return logits + bias
    index = long_tensor(rows, logits.device)
    return logits.index_put((index,), logits[index] + bias)


def grammar_rows(seqs: list[Sequence]) -> list[int]:
    """The rows whose samples follow a grammar that has not ended (one that ended is finishing: its token is
    dropped, with async scheduling, and needs no mask)."""
    return [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.end is None]


def mask_by_grammar(
    logits: torch.Tensor, unbiased: torch.Tensor, seqs: list[Sequence], rows: list[int]
) -> torch.Tensor:
    """Forbid, in each of ``rows``, the tokens its grammar does not allow next (masks computed on the host). A
    row whose ``logit_bias`` / ``allowed_token_ids`` leave no token the grammar allows takes the grammar's tokens
    from its ``unbiased`` logits: the constraint wins (a row of ``-inf`` sampled a token the grammar refused, and
    the request failed). Admission refuses the requests where that happens at the first token."""
    if not rows:
        return logits
    vocab = logits.shape[1]
    mask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for j, row in enumerate(rows):
        seqs[row].grammar.fill_mask(mask, j)  # type: ignore[union-attr]
    if logits.device.type == "cuda":
        mask = mask.pin_memory().to(logits.device, non_blocking=True)
    index = long_tensor(rows, logits.device)
    forbidden = ~allowed_tokens(mask, vocab)
    masked = logits[index].masked_fill(forbidden, float("-inf"))
    if unbiased is not logits:
        fallback = unbiased[index].masked_fill(forbidden, float("-inf"))
        masked = torch.where(torch.isneginf(masked).all(dim=-1, keepdim=True), fallback, masked)
    return logits.index_put((index,), masked)


def advance_grammars(tokens: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Feed each of ``rows`` its sampled token, now: the next step's mask depends on it (on a GPU this waits for
    the tokens, in steps that have such rows only)."""
    if not rows:
        return
    for row, token in zip(rows, tokens[long_tensor(rows, tokens.device)].tolist(), strict=True):
        seq = seqs[row]
        seq.grammar.advance(token, seq.num_sampled + 1)  # type: ignore[union-attr]


def penalty_rows(seqs: list[Sequence]) -> list[int]:
    """The rows whose samples use penalties (and so have counters)."""
    return [i for i, s in enumerate(seqs) if s.token_counts is not None]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """Repetition (prompt + output tokens), presence and frequency (output tokens) penalties of ``rows``."""
    if not rows:
        return logits
    index = long_tensor(rows, logits.device)
    sub = [seqs[i] for i in rows]
    counts = torch.stack([s.token_counts for s in sub])  # type: ignore[misc]
    seen = torch.stack([s.seen_mask for s in sub])  # type: ignore[misc]
    x = logits[index]
    rep = _column(sub, "repetition_penalty", logits.device, x.dtype)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - _column(sub, "frequency_penalty", logits.device, x.dtype)[:, None] * counts
    x = x - _column(sub, "presence_penalty", logits.device, x.dtype)[:, None] * (counts > 0).to(x.dtype)
    logits = logits.clone()
    logits[index] = x
    return logits


def mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Forbid the tokens that end a sample (EOS and stop tokens) for samples that have not reached ``min_tokens``
    yet (counting tokens sampled but not yet read on the host). Where that would forbid every token a grammar or
    ``allowed_token_ids`` still allows (a structured output that must end, or whose next character is a stop
    token), the constraint wins and the row keeps its logits: a row of ``-inf`` took token 0 and failed the
    request."""
    vocab = logits.shape[1]
    rows: list[int] = []
    columns: list[int] = []
    for row, seq in enumerate(seqs):
        min_tokens = seq.params.min_tokens
        if not min_tokens or seq.num_sampled >= min_tokens:
            continue
        banned = [t for t in seq.end_ids if t < vocab]
        rows += [row] * len(banned)
        columns += banned
    if not rows:
        return logits
    index = (long_tensor(rows, logits.device), long_tensor(columns, logits.device))
    masked = logits.index_put(index, logits.new_full((), float("-inf")))
    return torch.where(torch.isneginf(masked).all(dim=-1, keepdim=True), logits, masked)


def filters_logits(params: SamplingParams, vocab: int) -> bool:
    """Whether ``params`` restrict the support (top-k below the vocabulary, top-p below 1 or min-p above 0)."""
    return 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0


def filter_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (each row with its own values; rows without them untouched).
    A batch where no row restricts the support (OpenAI's defaults) skips the sort of the whole vocabulary."""
    device, dtype = logits.device, logits.dtype
    # greedy rows (below GREEDY_TEMPERATURE) are sampled by argmax: the clamp only keeps their division finite
    temperature = _column(seqs, "temperature", device, dtype).clamp_min(SamplingParams.GREEDY_TEMPERATURE)[:, None]
    logits = logits / temperature
    if not any(filters_logits(s.params, logits.shape[1]) for s in seqs):
        return logits
    top_k = _top_k_column(seqs, logits.shape[1], device, dtype)
    top_p = _column(seqs, "top_p", device, dtype)
    min_p = _column(seqs, "min_p", device, dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=device)[None, :]
    remove = ranks >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token once the mass before it already reaches top_p (< 1: at 1 the rounded mass can reach it before the
    # tail); the first token always stays.
    remove |= ((sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw_uniform(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """One uniform number per row; seeded rows use their own generator."""
    u = torch.rand(len(seqs), device=device)
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            u[row] = torch.rand(1, generator=seq.generator, device=device)[0]
    return u


def count_tokens(tokens: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Add the sampled token of each of ``rows`` (those with penalties) to its sample's penalty counters, on the
    device (so the next step's penalties see it before the host has read it)."""
    for row in rows:
        seq, token = seqs[row], tokens[row : row + 1]
        assert seq.token_counts is not None and seq.seen_mask is not None
        seq.token_counts.index_add_(0, token, torch.ones(1, dtype=seq.token_counts.dtype, device=token.device))
        seq.seen_mask.index_fill_(0, token, True)


_argmax_only = attrgetter("argmax_only")


def all_argmax_only(seqs: list[Sequence]) -> bool:
    """Whether every sample of ``seqs`` samples by a plain argmax (``Sequence.argmax_only``)."""
    return all(map(_argmax_only, seqs))


def sample(logits: torch.Tensor, seqs: list[Sequence], argmax_only: bool | None = None) -> SampledTokens:
    """Sample one token per row of ``logits [N, V]`` (fp32, or fp64 for fp64 models) for the matching ``seqs``,
    without waiting for the device. ``argmax_only``: :func:`all_argmax_only` of ``seqs`` where the caller knows it
    (``None``: checked here)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if argmax_only is None:
        argmax_only = all_argmax_only(seqs)
    if argmax_only:  # the usual greedy batch: one pass over the samples, one kernel
        return SampledTokens(row_argmax(logits), [None] * len(seqs))
    unbiased = logits
    logits = apply_logit_bias(logits, seqs)
    constrained = grammar_rows(seqs)
    logits = mask_by_grammar(logits, unbiased, seqs, constrained)
    rows = penalty_rows(seqs)
    logits = apply_penalties(logits, seqs, rows)
    logits = mask_stop_tokens(logits, seqs)
    tokens = row_argmax(logits)
    if not all(s.params.greedy for s in seqs):
        probs = torch.softmax(filter_logits(logits, seqs), dim=-1)
        cdf = probs.cumsum(dim=-1)
        # A draw of exactly 0 (one in 2^24) would find the first token, even a masked one: it becomes the
        # smallest positive float, which lands on the first token with mass.
        u = draw_uniform(seqs, logits.device).clamp_min_(torch.finfo(torch.float32).tiny)[:, None] * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, u).squeeze(1).clamp_max(logits.shape[1] - 1)
        # A row without a distribution (NaN in its softmax: a NaN or +inf logit, or one that the temperature's
        # division overflowed) takes its greedy token, the first +inf or NaN as torch.argmax ranks them; the draw
        # found the vocabulary's last token there, whatever the logits.
        greedy = (_column(seqs, "greedy", logits.device, torch.float32) > 0) | cdf[:, -1].isnan()
        tokens = torch.where(greedy, tokens, drawn)
    count_tokens(tokens, seqs, rows)
    wanted = [s.params.logprobs for s in seqs]
    if all(w is None for w in wanted):
        sampled = SampledTokens(tokens, wanted)
    else:
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        top_vals, top_ids = logp.topk(min(max(w or 0 for w in wanted), logp.shape[1]), dim=-1)  # a vocabulary < N
        sampled = SampledTokens(tokens, wanted, (chosen, top_vals, top_ids))
    advance_grammars(tokens, seqs, constrained)  # last: a batch that raises before it is sampled again row by row
    return sampled
