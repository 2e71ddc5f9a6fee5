"""Batched sampling on the logits' device: penalties, temperature, top-k/top-p/min-p, seeded draws.

Everything is computed for the whole batch at once; the only host transfer is the sampled token ids
(and the requested log-probabilities). A seeded row draws its uniform number from its own generator, so
its token depends only on its own logits, never on the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rnnserve.engine.outputs import TokenLogprob
from rnnserve.engine.sequence import Sequence
from rnnserve.kernels.row_argmax import row_argmax


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


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


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt + output tokens), presence and frequency (output tokens) penalties."""
    rows = [i for i, s in enumerate(seqs) if s.token_counts is not None]
    if not rows:
        return logits
    index = torch.tensor(rows).to(logits.device, non_blocking=True)
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


def mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None) -> torch.Tensor:
    """Forbid EOS and stop tokens for samples that have not reached ``min_tokens`` yet."""
    vocab = logits.shape[1]
    masked = False
    for row, seq in enumerate(seqs):
        if len(seq.output_token_ids) >= seq.params.min_tokens:
            continue
        banned = [t for t in seq.params.stop_token_ids if t < vocab]
        if eos_token_id is not None and not seq.params.ignore_eos and eos_token_id < vocab:
            banned.append(eos_token_id)
        if banned:
            if not masked:
                logits, masked = logits.clone(), True
            logits[row, banned] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (each row with its own values; disabled rows untouched)."""
    device, dtype = logits.device, logits.dtype
    temperature = _column(seqs, "temperature", device, dtype).clamp_min(1e-5)[:, None]
    logits = logits / temperature
    top_k = _top_k_column(seqs, logits.shape[1], device, dtype)
    top_p = _column(seqs, "top_p", device, dtype)
    min_p = _column(seqs, "min_p", device, dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=device)[None, :]
    remove = ranks >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token once the mass before it already reaches top_p; the first token always stays.
    remove |= (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
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


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None) -> SampleResult:
    """Sample one token per row of ``logits [N, V]`` (fp32, or fp64 for fp64 models) for the matching ``seqs``."""
    logits = apply_penalties(logits.to(torch.promote_types(logits.dtype, torch.float32)), seqs)
    logits = mask_stop_tokens(logits, seqs, eos_token_id)
    tokens = row_argmax(logits)
    if not all(s.params.greedy for s in seqs):
        probs = torch.softmax(filter_logits(logits, seqs), dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = draw_uniform(seqs, logits.device)[:, None] * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, u).squeeze(1).clamp_max(logits.shape[1] - 1)
        greedy = _column(seqs, "greedy", logits.device, torch.float32) > 0
        tokens = torch.where(greedy, tokens, drawn)
    token_list = tokens.tolist()
    return SampleResult(token_list, _logprobs(logits, seqs, tokens, token_list))


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor, token_list: list[int]
) -> list[TokenLogprob | None]:
    wanted = [s.params.logprobs for s in seqs]
    if all(w is None for w in wanted):
        return [None] * len(seqs)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    top_n = max(w or 0 for w in wanted)
    top_vals, top_ids = (logp.topk(top_n, dim=-1) if top_n else (logp[:, :0], tokens[:, None][:, :0]))
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            out.append(None)
            continue
        top = list(zip(top_ids[row][:n], top_vals[row][:n], strict=True))
        out.append(TokenLogprob(token_list[row], chosen[row], top))
    return out
