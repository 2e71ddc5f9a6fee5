// In-place logit soft-capping, x = cap * tanh(x / cap), for dense fp32 logits on CPU: one vectorised pass instead
// of ATen's division, tanh and product (its fp32 tanh is several times slower than its exp on these CPUs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_math.h"

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements a thread takes at least

// tanh(t) = sign(t) (1 - e) / (1 + e) with e = exp(-2|t|) in (0, 1]: no overflow, a few fp32 units of the last
// place where |t| >= 1/8; below, where 1 - e would cancel, its odd Taylor polynomial to t^7 (next term < 2e-10 t).
// From |t| = 9.1, where tanh rounds to 1 in fp32, it is 1 outright: -ffast-math may divide by a reciprocal
// estimate, which gave 1 - 6e-8 for t = inf in an AVX2 build.
__attribute__((always_inline)) inline float tanh_approx(float t) {
  const float a = std::fabs(t);
  const float e = rnnserve::fast_exp(-2.0f * a);
  const float t2 = t * t;
  const float series = t * std::fma(t2, std::fma(t2, std::fma(t2, -17.0f / 315, 2.0f / 15), -1.0f / 3), 1.0f);
  const float magnitude = a >= 9.1f ? 1.0f : (1.0f - e) / (1.0f + e);
  return a < 0.125f ? series : std::copysign(magnitude, t);
}

at::Tensor& soft_cap_(at::Tensor& x, double cap) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "soft_cap_: fp32 CPU logits only");
  TORCH_CHECK(x.is_non_overlapping_and_dense(), "soft_cap_: the logits must be dense");
  TORCH_CHECK(cap > 0, "soft_cap_: cap must be positive");
  const float c = static_cast<float>(cap);
  float* data = x.data_ptr<float>();  // dense: every element once, in memory order
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      data[i] = tanh_approx(data[i] / c) * c;
    }
  });
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) { m.def("soft_cap_(Tensor(a!) x, float cap) -> Tensor(a!)", &soft_cap_); }
