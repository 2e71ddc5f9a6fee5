"""Weight-only quantization of a loaded model's linear layers (``--quantize int8`` or ``int4``).

With ``int8`` every ``nn.Linear`` child of the model becomes an :class:`Int8Linear`: an int8 weight ``[N, K]``
with one symmetric fp32 scale per output row (``scale = max|w_row| / 127``, ``q = round(w / scale)``). With
``int4`` it becomes an :class:`Int4Linear`: groups of 32 inputs of a row, each with one fp16 scale and 4-bit
values in ``[-8, 7]`` (the layout of :mod:`rnnserve.kernels.int4_linear.naive`; 4.5 bits a weight, as
llama.cpp's Q4_0). The bias is kept in the model's dtype. Activations stay in the model's dtype, products
accumulate in fp32 and outputs come back in the model's dtype; recurrent states, embeddings, norms,
convolutions and gates are untouched. A head tied to the embedding gets its own int8 copy while the embedding
keeps its dtype (a lookup reads one row, the head streams all of them every step).

A module that reads a child's ``.weight`` directly instead of calling it through
:func:`rnnserve.engine.models.layers.linear` names that child in a class attribute ``unquantized_linears``;
those layers keep their dtype. A model without any linear layer to quantize (LSRL programs, whose layers are
sparse fp64 matrices) is refused with a ``ValueError`` at start-up rather than served unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rnnserve.kernels import int4_linear as int4
from rnnserve.kernels.int8_linear import ACTIVATION_DTYPES, int8_linear

INT8_MAX = 127
INT4_MIN = -8
INT4_MAX = 7
FP16_MAX = 65504.0
METHODS = ("int8", "int4")


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """A linear layer with a group-wise int4 weight: ``weight [N, ceil(K / 32) * 16]`` uint8 (two 4-bit values a
    byte) and ``scale [N, ceil(K / 32)]`` fp16 (buffers), and the original ``bias`` (a parameter, or None)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        groups = int4.groups_of(in_features)
        if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != groups * int4.GROUP // 2:
            raise ValueError(
                f"Int4Linear needs a uint8 [N, {groups * int4.GROUP // 2}] weight for {in_features} inputs, got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
        if scale.shape != (weight.shape[0], groups):
            raise ValueError(f"Int4Linear needs a [{weight.shape[0]}, {groups}] scale, got {tuple(scale.shape)}")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.to(torch.float16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features = in_features

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Int4Linear:
        """Quantize ``layer``'s weight in groups of 32 inputs; raises ``ValueError`` on non-finite weights and on
        weights whose scales overflow fp16."""
        weight, scale = quantize_weight_int4(layer.weight)
        return cls(weight, scale, layer.bias, layer.in_features)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4.int4_linear(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


QuantizedLinear = Int8Linear | Int4Linear


ROW_BLOCK = 2048  # rows quantized at a time: the fp32 temporaries of a block, not of a whole vocabulary's head


def _by_row_blocks(
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` (a per-row scheme) over ``ROW_BLOCK`` rows at a time, joined: quantizing a 74 MB bf16
    head at once took six to eight times its size in fp32 temporaries."""
    blocks = [quantize_rows(weight[start : start + ROW_BLOCK]) for start in range(0, max(len(weight), 1), ROW_BLOCK)]
    return torch.cat([q for q, _ in blocks]), torch.cat([scale for _, scale in blocks])


@torch.no_grad()
def quantize_weight_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> ``(packed [N, G * 16] uint8, scale [N, G] fp16)``, ``G = ceil(K / 32)``.

    Each group of 32 inputs (the last one padded with zeros) takes the value of largest magnitude ``m`` and
    ``scale = m / -8`` rounded to fp16, so ``m`` maps to ``-8`` exactly and the group uses all 16 levels of
    ``[-8, 7]`` (llama.cpp's Q4_0 rule); ``q = clamp(round(w / scale), -8, 7)``. An all-zero group gets scale 0.
    """
    return _by_row_blocks(_int4_rows, weight.detach())


def _int4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("cannot quantize a weight with non-finite values")
    n, k = w.shape
    groups = int4.groups_of(k)
    padded = F.pad(w, (0, groups * int4.GROUP - k)).view(n, groups, int4.GROUP)
    largest = padded.gather(-1, padded.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    scale = (largest / INT4_MIN).to(torch.float16)
    if bool(torch.isinf(scale).any()):
        raise ValueError(f"cannot quantize to int4 a weight larger than {FP16_MAX * -INT4_MIN:g} (fp16 scales)")
    divisor = scale.float().masked_fill(scale == 0, 1.0)[..., None]
    q = torch.round(padded / divisor).clamp_(INT4_MIN, INT4_MAX).view(n, groups * int4.GROUP)
    return int4.pack(q), scale


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(int8 [N, K], fp32 scale [N])`` with ``weight ~ q * scale[:, None]``.

    Symmetric per row: ``scale = max|w_row| / 127`` and ``q = round(w / scale)``, so each row's largest
    magnitude maps to +-127 exactly and every value is off by at most ``scale / 2``. An all-zero row gets
    scale 0 and zeros.
    """
    return _by_row_blocks(_int8_rows, weight.detach())


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
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
    """Replace the model's linear layers in place by their ``method`` (``"int8"`` or ``"int4"``) versions;
    returns how many.

    Raises ``ValueError`` for an unknown method, for a model with no linear layer to quantize (naming the
    model), for weights in a dtype the kernels take no activations in (fp64), and for a layer with non-finite
    weights (naming the layer).
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r} (choices: {', '.join(METHODS)})")
    targets = quantizable_linears(model)
    model_name = getattr(model, "architecture", type(model).__name__)
    if not targets:
        raise ValueError(f"--quantize {method}: the {model_name} model has no linear layers to quantize")
    dtype = targets[0][2].weight.dtype
    if dtype not in ACTIVATION_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in ACTIVATION_DTYPES)
        raise ValueError(f"--quantize {method}: quantized layers take {names} activations, not {dtype}; set --dtype")
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    quantized = Int8Linear if method == "int8" else Int4Linear
    replaced: dict[int, QuantizedLinear] = {}  # a module shared by several parents stays shared
    for parent, attribute, layer in targets:
        if id(layer) not in replaced:
            try:
                replaced[id(layer)] = quantized.from_linear(layer)
            except ValueError as err:
                raise ValueError(f"{model_name} layer {names[id(layer)]}: {err}") from None
        setattr(parent, attribute, replaced[id(layer)])
    return len(replaced)


__all__ = [
    "INT8_MAX",
    "METHODS",
    "Int4Linear",
    "Int8Linear",
    "QuantizedLinear",
    "quantizable_linears",
    "quantize_model",
    "quantize_weight",
    "quantize_weight_int4",
]
