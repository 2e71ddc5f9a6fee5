"""Mamba-2 SSD: chunked varlen prefill and the in-place decode state update.

``naive.py`` is the token-by-token reference; ``torch_chunked.py`` the chunked varlen prefill (the SSD
algorithm, a handful of batched matmuls) and ``torch_recurrent.py`` the in-place decode update, both in
PyTorch. There is no Triton or C++ kernel yet: these are the public functions on every device.
"""

from rnnserve.kernels.ssd.torch_chunked import ssd_scan_chunked
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update

__all__ = ["ssd_scan_chunked", "ssd_state_update"]
