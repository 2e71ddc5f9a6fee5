"""A request's recurrent state taken out of the engine: what a session stores and what a request resumes from.

A :class:`StateSnapshot` holds one slot's state tensors (on the CPU, contiguous, so ``safetensors`` can save
them) together with the tokens that state has consumed and the history tokens it has not consumed yet.
``LLMEngine.add_request(..., context=snapshot)`` continues from it; ``return_state=True`` produces one in
``RequestOutput.final_state``. :func:`model_fingerprint` names the model a state belongs to.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from rnnserve.engine.models.base import RecurrentLM, StateSpec
from rnnserve.engine.sampling_params import InvalidParameterError

DIGEST_CHUNK_BYTES = 1 << 28  # a device tensor is copied to the host this much at a time to be hashed


@dataclass
class StateSnapshot:
    """One sequence's state and history.

    ``tensors`` maps each state name to one slot's state (the :class:`StateSpec` shape and dtype, on the CPU);
    ``token_ids`` are the tokens the state has consumed, in order (positions ``0 .. len - 1``);
    ``pending_token_ids`` are history tokens not consumed yet (e.g. the last sampled token of a response),
    which a continuation feeds first.
    """

    tensors: dict[str, torch.Tensor]
    token_ids: list[int]
    pending_token_ids: list[int]

    @property
    def history_token_ids(self) -> list[int]:
        """The whole history: consumed tokens, then pending ones."""
        return self.token_ids + self.pending_token_ids


def check_snapshot_tensors(tensors: dict[str, torch.Tensor], specs: list[StateSpec]) -> None:
    """Raise :class:`InvalidParameterError` unless ``tensors`` has exactly the specs' names, shapes and dtypes."""
    expected = {spec.name: spec for spec in specs}
    if not isinstance(tensors, dict) or set(tensors) != set(expected):
        names = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise InvalidParameterError(
            "context", f"state tensors {names} do not match this model's state {sorted(expected)}"
        )
    for name, spec in expected.items():
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor):
            raise InvalidParameterError("context", f"state {name!r} is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != spec.shape:
            raise InvalidParameterError(
                "context", f"state {name!r} has shape {list(tensor.shape)}, this model's is {list(spec.shape)}"
            )
        if tensor.dtype != spec.dtype:
            raise InvalidParameterError(
                "context", f"state {name!r} has dtype {tensor.dtype}, this model's is {spec.dtype}"
            )


def _content_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: exact, and the same on every device and thread count (a float sum's rounding
    depends on its order). A device tensor is hashed in host-sized pieces."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256()
    for piece in raw.split(DIGEST_CHUNK_BYTES):
        digest.update(piece.cpu().numpy())
    return digest.hexdigest()


def model_fingerprint(model: RecurrentLM, specs: list[StateSpec]) -> str:
    """A sha256 hex digest of the architecture, its config, every parameter's and buffer's name, shape, dtype
    and content hash, and the state specs (initial values included): states are interchangeable exactly
    between engines with the same fingerprint. Hashing reads every weight once (about 0.6 s per GB on a CPU
    with SHA extensions)."""
    config = getattr(model, "config", None)
    described: dict[str, object] = {
        "architecture": model.architecture,
        "config": config.to_dict() if hasattr(config, "to_dict") else repr(config),
        "tensors": [
            [name, list(t.shape), str(t.dtype), _content_digest(t)]
            for kind in (model.named_parameters(), model.named_buffers())
            for name, t in kind
        ],
        "state": [
            [
                spec.name,
                list(spec.shape),
                str(spec.dtype),
                _content_digest(spec.initial) if isinstance(spec.initial, torch.Tensor) else spec.initial,
            ]
            for spec in specs
        ],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()
