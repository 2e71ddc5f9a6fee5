"""Runs the model on the scheduler's batches: packs prompt chunks and decode inputs with their positions,
returns logits.

A decode step's input tokens never pass through the host: each slot's latest sampled token is kept on the
device (:meth:`ModelRunner.record_sampled`), and the decode step reads it there, so a step can be queued
before the host has seen the tokens of the step before it (async scheduling). A prompt fed through the decode
step (``EngineConfig.decoded_prompt_tokens``) has its token written to its slot's entry first.

On CUDA the decode step replays CUDA graphs captured at start-up (one per batch-size bucket) unless
``enforce_eager`` is set; prefill always runs eagerly (its shapes vary every step).
"""

from __future__ import annotations

import torch

from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch, RecurrentLM, long_tensor
from rnnserve.engine.scheduler import PrefillChunk
from rnnserve.engine.sequence import Sequence
from rnnserve.engine.state_pool import StatePool


class ModelRunner:
    """Owns the model and its state pool; turns scheduled chunks and samples into batches and logits."""

    def __init__(self, model: RecurrentLM, pool: StatePool, enforce_eager: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.last_tokens = torch.zeros(pool.num_slots + 1, dtype=torch.long, device=self.device)  # per slot
        # The samples of the latest decode without prompt tokens, and its slot and position tensors: a decode
        # of the same samples (a steady batch) reuses them, each position one further.
        self._decoding: list[Sequence] | None = None
        self._decode_slots = self._decode_positions = torch.empty(0, dtype=torch.long)
        # A steady batch's bookkeeping, kept for the batch until something else comes: the decodes that fed each
        # of ``_unfed``'s samples one more token than its ``num_fed`` says (settle_fed), and its latest sampled
        # tokens (rows of ``_sampled_slots``), which its next decode reads as they are, not yet in ``last_tokens``.
        self._unfed: list[Sequence] = []
        self._num_unfed = 0
        self._sampled: torch.Tensor | None = None
        self._sampled_slots = self._decode_slots
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
    def decode(self, seqs: list[Sequence], prompts: list[PrefillChunk] | None = None) -> torch.Tensor:
        """Advance each sample's slot by its latest sampled token (read on the device), and each one-token
        prompt chunk's first slot by that prompt token; logits ``[len(seqs) + len(prompts), V]`` in that order
        (valid until the next decode call). Counts the samples' tokens as fed (``Sequence.num_fed``; a steady
        batch's once for the batch, see :meth:`settle_fed`)."""
        decoding = self._decoding
        steady = not prompts and seqs == decoding
        if steady:  # each sample's slot as before, one token further, its input the token sampled last
            slots, positions = self._decode_slots, self._decode_positions.add_(1)
            tokens = self._sampled if self._sampled is not None else self.last_tokens[slots]
        else:
            self.settle_fed()
            self._keep_sampled()
            prompts = prompts or []
            slot_ids: list[int] = [s.slot for s in seqs] + [c.group.seqs[0].slot for c in prompts]  # type: ignore[misc]
            slots = long_tensor(slot_ids, self.device)
            # the position of the token each sample feeds: after its prompt and the output tokens fed before it
            position_ids = [len(s.group.prompt_token_ids) + s.num_fed for s in seqs] + [c.start for c in prompts]
            positions = long_tensor(position_ids, self.device)
            if prompts:  # the prompt token takes the place of a sampled one
                prompt_tokens = [c.group.prompt_token_ids[c.start] for c in prompts]
                self.last_tokens[slots[len(seqs) :]] = long_tensor(prompt_tokens, self.device)
            tokens = self.last_tokens[slots]
        self._decoding = None  # until the model call returned (a call that raised fed nothing)
        batch = DecodeBatch(tokens, slots, positions)
        logits = self.graphs(batch) if self.graphs is not None else self.model.decode(batch, self.pool.tensors)
        if steady:
            if not self._num_unfed:
                self._unfed = decoding  # type: ignore[assignment]
            self._num_unfed += 1
            self._decoding = decoding
        else:
            for seq in seqs:
                seq.num_fed += 1
            if not prompts:
                self._decoding, self._decode_slots, self._decode_positions = list(seqs), slots, positions
        return logits

    def settle_fed(self) -> None:
        """Count the tokens a steady batch's decodes fed in its samples' ``num_fed`` (each decode of the same samples
        counts once for the batch): run before reading ``num_fed``."""
        if self._num_unfed:
            count, self._num_unfed = self._num_unfed, 0
            for seq in self._unfed:
                seq.num_fed += count
            self._unfed = []

    def _keep_sampled(self) -> None:
        """Write the steady batch's latest sampled tokens into ``last_tokens`` (before another batch's decode reads
        it or other tokens are written there)."""
        if self._sampled is not None:
            self.last_tokens[self._sampled_slots] = self._sampled
            self._sampled = None

    def slot_tensor(self, seqs: list[Sequence]) -> torch.Tensor:
        """The samples' slots as a tensor on the device (the latest decode's when it decoded just them)."""
        if seqs == self._decoding:
            return self._decode_slots
        return long_tensor([s.slot for s in seqs], self.device)  # type: ignore[misc]

    @torch.inference_mode()
    def record_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep each slot's newly sampled token on the device for its next decode step. The tokens of the latest
        decode's samples (``slots`` its slot tensor, from :meth:`slot_tensor`) are kept as they are: a decode of
        the same samples reads them so, and any other decode or write puts them in ``last_tokens`` first."""
        if slots is self._decode_slots and self._decoding is not None:  # replaces the batch's previous tokens
            self._sampled, self._sampled_slots = tokens, slots
            return
        self._keep_sampled()
        self.last_tokens[slots] = tokens
