"""Fused CPU selective scan (prefill) and state update (decode), compiled on first use with PyTorch's
C++ extension builder.

On a CPU the PyTorch formulation of the scan is memory-bound: it materialises ``exp(dt A)`` and
``dt B x`` as ``[tokens, d_inner, d_state]`` tensors and streams over them several times. These kernels
keep each block of 16 channels' ``[16, d_state]`` state in registers/L1, read every input once and also
fuse the ``dt`` discretisation (bias + softplus) and the output's ``D`` skip and SiLU gate, so the scan
costs a few percent of a Mamba layer instead of about half of it (the rest is matrix multiplies).

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

struct Args {
  const float *x, *dt, *dt_bias, *A, *B, *C, *D, *z;  // dt_bias, D, z may be null
  float *y, *state;
  int64_t channels, d_state;
  bool softplus;
};

inline float discretise(float v, const Args& a, int64_t d) {
  if (a.dt_bias) v += a.dt_bias[d];
  if (a.softplus) v = v > 20.f ? v : std::log1p(std::exp(v));  // torch's softplus (threshold 20)
  return v;
}

// Tokens [t0, t1) of one sequence, channels [d0, d1), state rows at `state_row`:
// h[d, n] = exp(dt A) h + dt x B;  y[t, d] = (C_t . h[d] + D x) * silu(z).
// NS > 0 fixes d_state at compile time (fully vectorised inner loops); NS == 0 reads it at run time.
template <int64_t NS>
void scan_block(const Args& a, int64_t t0, int64_t t1, int64_t d0, int64_t d1, int64_t state_row) {
  const int64_t N = NS > 0 ? NS : a.d_state, Dm = a.channels, width = d1 - d0;
  alignas(64) float h[kBlock * 64];
  alignas(64) float A[kBlock * 64];
  alignas(64) float delta[kBlock];
  alignas(64) float u[kBlock];
  alignas(64) float acc[kBlock];
  for (int64_t j = 0; j < width; ++j)
    for (int64_t n = 0; n < N; ++n) {
      h[j * N + n] = a.state[state_row + (d0 + j) * N + n];
      A[j * N + n] = a.A[(d0 + j) * N + n];
    }
  for (int64_t t = t0; t < t1; ++t) {
    const float* Bt = a.B + t * N;
    const float* Ct = a.C + t * N;
    const int64_t row = t * Dm + d0;
    for (int64_t j = 0; j < width; ++j) {
      delta[j] = discretise(a.dt[row + j], a, d0 + j);
      u[j] = delta[j] * a.x[row + j];
    }
    for (int64_t j = 0; j < width; ++j) {
      float* hj = h + j * N;
      const float* Aj = A + j * N;
      const float dj = delta[j], uj = u[j];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t n = 0; n < N; ++n) {
        const float hn = std::exp(dj * Aj[n]) * hj[n] + uj * Bt[n];
        hj[n] = hn;
        sum += hn * Ct[n];
      }
      acc[j] = sum;
    }
    for (int64_t j = 0; j < width; ++j) {
      const int64_t d = d0 + j;
      float out = acc[j];
      if (a.D) out += a.D[d] * a.x[row + j];
      if (a.z) {
        const float zv = a.z[row + j];
        out *= zv / (1.f + std::exp(-zv));
      }
      a.y[row + j] = out;
    }
  }
  for (int64_t j = 0; j < width; ++j)
    for (int64_t n = 0; n < N; ++n) a.state[state_row + (d0 + j) * N + n] = h[j * N + n];
}

void scan_block_any(const Args& a, int64_t t0, int64_t t1, int64_t d0, int64_t d1, int64_t state_row) {
  switch (a.d_state) {
    case 16: return scan_block<16>(a, t0, t1, d0, d1, state_row);
    case 8: return scan_block<8>(a, t0, t1, d0, d1, state_row);
    default: return scan_block<0>(a, t0, t1, d0, d1, state_row);
  }
}

const float* optional(const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

Args make_args(const torch::Tensor& x, const torch::Tensor& dt, const torch::Tensor& dt_bias,
               const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& C, const torch::Tensor& D,
               const torch::Tensor& z, torch::Tensor& y, torch::Tensor& state, bool softplus) {
  TORCH_CHECK(A.size(1) <= 64, "d_state > 64 is not supported by the fused CPU scan");
  return Args{x.data_ptr<float>(), dt.data_ptr<float>(), optional(dt_bias), A.data_ptr<float>(),
              B.data_ptr<float>(), C.data_ptr<float>(), optional(D), optional(z), y.data_ptr<float>(),
              state.data_ptr<float>(), x.size(1), A.size(1), softplus};
}
}  // namespace

// Packed varlen prefill. x, dt, z [T, Dm]; dt_bias, D [Dm]; A [Dm, N]; B, C [T, N]; cu_seqlens [Bt + 1];
// state [Bt, Dm, N] contiguous, updated in place. Empty tensors stand for absent dt_bias / D / z.
torch::Tensor scan(torch::Tensor x, torch::Tensor dt, torch::Tensor dt_bias, torch::Tensor A,
                   torch::Tensor B, torch::Tensor C, torch::Tensor D, torch::Tensor z,
                   torch::Tensor cu_seqlens, torch::Tensor state, bool softplus) {
  auto y = torch::empty_like(x);
  const Args a = make_args(x, dt, dt_bias, A, B, C, D, z, y, state, softplus);
  const int64_t batch = cu_seqlens.size(0) - 1, blocks = (a.channels + kBlock - 1) / kBlock;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, d0 = (i % blocks) * kBlock;
      const int64_t d1 = std::min(d0 + kBlock, a.channels);
      scan_block_any(a, cu[b], cu[b + 1], d0, d1, b * a.channels * a.d_state);
    }
  });
  return y;
}

// Decode, one token per sequence. pool [S, Dm, N] (slot rows may be strided, each row contiguous) is
// updated in place at slot_ids [Bt]; x, dt, z [Bt, Dm]; B, C [Bt, N].
torch::Tensor step(torch::Tensor pool, torch::Tensor slot_ids, torch::Tensor x, torch::Tensor dt,
                   torch::Tensor dt_bias, torch::Tensor A, torch::Tensor B, torch::Tensor C, torch::Tensor D,
                   torch::Tensor z, bool softplus) {
  TORCH_CHECK(pool.stride(2) == 1 && pool.stride(1) == A.size(1), "pool rows must be contiguous [Dm, N]");
  auto y = torch::empty_like(x);
  const Args a = make_args(x, dt, dt_bias, A, B, C, D, z, y, pool, softplus);
  const int64_t batch = x.size(0), blocks = (a.channels + kBlock - 1) / kBlock, row_stride = pool.stride(0);
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  at::parallel_for(0, batch * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, d0 = (i % blocks) * kBlock;
      scan_block_any(a, b, b + 1, d0, std::min(d0 + kBlock, a.channels), slots[b] * row_stride);
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
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as err:  # no compiler, no OpenMP, read-only cache dir, ...
        log.warning("fused CPU selective scan unavailable, using the PyTorch path: %s", err)
        _module = None
    return _module


def usable(x: torch.Tensor) -> bool:
    """True when ``x``'s selective scan should run the fused CPU kernel."""
    return x.device.type == "cpu" and cpu_kernels() is not None
