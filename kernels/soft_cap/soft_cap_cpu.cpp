// In-place logit soft-capping, x = cap * tanh(x / cap), for dense fp32 logits on CPU: one vectorised pass instead
// of ATen's division, tanh and product (its fp32 tanh is several times slower than its exp on these CPUs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_math.h"

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements a thread takes at least

at::Tensor& soft_cap_(at::Tensor& x, double cap) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "soft_cap_: fp32 CPU logits only");
  TORCH_CHECK(x.is_non_overlapping_and_dense(), "soft_cap_: the logits must be dense");
  TORCH_CHECK(cap > 0, "soft_cap_: cap must be positive");
  const float c = static_cast<float>(cap);
  float* data = x.data_ptr<float>();  // dense: every element once, in memory order
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      data[i] = rnnserve::tanh_approx(data[i] / c) * c;
    }
  });
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) { m.def("soft_cap_(Tensor(a!) x, float cap) -> Tensor(a!)", &soft_cap_); }
