// The loops shared by the weight-only quantized linear kernels (int8_linear, int4_linear; header-only, included
// by kernels/<op>/<op>_cpu.cpp): streaming the weight's rows once for a decode batch, and dequantising blocks of
// them for the fp32 GEMM beyond it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_vector.h"
#include "onednn_linear.h"

namespace rnnserve {

constexpr int64_t kStreamChunkRows = 8;               // rows of x multiplied together with each weight row
constexpr int64_t kStreamBlockBytes = 128 << 10;      // weight bytes taken with every chunk of x before the next
constexpr int64_t kStreamMinBytesPerThread = 64 << 10;  // smaller products run on one thread (a barrier costs more)
constexpr int64_t kDequantBlockBytes = 1 << 20;       // fp32 bytes of one dequantised block of W

// y [rows, n] = finish(i, sum_k x[m, k] W[i, k]) for few rows of x (a decode batch). Each thread takes a
// contiguous range of W's rows and reads it once from memory. Up to kStreamChunkRows rows of x, one weight row at a
// time, front to back: one sequential stream per core. Beyond, W's rows are taken in blocks of about
// kStreamBlockBytes that stay in L2 while x passes chunk by chunk (each chunk in L1), each chunk as a batch of 8
// would; a chunk whose rows are long goes over K in passes (rnnserve::chunk_shape: each but the last a multiple of
// 64 inputs), and the passes' sums are added up.
//
// dot(i, k0, count, x_chunk, x_stride, chunk_rows, sums): sums[m] = sum over k0 <= j < k0 + count of
// W[i, j] * x_chunk[m * x_stride + j], for m < chunk_rows <= kStreamChunkRows.
// finish(i, sum): the output for row i of W from its whole dot product (scale, bias).
template <typename X, typename out_t, typename Dot, typename Finish>
void stream_weight_rows(const X* x, int64_t x_stride, int64_t rows, int64_t k, int64_t n, int64_t row_bytes,
                        out_t* y, const Dot& dot, const Finish& finish) {
  const int64_t grain = std::max<int64_t>(1, kStreamMinBytesPerThread / std::max<int64_t>(1, row_bytes));
  const int64_t block = std::max<int64_t>(1, kStreamBlockBytes / std::max<int64_t>(1, row_bytes));
  const ChunkShape shape = chunk_shape(rows, k, kStreamChunkRows, sizeof(X));
  at::parallel_for(0, n, grain, [&, dot, finish](int64_t begin, int64_t end) {
    float sums[kStreamChunkRows];
    std::vector<float> partial(shape.k_pass < k ? shape.rows * block : 0);
    for (int64_t i0 = begin; i0 < end; i0 += block) {
      const int64_t i1 = std::min(end, i0 + block), block_rows = i1 - i0;
      for (int64_t m0 = 0; m0 < rows; m0 += shape.rows) {
        const int64_t chunk = std::min(shape.rows, rows - m0);
        const X* xm = x + m0 * x_stride;
        out_t* ym = y + m0 * n;
        if (shape.k_pass == k) {
          for (int64_t i = i0; i < i1; ++i) {
            dot(i, 0, k, xm, x_stride, chunk, sums);
            for (int64_t m = 0; m < chunk; ++m) ym[m * n + i] = static_cast<out_t>(finish(i, sums[m]));
          }
          continue;
        }
        std::fill(partial.begin(), partial.begin() + chunk * block_rows, 0.f);
        for (int64_t k0 = 0; k0 < k; k0 += shape.k_pass) {
          const int64_t pass = std::min(shape.k_pass, k - k0);
          for (int64_t i = i0; i < i1; ++i) {
            dot(i, k0, pass, xm, x_stride, chunk, sums);
            for (int64_t m = 0; m < chunk; ++m) partial[m * block_rows + i - i0] += sums[m];
          }
        }
        for (int64_t m = 0; m < chunk; ++m)
          for (int64_t i = i0; i < i1; ++i)
            ym[m * n + i] = static_cast<out_t>(finish(i, partial[m * block_rows + i - i0]));
      }
    }
  });
}

// y = x32 @ W^T + bias32 for many rows of x (a prefill), where a BLAS GEMM is far ahead of a hand-written loop:
// blocks of W's rows are dequantised into an fp32 buffer that stays in cache (dequantize_row(i, dst) writes W's row
// i, k values) and multiplied by oneDNN's fp32 inner product (copied into y's columns) or, without oneDNN (non-x86
// builds of PyTorch), by the BLAS (W_block [count, K] @ x^T writes rows of y^T; y is returned as a transposed view).
template <typename DequantizeRow>
at::Tensor dequantized_gemm(const at::Tensor& x32, int64_t n, const std::optional<at::Tensor>& bias32,
                            const DequantizeRow& dequantize_row) {
  static const bool onednn = onednn_linear_available();
  const int64_t rows = x32.size(0), k = x32.size(1);
  if (k == 0) {  // an empty product (oneDNN has no primitive for it): the bias alone
    at::Tensor y = at::zeros({rows, n}, x32.options());
    return bias32.has_value() ? y.add_(*bias32) : y;
  }
  auto y = onednn ? at::empty({rows, n}, x32.options()) : at::empty({n, rows}, x32.options());
  const int64_t block = std::max<int64_t>(16, kDequantBlockBytes / (4 * std::max<int64_t>(1, k)));
  auto buffer = at::empty({std::min(block, n), k}, x32.options());
  const at::Tensor x_t = x32.t();
  for (int64_t n0 = 0; n0 < n; n0 += block) {
    const int64_t count = std::min(block, n - n0);
    float* dequant = buffer.data_ptr<float>();
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dequantize_row(n0 + r, dequant + r * k);
    });
    const at::Tensor block_weight = buffer.narrow(0, 0, count);
    if (onednn) {
      y.narrow(1, n0, count).copy_(onednn_linear(x32, block_weight, std::nullopt));
    } else {
      auto out = y.narrow(0, n0, count);
      at::mm_out(out, block_weight, x_t);
    }
  }
  if (onednn) {
    if (bias32.has_value()) y.add_(*bias32);
    return y;
  }
  if (bias32.has_value()) y.add_(bias32->unsqueeze(1));
  return y.t();
}

}  // namespace rnnserve
