"""Building blocks shared by the model modules, one small module each:

- :mod:`.linear`: ``linear``/``matmul_t``, linear layers with CPU fast paths for decode batches;
- :mod:`.norms`: RMSNorm variants (Mamba's ``weight``, Gemma's ``1 + weight``, weightless);
- :mod:`.rope`: rotary position embeddings on all or part of each head;
- :mod:`.sliding_window`: sliding-window attention over a per-slot ring buffer of keys and values;
- :mod:`.mlp`: gated MLPs (GeGLU, SwiGLU);
- :mod:`.slots`: gathering and scattering sequences' rows of the state pool;
- :mod:`.packing`: packed varlen batches as time-major ``PackedSequence``;
- :mod:`.mixer_stack`: the embedding -> mixer blocks -> norm -> head skeleton of Mamba-style models.
"""

from rnnserve.engine.models.layers.linear import linear, matmul_t
from rnnserve.engine.models.layers.mixer_stack import MixerBackbone, MixerBlock, MixerStackLM
from rnnserve.engine.models.layers.mlp import GatedMLP, gelu_tanh
from rnnserve.engine.models.layers.norms import GemmaRMSNorm, RMSNorm, rms_normalize, weightless_rms_norm
from rnnserve.engine.models.layers.packing import time_major_packed
from rnnserve.engine.models.layers.rope import apply_rope, rope_cos_sin
from rnnserve.engine.models.layers.sliding_window import SlidingWindowAttention
from rnnserve.engine.models.layers.slots import gather_slots, scatter_slots, slot_index

__all__ = [
    "GatedMLP",
    "GemmaRMSNorm",
    "MixerBackbone",
    "MixerBlock",
    "MixerStackLM",
    "RMSNorm",
    "SlidingWindowAttention",
    "apply_rope",
    "gather_slots",
    "gelu_tanh",
    "linear",
    "matmul_t",
    "rms_normalize",
    "rope_cos_sin",
    "scatter_slots",
    "slot_index",
    "time_major_packed",
    "weightless_rms_norm",
]
