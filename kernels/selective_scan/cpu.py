"""Fused CPU selective scan (prefill) and state update (decode), compiled on first use with PyTorch's
C++ extension builder.

On a CPU the PyTorch formulation of the scan is memory-bound: it materialises ``exp(dt A)`` and
``dt B x`` as ``[tokens, d_inner, d_state]`` tensors and streams over them several times. These kernels
keep each block of 16 channels' ``[16, d_state]`` state in registers/L1 and read every input once, so the
scan costs a few percent of a Mamba layer instead of about half of it (the rest is matrix multiplies).

The extension needs a C++ compiler with OpenMP (g++ on Linux). When it cannot be built, or when
``RNNSERVE_CPU_KERNELS=0``, :func:`cpu_kernels` returns ``None`` and callers use the PyTorch path.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {
constexpr int64_t kBlock = 16;  // channels per work item

// One sequence, channels [d0, d1): h[d, n] = exp(dt A) h + dt x B;  y[t, d] = C_t . h[d].
inline void scan_block(const float* x, const float* dt, const float* A, const float* B, const float* C,
                       float* y, float* state, int64_t D, int64_t N, int64_t t0, int64_t t1, int64_t d0,
                       int64_t d1, int64_t state_row) {
  float h[kBlock * 64];
  float a[kBlock * 64];
  const int64_t width = d1 - d0;
  for (int64_t j = 0; j < width; ++j)
    for (int64_t n = 0; n < N; ++n) {
      h[j * N + n] = state[state_row + (d0 + j) * N + n];
      a[j * N + n] = A[(d0 + j) * N + n];
    }
  for (int64_t t = t0; t < t1; ++t) {
    const float* Bt = B + t * N;
    const float* Ct = C + t * N;
    for (int64_t j = 0; j < width; ++j) {
      const float delta = dt[t * D + d0 + j];
      const float u = delta * x[t * D + d0 + j];
      float* hj = h + j * N;
      const float* aj = a + j * N;
      float acc = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        hj[n] = std::exp(delta * aj[n]) * hj[n] + u * Bt[n];
        acc += hj[n] * Ct[n];
      }
      y[t * D + d0 + j] = acc;
    }
  }
  for (int64_t j = 0; j < width; ++j)
    for (int64_t n = 0; n < N; ++n) state[state_row + (d0 + j) * N + n] = h[j * N + n];
}
}  // namespace

// Packed varlen prefill: x, dt [T, D]; A [D, N]; B, C [T, N]; cu_seqlens [Bt + 1] (int64);
// state [Bt, D, N] (contiguous, updated in place). Returns y [T, D] (before the D skip and the gate).
torch::Tensor scan(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B, torch::Tensor C,
                   torch::Tensor cu_seqlens, torch::Tensor state) {
  const int64_t T = x.size(0), D = x.size(1), N = A.size(1), batch = cu_seqlens.size(0) - 1;
  TORCH_CHECK(N <= 64, "d_state > 64 is not supported by the fused CPU scan");
  auto y = torch::empty({T, D}, x.options());
  const int64_t blocks = (D + kBlock - 1) / kBlock;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *sp = state.data_ptr<float>();
  at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, d0 = (i % blocks) * kBlock;
      scan_block(xp, dtp, Ap, Bp, Cp, yp, sp, D, N, cu[b], cu[b + 1], d0, std::min(d0 + kBlock, D), b * D * N);
    }
  });
  return y;
}

// Decode: one token per sequence. pool [S, D, N] (rows may be strided, (D, N) contiguous) updated in
// place at slot_ids [Bt]; x, dt [Bt, D]; B, C [Bt, N]. Returns y [Bt, D].
torch::Tensor step(torch::Tensor pool, torch::Tensor slot_ids, torch::Tensor x, torch::Tensor dt, torch::Tensor A,
                   torch::Tensor B, torch::Tensor C) {
  const int64_t batch = x.size(0), D = x.size(1), N = A.size(1);
  TORCH_CHECK(N <= 64, "d_state > 64 is not supported by the fused CPU scan");
  TORCH_CHECK(pool.stride(2) == 1 && pool.stride(1) == N, "pool rows must be contiguous [D, N]");
  auto y = torch::empty({batch, D}, x.options());
  const int64_t blocks = (D + kBlock - 1) / kBlock, row_stride = pool.stride(0);
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *sp = pool.data_ptr<float>();
  at::parallel_for(0, batch * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, d0 = (i % blocks) * kBlock;
      scan_block(xp, dtp, Ap, Bp, Cp, yp, sp, D, N, b, b + 1, d0, std::min(d0 + kBlock, D), slots[b] * row_stride);
    }
  });
  return y;
}
"""

_module: ModuleType | None = None
_tried = False


def cpu_kernels() -> ModuleType | None:
    """The compiled extension (``scan``, ``step``), or ``None`` when it is disabled or cannot be built."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("RNNSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(
            name="rnnserve_selective_scan_cpu",
            cpp_sources=_SOURCE,
            functions=["scan", "step"],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as err:  # no compiler, no OpenMP, read-only cache dir, ...
        log.warning("fused CPU selective scan unavailable, using the PyTorch path: %s", err)
        _module = None
    return _module


def usable(x: torch.Tensor) -> bool:
    """True when ``x``'s selective scan should run the fused CPU kernel."""
    return x.device.type == "cpu" and cpu_kernels() is not None
