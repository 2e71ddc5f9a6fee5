"""Weight-only int8 quantization of a loaded model's linear layers (``--quantize int8``).

Every ``nn.Linear`` child of the model becomes an :class:`Int8Linear`: an int8 weight ``[N, K]`` with one
symmetric fp32 scale per output row (``scale = max|w_row| / 127``, ``q = round(w / scale)``), the bias kept in
the model's dtype. Activations stay in the model's dtype, products accumulate in fp32 and outputs come back in
the model's dtype (:func:`rnnserve.kernels.int8_linear.int8_linear`); recurrent states, embeddings, norms,
convolutions and gates are untouched. A head tied to the embedding gets its own int8 copy while the embedding
keeps its dtype (a lookup reads one row, the head streams all of them every step).

A module that reads a child's ``.weight`` directly instead of calling it through
:func:`rnnserve.engine.models.layers.linear` names that child in a class attribute ``unquantized_linears``;
those layers keep their dtype. A model without any linear layer to quantize (LSRL programs, whose layers are
sparse fp64 matrices) is refused with a ``ValueError`` at start-up rather than served unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from rnnserve.kernels.int8_linear import dequantize, int8_linear

INT8_MAX = 127


class Int8Linear(nn.Module):
    """A linear layer with an int8 ``weight [N, K]`` and per-output-row fp32 ``scale [N]`` (buffers) and the
    original ``bias`` (a parameter in the model's dtype, or None)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"Int8Linear needs an int8 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Int8Linear:
        """Quantize ``layer``'s weight per output row; raises ``ValueError`` on non-finite weights."""
        weight, scale = quantize_weight(layer.weight)
        return cls(weight, scale, layer.bias)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight this layer multiplies by: ``weight * scale[:, None]``."""
        return dequantize(self.weight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(int8 [N, K], fp32 scale [N])`` with ``weight ~ q * scale[:, None]``.

    Symmetric per row: ``scale = max|w_row| / 127`` and ``q = round(w / scale)``, so each row's largest
    magnitude maps to +-127 exactly and every value is off by at most ``scale / 2``. An all-zero row gets
    scale 0 and zeros.
    """
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("cannot quantize a weight with non-finite values")
    scale = absmax / INT8_MAX
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def quantizable_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, attribute, layer)`` for every ``nn.Linear`` child that :func:`quantize_model` replaces: exactly
    ``nn.Linear`` (subclasses may multiply differently), not named in the parent's ``unquantized_linears``."""
    found = []
    for parent in model.modules():
        keep = getattr(parent, "unquantized_linears", ())
        for name, child in parent.named_children():
            if type(child) is nn.Linear and name not in keep:
                found.append((parent, name, child))
    return found


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the model's linear layers in place by their ``method`` (``"int8"``) versions; returns how many.

    Raises ``ValueError`` for an unknown method, for a model with no linear layer to quantize (naming the
    model) and for a layer with non-finite weights (naming the layer).
    """
    if method != "int8":
        raise ValueError(f"unknown quantization {method!r} (choices: int8)")
    targets = quantizable_linears(model)
    model_name = getattr(model, "architecture", type(model).__name__)
    if not targets:
        raise ValueError(f"--quantize int8: the {model_name} model has no linear layers to quantize")
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    replaced: dict[int, Int8Linear] = {}  # a module shared by several parents stays shared
    for parent, attribute, layer in targets:
        if id(layer) not in replaced:
            try:
                replaced[id(layer)] = Int8Linear.from_linear(layer)
            except ValueError as err:
                raise ValueError(f"{model_name} layer {names[id(layer)]}: {err}") from None
        setattr(parent, attribute, replaced[id(layer)])
    return len(replaced)


__all__ = ["INT8_MAX", "Int8Linear", "quantizable_linears", "quantize_model", "quantize_weight"]
