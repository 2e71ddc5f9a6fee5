"""Multi-query associative recall (MQAR; Arora et al. 2023, used by the Based paper): data and a served check.

A sequence of ``4 * num_pairs`` tokens is ``num_pairs`` key-value pairs, then every key again in a random order,
each followed by its value::

    k1 v1 k2 v2 ... kn vn | q1 a1 q2 a2 ... qn an          (q = a key, a = its value)

Keys are drawn without repetition from ``[1, vocab_size / 2)``, values from ``[vocab_size / 2, vocab_size)``
(token 0 is unused). ``targets[t]`` is the token a model must predict after reading ``input_ids[:t + 1]``: the
value after each query key, ``-100`` (no loss) everywhere else.
"""

from __future__ import annotations

import torch

from rnnserve.engine.sampling_params import SamplingParams


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
