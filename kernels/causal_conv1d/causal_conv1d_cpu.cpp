// Fused CPU causal depthwise conv1d, y = bias + sum_k w[:, k] * window[:, k] (optionally SiLU'd):
// - the decode step reads each sequence's slot tail, emits y and shifts the new input into the tail in place;
// - the packed varlen prefill runs each sequence from its initial tail and returns the final tails.
// The SiLU takes the conv's output rounded to x's dtype, as F.silu after the conv does (two roundings in bf16).
// Each is one pass over its inputs instead of the ~10 PyTorch ops (gathers, concatenations, scatters, dtype
// conversions) that dominated the conv's share of a Mamba layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_bf16.h"
#include "cpu_math.h"

#include <cmath>
#include <optional>
#include <tuple>
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
    const float xc = rnnserve::to_float(x[c * x_stride]);
    float acc = bias ? bias[c] : 0.f;
    for (int64_t k = 0; k < K - 1; ++k) acc += tc[k] * wc[k];
    acc += xc * wc[K - 1];
    for (int64_t k = 0; k < K - 2; ++k) tc[k] = tc[k + 1];
    tc[K - 2] = xc;
    out[c] = acc;
  }
  if (silu) {
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) out[c] = rnnserve::silu(rnnserve::round_to<T>(out[c]));
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
        for (int64_t c = 0; c < channels; ++c) rnnserve::store_as(yp + b * channels, c, row[c]);
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
constexpr int64_t kWideBlock = 256;  // channels per prefill work item
constexpr int64_t kPrefetchTokens = 2;

// Prefill of one sequence's tokens [t0, t1) over channels [c0, c0 + count): the last K-1 inputs of each
// channel live in a small [K-1][256] window (vector loops over channels); each token reads a 1 KB run of its
// row, prefetched a few tokens ahead (rows of a packed batch are pages apart).
template <int64_t K, typename T>
void conv_prefill_block(const T* x, int64_t xs0, int64_t xs1, const float* w, const float* bias, float* start,
                        int64_t ss0, int64_t ss1, float* final_state, T* y, int64_t channels, int64_t t0, int64_t t1,
                        int64_t c0, int64_t count, bool silu) {
  alignas(64) float window[K][kWideBlock], taps[K][kWideBlock], acc[kWideBlock], b[kWideBlock];
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t k = 0; k < K; ++k) taps[k][j] = w[(c0 + j) * K + k];
    for (int64_t k = 0; k < K - 1; ++k) window[k][j] = start ? start[(c0 + j) * ss1 + k] : 0.f;
    b[j] = bias ? bias[c0 + j] : 0.f;
  }
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetchTokens < t1)
      rnnserve::prefetch(x + (t + kPrefetchTokens) * xs0 + c0 * xs1, ((count - 1) * xs1 + 1) * sizeof(T));
    const T* row = x + t * xs0 + c0 * xs1;
    float* current = window[K - 1];
    if (xs1 == 1) {
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) current[j] = rnnserve::to_float(row[j]);
    } else {
      for (int64_t j = 0; j < count; ++j) current[j] = rnnserve::to_float(row[j * xs1]);
    }
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) acc[j] = b[j];
    for (int64_t k = 0; k < K; ++k) {
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) acc[j] += window[k][j] * taps[k][j];
    }
    if (silu) {
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) acc[j] = rnnserve::silu(rnnserve::round_to<T>(acc[j]));
    }
    T* out = y + t * channels + c0;
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) rnnserve::store_as(out, j, acc[j]);
    for (int64_t k = 0; k < K - 1; ++k) {
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) window[k][j] = window[k + 1][j];
    }
  }
  for (int64_t j = 0; j < count; ++j)
    for (int64_t k = 0; k < K - 1; ++k) final_state[(c0 + j) * (K - 1) + k] = window[k][j];
}

// Packed varlen prefill: x [T, C] (fp32 or bf16, any strides), weight [C, K] and bias [C] contiguous fp32,
// cu_seqlens [B + 1] int64, initial_state [B, C, K-1] fp32 (taps contiguous) or absent (zeros).
// Returns y [T, C] contiguous in x's dtype (SiLU'd when asked) and the final tails [B, C, K-1] fp32.
std::tuple<at::Tensor, at::Tensor> causal_conv1d_varlen(const at::Tensor& x, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias,
                                                        const at::Tensor& cu_seqlens,
                                                        const std::optional<at::Tensor>& initial_state, bool silu) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1), "x [T, C], weight [C, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be contiguous fp32");
  TORCH_CHECK(weight.size(1) >= 2 && weight.size(1) <= kMaxWidth, "the fused CPU conv supports widths 2-4");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous(), "cu_seqlens must be int64");
  const int64_t batch = cu_seqlens.size(0) - 1, channels = x.size(1), width = weight.size(1);
  const float* bias_ptr = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous(), "bias must be contiguous fp32");
    bias_ptr = bias->data_ptr<float>();
  }
  float* start = nullptr;
  int64_t ss0 = 0, ss1 = 0;
  if (initial_state) {
    const at::Tensor& s = *initial_state;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.stride(2) == 1, "initial_state: fp32 [B, C, K-1]");
    TORCH_CHECK(s.size(0) == batch && s.size(1) == channels && s.size(2) == width - 1, "initial_state shape");
    start = s.data_ptr<float>();
    ss0 = s.stride(0);
    ss1 = s.stride(1);
  }
  auto y = at::empty({x.size(0), channels}, x.options());
  auto final_state = at::empty({batch, channels, width - 1}, x.options().dtype(at::kFloat));
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t blocks = (channels + kWideBlock - 1) / kWideBlock;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const float* w = weight.data_ptr<float>();
    float* fp = final_state.data_ptr<float>();
    at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / blocks, c0 = (i % blocks) * kWideBlock, count = std::min(kWideBlock, channels - c0);
        float* s = start ? start + b * ss0 : nullptr;
        float* f = fp + b * channels * (width - 1);
        auto block = [&](auto kernel) {
          kernel(xp, x.stride(0), x.stride(1), w, bias_ptr, s, ss0, ss1, f, yp, channels, cu[b], cu[b + 1], c0,
                 count, silu);
        };
        if (width == 2)
          block(conv_prefill_block<2, T>);
        else if (width == 3)
          block(conv_prefill_block<3, T>);
        else
          block(conv_prefill_block<4, T>);
      }
    });
  };
  rnnserve::with_element_type(x.scalar_type(), run);
  return {y, final_state};
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "causal_conv1d_update(Tensor x, Tensor(a!) pool, Tensor weight, Tensor? bias, Tensor slot_ids, bool silu) "
      "-> Tensor",
      &causal_conv1d_update);
  m.def(
      "causal_conv1d_varlen(Tensor x, Tensor weight, Tensor? bias, Tensor cu_seqlens, Tensor? initial_state, "
      "bool silu) -> (Tensor, Tensor)",
      &causal_conv1d_varlen);
}
