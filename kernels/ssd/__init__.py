"""Mamba-2 SSD: token-by-token reference, chunked varlen prefill and the in-place decode state update."""

from rnnserve.kernels.ssd.chunked import ssd_scan_chunked
from rnnserve.kernels.ssd.fused_recurrent import ssd_state_update
from rnnserve.kernels.ssd.naive import ssd_scan_ref

__all__ = ["ssd_scan_chunked", "ssd_state_update", "ssd_scan_ref"]
