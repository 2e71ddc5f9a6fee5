"""The MQAR module (``scripts/mqar.py``) and the Based MQAR training forward (``scripts/train_mqar_based.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rnnserve.engine.models.based import BasedLM
from scripts.mqar import make_mqar, served_logit_gap, served_recall_accuracy
from scripts.train_mqar_based import dense_logits, mqar_config


def test_mqar_layout() -> None:
    ids, targets = make_mqar(5, 8, 64, seed=3)
    assert ids.shape == targets.shape == (5, 32) and ids.dtype == targets.dtype == torch.long
    assert torch.equal(make_mqar(5, 8, 64, seed=3)[0], ids) and not torch.equal(make_mqar(5, 8, 64, seed=4)[0], ids)
    for row, target in zip(ids.tolist(), targets.tolist(), strict=True):
        keys, values = row[0:16:2], row[1:16:2]
        assert len(set(keys)) == 8 and all(1 <= k < 32 for k in keys) and all(32 <= v < 64 for v in values)
        pairs = dict(zip(keys, values, strict=True))
        assert sorted(row[16::2]) == sorted(keys)  # every key is queried once
        for t in range(32):
            if t >= 16 and t % 2 == 0:
                assert target[t] == pairs[row[t]] == row[t + 1]
            else:
                assert target[t] == -100


class _Oracle:
    """An ``LLM`` stand-in answering from the prompt: the value after the last token's first occurrence."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong, self.prompts = wrong, []

    def generate(self, prompts, params):
        self.prompts += prompts
        answers = [p[p.index(p[-1]) + 1] + (1 if self.wrong else 0) for p in prompts]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[a])]) for a in answers]


def test_served_recall_accuracy_prompts_every_query() -> None:
    ids, targets = make_mqar(3, 8, 64, seed=0)
    oracle = _Oracle()
    assert served_recall_accuracy(oracle, ids, targets) == 1.0
    assert [len(p) for p in oracle.prompts] == [17, 19, 21, 23, 25, 27, 29, 31] * 3
    assert served_recall_accuracy(_Oracle(wrong=True), ids, targets) == 0.0


def test_training_forward_equals_served_prefill() -> None:
    model = BasedLM(mqar_config())
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval().requires_grad_(False)
    ids, _ = make_mqar(3, 8, 64, seed=1)
    assert served_logit_gap(model, dense_logits, ids) < 1e-4
