"""Gated diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t`` in linear and log space."""

from kernels.diag_linear_scan.naive import diag_linear_scan_ref, diag_log_scan_ref

__all__ = ["diag_linear_scan_ref", "diag_log_scan_ref"]
