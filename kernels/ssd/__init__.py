"""Mamba-2 SSD: token-by-token reference, chunked varlen prefill and the in-place decode state update."""

from kernels.ssd.chunked import ssd_scan_chunked
from kernels.ssd.fused_recurrent import ssd_state_update
from kernels.ssd.naive import ssd_scan_ref

__all__ = ["ssd_scan_chunked", "ssd_state_update", "ssd_scan_ref"]
