// One minGRU / minLSTM decode step on CPU: the gates, h = a h + b in fp32 and the in-place write of the slots'
// states, in one pass (the PyTorch reference is about a dozen ops per layer, which dominated a batch-1 step's
// dispatches). Gate formulas as in kernels/min_rnn_step/naive.py:
//   minGRU  (proj = k, h~):     z = sigmoid(k);  a = 1 - z;  b = z g(h~)
//   minLSTM (proj = f, i, h~):  d = softplus(-f) - softplus(-i);  a = sigmoid(-d);  b = sigmoid(d) g(h~)
// with g(x) = x + 0.5 for x >= 0, else sigmoid(x).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_math.h"

namespace {
constexpr int64_t kRowsPerTask = 16;  // rows of a batch per thread task (a row is a few microseconds of work)

inline float sigmoid(float x) { return 1.0f / (1.0f + rnnserve::fast_exp(-x)); }

// torch.nn.functional.softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(rnnserve::fast_exp(x)); }

inline float candidate(float x) { return x >= 0.0f ? x + 0.5f : sigmoid(x); }

template <typename T>
void step_rows(const T* proj, int64_t proj_stride, float* pool, int64_t pool_stride, const int64_t* slots, T* out,
               int64_t batch, int64_t dim, bool lstm) {
  at::parallel_for(0, batch, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* p = proj + r * proj_stride;
      float* h = pool + slots[r] * pool_stride;
      T* y = out + r * dim;
      for (int64_t j = 0; j < dim; ++j) {
        float a, b;
        if (lstm) {
          const float d = softplus(-static_cast<float>(p[j])) - softplus(-static_cast<float>(p[dim + j]));
          a = sigmoid(-d);
          b = sigmoid(d) * candidate(static_cast<float>(p[2 * dim + j]));
        } else {
          const float z = sigmoid(static_cast<float>(p[j]));
          a = 1.0f - z;
          b = z * candidate(static_cast<float>(p[dim + j]));
        }
        const float next = a * h[j] + b;
        h[j] = next;
        y[j] = static_cast<T>(next);
      }
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
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("min_rnn_step(Tensor proj, Tensor(a!) pool, Tensor slot_ids, bool lstm) -> Tensor", &min_rnn_step);
}
