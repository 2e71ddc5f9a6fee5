"""Sequence-mixing ops: each folder holds a PyTorch reference and (where written) Triton kernels."""
