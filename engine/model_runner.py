"""Runs the model on the scheduler's batches: packs prompt chunks, gathers decode inputs, returns logits.

On CUDA the decode step replays CUDA graphs captured at start-up (one per batch-size bucket) unless
``enforce_eager`` is set; prefill always runs eagerly (its shapes vary every step).
"""

from __future__ import annotations

import torch

from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner
from rnnserve.engine.models.base import RecurrentLM
from rnnserve.engine.state_pool import StatePool


class ModelRunner:
    """Owns the model and its state pool; turns token/slot lists into device tensors and logits."""

    def __init__(self, model: RecurrentLM, pool: StatePool, enforce_eager: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.graphs: CUDAGraphDecodeRunner | None = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = CUDAGraphDecodeRunner(model, pool.tensors, pool.scratch_slot, pool.num_slots)
            self.graphs.capture()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def prefill(self, chunks: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Advance each slot by its chunk of prompt tokens; logits ``[len(chunks), V]`` of the last tokens."""
        offsets = [0]
        for chunk in chunks:
            offsets.append(offsets[-1] + len(chunk))
        input_ids = self._tensor([t for chunk in chunks for t in chunk])
        return self.model.prefill(input_ids, self._tensor(offsets), self._tensor(slots), self.pool.tensors)

    @torch.inference_mode()
    def decode(self, token_ids: list[int], slots: list[int]) -> torch.Tensor:
        """Advance each slot by one token; logits ``[B, V]`` (valid until the next decode call)."""
        if self.graphs is not None:
            return self.graphs(self._tensor(token_ids), self._tensor(slots))
        return self.model.decode(self._tensor(token_ids), self._tensor(slots), self.pool.tensors)
