// Fused CPU decode step of the causal depthwise conv1d: for each sequence, read its slot's tail, emit
// y = bias + sum_k w[:, k] * window[:, k] (optionally SiLU'd), and shift the new input into the tail in
// place. One pass over [batch, channels] instead of the ~10 PyTorch ops (gather, concat, scatter, ...) that
// dominated a small-batch decode step's non-GEMM time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

namespace {
constexpr int64_t kMaxWidth = 4;

// One sequence's channels into `out` (fp32): y = bias + sum_k w[:, k] * [tail, x][:, k], SiLU'd when asked;
// the tail shifts left by one. The width is a template parameter so the tap loops unroll per channel.
template <int64_t K, typename T>
void conv_update_row(const T* x, int64_t x_stride, float* tail, int64_t tail_stride, const float* w,
                     const float* bias, float* out, int64_t channels, bool silu) {
  for (int64_t c = 0; c < channels; ++c) {
    float* tc = tail + c * tail_stride;
    const float* wc = w + c * K;
    const float xc = static_cast<float>(x[c * x_stride]);
    float acc = bias ? bias[c] : 0.f;
    for (int64_t k = 0; k < K - 1; ++k) acc += tc[k] * wc[k];
    acc += xc * wc[K - 1];
    for (int64_t k = 0; k < K - 2; ++k) tc[k] = tc[k + 1];
    tc[K - 2] = xc;
    out[c] = acc;
  }
  if (silu) {
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) out[c] = rnnserve::silu(out[c]);
  }
}

template <typename T>
void conv_update_rows(const at::Tensor& x, at::Tensor& pool, const at::Tensor& weight, const float* bias,
                      const int64_t* slots, at::Tensor& y, bool silu) {
  const int64_t batch = x.size(0), channels = x.size(1), width = weight.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  float* pp = pool.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), ps0 = pool.stride(0), ps1 = pool.stride(1);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : channels);
    for (int64_t b = begin; b < end; ++b) {
      const T* xb = xp + b * xs0;
      float* tail = pp + slots[b] * ps0;
      float* out = std::is_same_v<T, float> ? reinterpret_cast<float*>(yp + b * channels) : row.data();
      switch (width) {
        case 2: conv_update_row<2>(xb, xs1, tail, ps1, w, bias, out, channels, silu); break;
        case 3: conv_update_row<3>(xb, xs1, tail, ps1, w, bias, out, channels, silu); break;
        case 4: conv_update_row<4>(xb, xs1, tail, ps1, w, bias, out, channels, silu); break;
        default: TORCH_CHECK(false, "the fused CPU conv update supports widths 2-4");
      }
      if constexpr (!std::is_same_v<T, float>)
        for (int64_t c = 0; c < channels; ++c) yp[b * channels + c] = static_cast<T>(row[c]);
    }
  });
}

// x [B, C] (fp32 or bf16, any strides); pool [S, C, K-1] fp32 (any slot/channel strides, taps contiguous),
// updated in place at slot_ids [B] (int64); weight [C, K] and bias [C] contiguous fp32.
// Returns y [B, C] contiguous in x's dtype.
at::Tensor causal_conv1d_update(const at::Tensor& x, at::Tensor pool, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const at::Tensor& slot_ids, bool silu) {
  TORCH_CHECK(x.dim() == 2 && pool.dim() == 3 && weight.dim() == 2, "x [B, C], pool [S, C, K-1], weight [C, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.stride(2) == 1, "pool must be fp32 with contiguous taps");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be contiguous fp32");
  TORCH_CHECK(weight.size(0) == x.size(1) && pool.size(1) == x.size(1), "channel counts differ");
  TORCH_CHECK(weight.size(1) == pool.size(2) + 1 && weight.size(1) <= kMaxWidth, "tail must hold K-1 taps");
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous() && slot_ids.numel() == x.size(0),
              "slot_ids must be int64 [B]");
  const float* bias_ptr = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous(), "bias must be contiguous fp32");
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16)
    conv_update_rows<at::BFloat16>(x, pool, weight, bias_ptr, slots, y, silu);
  else
    conv_update_rows<float>(x, pool, weight, bias_ptr, slots, y, silu);
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "causal_conv1d_update(Tensor x, Tensor(a!) pool, Tensor weight, Tensor? bias, Tensor slot_ids, bool silu) "
      "-> Tensor",
      &causal_conv1d_update);
}
