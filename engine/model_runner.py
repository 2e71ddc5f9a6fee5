"""Runs the model on the scheduler's batches: packs prompt chunks and decode inputs with their positions,
returns logits.

On CUDA the decode step replays CUDA graphs captured at start-up (one per batch-size bucket) unless
``enforce_eager`` is set; prefill always runs eagerly (its shapes vary every step).
"""

from __future__ import annotations

import torch

from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch, RecurrentLM
from rnnserve.engine.scheduler import PrefillChunk
from rnnserve.engine.sequence import Sequence
from rnnserve.engine.state_pool import StatePool


class ModelRunner:
    """Owns the model and its state pool; turns scheduled chunks and samples into batches and logits."""

    def __init__(self, model: RecurrentLM, pool: StatePool, enforce_eager: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.graphs: CUDAGraphDecodeRunner | None = None
        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = CUDAGraphDecodeRunner(model, pool.tensors, pool.scratch_slot, pool.num_slots)
            self.graphs.capture()

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> list[torch.Tensor]:
        """Advance each chunk's first slot by its prompt tokens. Returns each chunk's logits: ``[1, V]`` for its
        last token, or ``[end - start, V]`` for every token of a chunk that wants prompt logprobs."""
        flags = [c.all_logits for c in chunks]
        batch = PrefillBatch.build(
            [c.token_ids for c in chunks],
            [c.group.seqs[0].slot for c in chunks],  # type: ignore[misc]
            [c.start for c in chunks],
            self.device,
            all_logits=flags,
        )
        logits = self.model.prefill(batch, self.pool.tensors)
        return list(logits.split([c.end - c.start if every else 1 for c, every in zip(chunks, flags, strict=True)]))

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Advance each sample's slot by its last token; logits ``[B, V]`` (valid until the next decode call)."""
        batch = DecodeBatch.build(
            [s.last_token_id for s in seqs],
            [s.slot for s in seqs],  # type: ignore[misc]
            [s.last_position for s in seqs],
            self.device,
        )
        if self.graphs is not None:
            return self.graphs(batch)
        return self.model.decode(batch, self.pool.tensors)
