"""Causal depthwise conv1d with a per-slot state tail (prefill over packed batches, one-step update)."""

from kernels.causal_conv1d.naive import causal_conv1d_update_ref, causal_conv1d_varlen_ref

__all__ = ["causal_conv1d_varlen_ref", "causal_conv1d_update_ref"]
