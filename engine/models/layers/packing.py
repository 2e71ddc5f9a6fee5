"""Packed variable-length batches in other layouts."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
from torch.nn.utils.rnn import PackedSequence


def time_major_packed(x: torch.Tensor, lengths: Sequence[int]) -> PackedSequence:
    """Rows ``x [T, ...]`` of sequences packed one after another -> a ``torch.nn`` ``PackedSequence``.

    ``lengths`` are the sequences' lengths on the host, so nothing waits for the device. The result is
    time-major with sequences sorted by decreasing length, as ``torch.nn.RNN``/``LSTM``/``GRU`` consume it;
    its ``unsorted_indices`` map the final hidden states back to the batch order.
    """
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    starts = [0, *accumulate(lengths)][:-1]
    sorted_lengths = torch.tensor([lengths[b] for b in order], dtype=torch.long)
    sorted_starts = torch.tensor([starts[b] for b in order], dtype=torch.long)
    steps = torch.arange(int(sorted_lengths[0]) if order else 0)[:, None]
    running = sorted_lengths[None, :] > steps
    rows = (sorted_starts[None, :] + steps)[running]
    sorted_indices = torch.tensor(order, dtype=torch.long)
    return PackedSequence(
        x[rows.to(x.device)],
        running.sum(1),
        sorted_indices.to(x.device),
        torch.argsort(sorted_indices).to(x.device),
    )
