// minGRU / minLSTM on CPU. min_rnn_step is one decode step: the gates, h = a h + b in fp32 and the in-place write
// of the slots' states, in one pass (the PyTorch reference is about a dozen ops per layer, which dominated a
// batch-1 step's dispatches). min_rnn_scan is the packed varlen prefill with the same gates and arithmetic, token
// by token: a sequential scan needs no log space, and the log-space gates PyTorch computed for the parallel scan
// (softplus, log, where: eight elementwise passes over [T, P * D]) took a fifth of a minLSTM prefill. Gate
// formulas as in kernels/min_rnn_step/naive.py:
//   minGRU  (proj = k, h~):     z = sigmoid(k);  a = 1 - z;  b = z g(h~)
//   minLSTM (proj = f, i, h~):  d = softplus(-f) - softplus(-i);  a = sigmoid(-d);  b = sigmoid(d) g(h~)
// with g(x) = x + 0.5 for x >= 0, else sigmoid(x).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu_bf16.h"
#include "cpu_math.h"

namespace {
constexpr int64_t kRowsPerTask = 16;  // rows of a batch per thread task (a row is a few microseconds of work)
constexpr int64_t kScanChannels = 256;  // channels of one prefill task (its state stays in L1)

__attribute__((always_inline)) inline float candidate(float x) { return x >= 0.0f ? x + 0.5f : rnnserve::sigmoid(x); }

// a h + b for channel j of a row proj[0, P * dim) (the columns of each projection `dim` apart).
template <typename T>
__attribute__((always_inline)) inline float step(const T* p, int64_t dim, int64_t j, float h, bool lstm) {
  using rnnserve::to_float;
  float a, b;
  if (lstm) {
    const float d = rnnserve::softplus(-to_float(p[j])) - rnnserve::softplus(-to_float(p[dim + j]));
    a = rnnserve::sigmoid(-d);
    b = rnnserve::sigmoid(d) * candidate(to_float(p[2 * dim + j]));
  } else {
    const float z = rnnserve::sigmoid(to_float(p[j]));
    a = 1.0f - z;
    b = z * candidate(to_float(p[dim + j]));
  }
  return a * h + b;
}

// One row's channels as a vector loop. GCC vectorises it only with every call inlined and bf16 converted
// bit-wise (rnnserve::to_float, store_as), as the scan's loop below.
template <bool kLstm, typename T>
__attribute__((always_inline)) inline void step_row(const T* p, int64_t dim, float* h, T* y) {
#pragma omp simd
  for (int64_t j = 0; j < dim; ++j) {
    h[j] = step(p, dim, j, h[j], kLstm);
    rnnserve::store_as(y, j, h[j]);
  }
}

template <typename T>
void step_rows(const T* proj, int64_t proj_stride, float* pool, int64_t pool_stride, const int64_t* slots, T* out,
               int64_t batch, int64_t dim, bool lstm) {
  at::parallel_for(0, batch, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* p = proj + r * proj_stride;
      float* h = pool + slots[r] * pool_stride;
      T* y = out + r * dim;
      if (lstm)
        step_row<true>(p, dim, h, y);
      else
        step_row<false>(p, dim, h, y);
    }
  });
}

