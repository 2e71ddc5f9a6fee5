"""Multi-query associative recall (MQAR; Arora et al. 2023, used by the Based paper): data and a served check.

A sequence of ``4 * num_pairs`` tokens is ``num_pairs`` key-value pairs, then every key again in a random order,
each followed by its value::

    k1 v1 k2 v2 ... kn vn | q1 a1 q2 a2 ... qn an          (q = a key, a = its value)

Keys are drawn without repetition from ``[1, vocab_size / 2)``, values from ``[vocab_size / 2, vocab_size)``
(token 0 is unused). ``targets[t]`` is the token a model must predict after reading ``input_ids[:t + 1]``: the
value after each query key, ``-100`` (no loss) everywhere else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from rnnserve.engine.llm import LLM
from rnnserve.engine.loader import save_checkpoint
from rnnserve.engine.models.base import PrefillBatch
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.state_pool import StatePool


def make_mqar(num_examples: int, num_pairs: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [N, 4 * num_pairs], targets [N, 4 * num_pairs])``, int64, deterministic for ``seed``."""
    half = vocab_size // 2
    if num_pairs > half - 1:
        raise ValueError(f"{num_pairs} distinct keys need vocab_size >= {2 * (num_pairs + 1)}")
    g = torch.Generator().manual_seed(seed)
    keys = torch.stack([torch.randperm(half - 1, generator=g)[:num_pairs] + 1 for _ in range(num_examples)])
    values = torch.randint(half, vocab_size, (num_examples, num_pairs), generator=g)
    order = torch.stack([torch.randperm(num_pairs, generator=g) for _ in range(num_examples)])
    query_keys, answers = keys.gather(1, order), values.gather(1, order)
    context = torch.stack([keys, values], dim=2).flatten(1)
    queries = torch.stack([query_keys, answers], dim=2).flatten(1)
    input_ids = torch.cat([context, queries], dim=1)
    targets = torch.full_like(input_ids, -100)
    targets[:, 2 * num_pairs :: 2] = answers
    return input_ids, targets


def served_recall_accuracy(llm, input_ids: torch.Tensor, targets: torch.Tensor) -> float:
    """Prompt ``llm`` (an :class:`rnnserve.LLM`) with every prefix that ends at a query key and compare its greedy
    next token with the value: the fraction recalled."""
    prompts: list[list[int]] = []
    expected: list[int] = []
    for row, target_row in zip(input_ids.tolist(), targets.tolist(), strict=True):
        for t, target in enumerate(target_row):
            if target != -100:
                prompts.append(row[: t + 1])
                expected.append(target)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    hits = sum(out.outputs[0].token_ids[0] == value for out, value in zip(outputs, expected, strict=True))
    return hits / len(expected)


@torch.inference_mode()
def served_logit_gap(model, dense_logits: Callable, ids: torch.Tensor) -> float:
    """Largest |difference| between a training forward ``dense_logits(model, ids) -> [N, T, V]`` and rnnserve's
    prefill of the same sequences (every position's logits)."""
    batch = PrefillBatch.build(list(ids), list(range(len(ids))), all_logits=[True] * len(ids))
    served = model.prefill(batch, StatePool(model.state_spec(), len(ids)).tensors)
    return float((served - dense_logits(model, ids).reshape(served.shape)).abs().max())


def train_and_serve(
    model, dense_logits: Callable, *, pairs: int, vocab_size: int, batch: int, lr: float, minutes: float,
    seed: int, out: Path, log_every: int = 50,
) -> float:
    """Train ``model`` on fresh MQAR batches for ``minutes`` (AdamW, clipped gradients, loss on the answers
    only), save it to ``out`` as a native checkpoint, serve it with rnnserve and return its recall accuracy
    on 256 held-out sequences; prints progress and the training-vs-served logit gap."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < 60 * minutes:
        ids, targets = make_mqar(batch, pairs, vocab_size, seed=seed * 1_000_003 + step)
        logits = dense_logits(model, ids)
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0:
            hits = (logits.argmax(-1) == targets)[targets != -100].float().mean()
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}  {elapsed:5.0f} s  loss {loss.item():.3f}  train acc {hits:.3f}", flush=True)
        step += 1
    model.eval().requires_grad_(False)
    test_ids, test_targets = make_mqar(256, pairs, vocab_size, seed=10**6 + seed)
    gap = served_logit_gap(model, dense_logits, test_ids[:4])
    print(f"dense forward vs served prefill, max |logit difference|: {gap:.2e}")
    save_checkpoint(model, out)
    accuracy = served_recall_accuracy(LLM(str(out), device="cpu"), test_ids, test_targets)
    print(f"{step} steps in {minutes:g} min; served MQAR recall accuracy ({pairs} pairs, 256 sequences): "
          f"{accuracy:.3f}")
    return accuracy
