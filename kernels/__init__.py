"""Sequence-mixing and fused ops, one folder each, in the flash-linear-attention shape: ``naive.py`` the PyTorch
reference, ``chunk.py`` / ``fused_recurrent.py`` Triton prefill / decode kernels, ``<op>_cpu.cpp`` fused C++
kernels, ``torch_*.py`` PyTorch paths organised for speed, and an ``__init__.py`` whose public functions pick
the implementation by device (see :mod:`rnnserve.kernels.backend`, :mod:`rnnserve.kernels.cpu_extension` and
``docs/kernels.md``)."""
