"""Sequence-mixing and fused ops, one folder each: a PyTorch reference (``naive.py``), Triton kernels beside it
and public functions that pick Triton on CUDA tensors (see :mod:`rnnserve.kernels.backend` and ``docs/kernels.md``)."""
