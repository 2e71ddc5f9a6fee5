"""Mamba-1 selective scan: the varlen prefill (chunked, time-major) and the fused decode state update.

``naive.py`` is the token-by-token reference, ``chunked.py`` the packed varlen prefill and
``fused_recurrent.py`` the in-place decode step on state-pool slots.
"""

from kernels.selective_scan.chunked import selective_scan_chunked
from kernels.selective_scan.fused_recurrent import selective_state_update
from kernels.selective_scan.naive import selective_scan_ref, selective_state_update_ref

__all__ = [
    "selective_scan_chunked",
    "selective_state_update",
    "selective_scan_ref",
    "selective_state_update_ref",
]