// proj [B, P * D] (fp32 or bf16, unit stride along the last dim; P = 2 minGRU, 3 minLSTM), pool [N, D] fp32
// (any slot stride, unit stride along D), slot_ids [B] int64. Advances rows slot_ids of pool in place and
// returns the new h [B, D] in proj's dtype.
at::Tensor min_rnn_step(const at::Tensor& proj, at::Tensor pool, const at::Tensor& slot_ids, bool lstm) {
  TORCH_CHECK(proj.dim() == 2 && pool.dim() == 2, "min_rnn_step: proj [B, P * D] and pool [N, D]");
  TORCH_CHECK(proj.scalar_type() == at::kFloat || proj.scalar_type() == at::kBFloat16, "proj must be fp32 or bf16");
  TORCH_CHECK(proj.stride(1) == 1, "proj needs a unit stride along its last dim");
  TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.stride(1) == 1, "pool must be fp32 with unit-stride rows");
  const int64_t batch = proj.size(0), dim = pool.size(1), projections = lstm ? 3 : 2;
  TORCH_CHECK(proj.size(1) == projections * dim, "proj must have ", projections, " x ", dim, " columns");
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous() && slot_ids.numel() == batch,
              "slot_ids must be int64 [B]");
  auto out = at::empty({batch, dim}, proj.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  if (proj.scalar_type() == at::kFloat)
    step_rows(proj.data_ptr<float>(), proj.stride(0), pool.data_ptr<float>(), pool.stride(0), slots,
              out.data_ptr<float>(), batch, dim, lstm);
  else
    step_rows(proj.data_ptr<at::BFloat16>(), proj.stride(0), pool.data_ptr<float>(), pool.stride(0), slots,
              out.data_ptr<at::BFloat16>(), batch, dim, lstm);
  return out;
}
template <bool kLstm, typename T>
__attribute__((always_inline)) inline void scan_token(const T* p, int64_t dim, int64_t j0, int64_t j1, float* h,
                                                      float* y) {
#pragma omp simd
  for (int64_t j = j0; j < j1; ++j) {
    h[j] = step(p, dim, j, h[j], kLstm);
    y[j] = h[j];
  }
}

template <typename T>
void scan_rows(const T* proj, int64_t proj_stride, const int64_t* cu, int64_t batch, int64_t dim, float* state,
               float* out, bool lstm) {
  const int64_t blocks = (dim + kScanChannels - 1) / kScanChannels;
  at::parallel_for(0, batch * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / blocks, j0 = (i % blocks) * kScanChannels, j1 = std::min(j0 + kScanChannels, dim);
      float* h = state + b * dim;
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
        if (lstm)
          scan_token<true>(proj + t * proj_stride, dim, j0, j1, h, out + t * dim);
        else
          scan_token<false>(proj + t * proj_stride, dim, j0, j1, h, out + t * dim);
      }
    }
  });
}

// proj [T, P * D] (fp32 or bf16, unit stride along the last dim), cu_seqlens [B + 1] int64, state [B, D] fp32
// contiguous: the initial states, overwritten with the final ones. Returns h [T, D] fp32. One task takes one
// sequence's block of channels through all its tokens.
at::Tensor min_rnn_scan(const at::Tensor& proj, const at::Tensor& cu_seqlens, at::Tensor state, bool lstm) {
  TORCH_CHECK(proj.dim() == 2 && state.dim() == 2, "min_rnn_scan: proj [T, P * D] and state [B, D]");
  TORCH_CHECK(proj.scalar_type() == at::kFloat || proj.scalar_type() == at::kBFloat16, "proj must be fp32 or bf16");
  TORCH_CHECK(proj.stride(1) == 1, "proj needs a unit stride along its last dim");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous(), "state must be contiguous fp32 [B, D]");
  const int64_t total = proj.size(0), dim = state.size(1), batch = state.size(0), projections = lstm ? 3 : 2;
  TORCH_CHECK(proj.size(1) == projections * dim, "proj must have ", projections, " x ", dim, " columns");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() && cu_seqlens.numel() == batch + 1,
              "min_rnn_scan: cu_seqlens must be int64 [B + 1]");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == total, "min_rnn_scan: cu_seqlens must run from 0 to T");
  for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(cu[b] <= cu[b + 1], "min_rnn_scan: cu_seqlens must not decrease");
  auto out = at::empty({total, dim}, proj.options().dtype(at::kFloat));
  if (proj.scalar_type() == at::kFloat)
    scan_rows(proj.data_ptr<float>(), proj.stride(0), cu, batch, dim, state.data_ptr<float>(), out.data_ptr<float>(),
              lstm);
  else
    scan_rows(proj.data_ptr<at::BFloat16>(), proj.stride(0), cu, batch, dim, state.data_ptr<float>(),
              out.data_ptr<float>(), lstm);
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("min_rnn_step(Tensor proj, Tensor(a!) pool, Tensor slot_ids, bool lstm) -> Tensor", &min_rnn_step);
  m.def("min_rnn_scan(Tensor proj, Tensor cu_seqlens, Tensor(a!) state, bool lstm) -> Tensor", &min_rnn_scan);
}
