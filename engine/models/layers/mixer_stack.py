"""The mixer-stack language model: embedding -> pre-norm residual mixer blocks -> final norm -> LM head.

Module names follow the Hugging Face Mamba layout (``backbone.embeddings``, ``backbone.layers.N.norm`` /
``.mixer``, ``backbone.norm_f``, ``lm_head``), so Mamba-style checkpoints load by name. Each residual add is
fused with the next norm (:func:`rnnserve.kernels.residual_rms_norm.residual_rms_norm`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from rnnserve.engine.models.base import DecodeBatch, PrefillBatch, RecurrentLM, StateTensors
from rnnserve.engine.models.layers.linear import linear
from rnnserve.engine.models.layers.norms import RMSNorm
from rnnserve.engine.models.layers.slots import slot_index
from rnnserve.kernels.residual_rms_norm import residual_rms_norm


class MixerStackConfig(Protocol):
    """What the stack reads of its model's config, a :class:`~rnnserve.engine.models.base.ModelConfig`
    (``MambaConfig``, ``Mamba2Config``) whose other fields its mixer reads."""

    vocab_size: int
    d_model: int
    n_layers: int
    norm_eps: float
    tie_embeddings: bool
    residual_in_fp32: bool


class MixerBlock(nn.Module):
    def __init__(self, config: MixerStackConfig, mixer: type[nn.Module]) -> None:
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = mixer(config)


class MixerBackbone(nn.Module):
    def __init__(self, config: MixerStackConfig, mixer: type[nn.Module]) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(MixerBlock(config, mixer) for _ in range(config.n_layers))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)


class MixerStackLM(RecurrentLM):
    """A stack of pre-norm residual mixer blocks with ``conv`` and ``ssm`` states ``[n_layers, ...]``.

    Shared by Mamba-1 and Mamba-2: subclasses set ``mixer`` and ``state_spec``. A mixer module is built from
    the config and runs one layer on this layer's pool views, reading the sequences' states from and writing
    them back to their slots in place: ``prefill(h, cu_seqlens, slot_ids, conv_pool, ssm_pool) -> out`` on
    packed normed rows (the Triton kernels address the slots themselves: no gathered copies of the states),
    and ``decode(h, slot_ids, slots, conv_pool, ssm_pool) -> out`` for one token per sequence (``slots``:
    :func:`~rnnserve.engine.models.layers.slots.slot_index`). The config is a :class:`MixerStackConfig`.
    """

    mixer: type[nn.Module]

    def __init__(self, config: MixerStackConfig) -> None:
        super().__init__(config)
        self.backbone = MixerBackbone(config, self.mixer)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @staticmethod
    def hf_weight_name(name: str) -> str:
        """Checkpoint key -> parameter name (older exports call the embedding ``backbone.embedding``)."""
        return name.replace("backbone.embedding.", "backbone.embeddings.")

    def _stream(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings as the residual stream: fp32 for ``residual_in_fp32`` models, as in the reference."""
        h = self.backbone.embeddings(input_ids)
        return h.float() if self.config.residual_in_fp32 else h

    def _add_norm(
        self, stream: torch.Tensor, delta: torch.Tensor | None, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``stream + delta`` and the norm feeding block ``layer`` (the final norm past the last block)."""
        layers = self.backbone.layers
        norm = layers[layer].norm if layer < len(layers) else self.backbone.norm_f
        return residual_rms_norm(stream, delta, norm.weight, norm.eps, layer < len(layers))

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        return linear(self.lm_head, normed, widened=True).float()

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        layers = self.backbone.layers
        normed, stream = self._add_norm(self._stream(batch.input_ids), None, 0)
        for i, block in enumerate(layers):
            out = block.mixer.prefill(normed, batch.cu_seqlens, batch.slot_ids, state["conv"][:, i], state["ssm"][:, i])
            if i + 1 < len(layers):
                normed, stream = self._add_norm(stream, out, i + 1)
        rows = batch.logit_rows  # only these rows need the final norm and logits
        normed, _ = self._add_norm(stream[rows], out[rows], len(layers))
        return self._logits(normed)

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        normed, stream = self._add_norm(self._stream(batch.input_ids), None, 0)
        return self._logits(self._decode_layers(normed, stream, batch.slot_ids, state))

    def _decode_layers(
        self, normed: torch.Tensor, stream: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        """Every block of a decode step from the first block's normed input; returns the final norm's output
        (a subclass may run the loop in one fused op)."""
        slots = slot_index(slot_ids)
        for i, block in enumerate(self.backbone.layers):
            out = block.mixer.decode(normed, slot_ids, slots, state["conv"][:, i], state["ssm"][:, i])
            normed, stream = self._add_norm(stream, out, i + 1)
        return normed
