// Residual add + RMSNorm of a pre-norm block on CPU, in one pass per row, with the rounding steps of the
// Hugging Face Mamba / Mamba-2 blocks (see kernels/residual_rms_norm/naive.py: residual_rms_norm_ref):
//   new_stream = stream + delta                      (in the stream's dtype S: fp32 when residual_in_fp32)
//   x = U(new_stream);  y = U(x * rsqrt(mean(x^2) + eps));  normed = T(weight * y)
// where T is the weight's dtype and U is T for a block's norm or S for the final norm. Replaces the 8-10
// PyTorch ops (dtype conversions, pow, mean, rsqrt, products, the add) per norm of a decode step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_bf16.h"
#include "cpu_math.h"

#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>

namespace {

template <typename S, typename T, typename U>
void norm_rows(const S* stream, const T* delta, const T* weight, S* new_stream, T* normed, int64_t rows,
               int64_t hidden, int64_t stream_stride, int64_t delta_stride, int64_t delta_col_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* s = stream + r * stream_stride;
      S* out_stream = new_stream ? new_stream + r * hidden : nullptr;
      T* out = normed + r * hidden;
      float sum = 0.f;
      if (delta) {
        const T* d = delta + r * delta_stride;
        // Contiguous rows (a prefill's GEMM output) get their own loop: a runtime column stride vectorises as a
        // gather, which made a 1024-row prefill norm 2-3x slower than its memory traffic.
        auto add = [&](auto column_stride) {
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < hidden; ++j) {
            const float v = rnnserve::to_float(s[j]) + rnnserve::to_float(d[j * column_stride]);
            rnnserve::store_as(out_stream, j, v);
            const float x = rnnserve::round_to<U>(rnnserve::round_to<S>(v));
            sum += x * x;
          }
        };
        if (delta_col_stride == 1)
          add(std::integral_constant<int64_t, 1>{});
        else
          add(delta_col_stride);
        s = out_stream;
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < hidden; ++j) {
          const float x = rnnserve::round_to<U>(rnnserve::to_float(s[j]));
          sum += x * x;
        }
      }
      const float scale = rnnserve::torch_rsqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) {
        const float y = rnnserve::round_to<U>(rnnserve::round_to<U>(rnnserve::to_float(s[j])) * scale);
        rnnserve::store_as(out, j, rnnserve::to_float(weight[j]) * y);
      }
    }
  });
}

// stream [R, H] (fp32 or the weight's dtype, rows contiguous), delta [R, H] or None (the weight's dtype, any
// strides: a decode GEMM may return a transposed view), weight [H].
// Returns (normed [R, H] in the weight's dtype, new stream [R, H], or an empty tensor without delta).
std::tuple<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& stream, const std::optional<at::Tensor>& delta,
                                                     const at::Tensor& weight, double eps,
                                                     bool round_to_weight_dtype) {
  TORCH_CHECK(stream.dim() == 2 && stream.stride(1) == 1, "stream must be [R, H] with rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == stream.size(1), "weight must be [H]");
  const auto s_type = stream.scalar_type(), t_type = weight.scalar_type();
  TORCH_CHECK(t_type == at::kFloat || t_type == at::kBFloat16, "weight must be fp32 or bf16");
  TORCH_CHECK(s_type == at::kFloat || s_type == t_type, "stream must be fp32 or the weight's dtype");
  if (delta) {
    TORCH_CHECK(delta->scalar_type() == t_type, "delta must have the weight's dtype");
    TORCH_CHECK(delta->sizes() == stream.sizes(), "delta must have stream's shape");
  }
  const int64_t rows = stream.size(0), hidden = stream.size(1);
  auto normed = at::empty({rows, hidden}, weight.options());
  at::Tensor new_stream = delta ? at::empty({rows, hidden}, stream.options()) : at::empty({0}, stream.options());
  const float eps32 = static_cast<float>(eps);
  auto run = [&](auto s_tag, auto t_tag, auto u_tag) {
    using S = decltype(s_tag);
    using T = decltype(t_tag);
    using U = decltype(u_tag);
    norm_rows<S, T, U>(stream.data_ptr<S>(), delta ? delta->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                       delta ? new_stream.data_ptr<S>() : nullptr, normed.data_ptr<T>(), rows, hidden,
                       stream.stride(0), delta ? delta->stride(0) : 0, delta ? delta->stride(1) : 1, eps32);
  };
  if (t_type == at::kFloat)
    run(float{}, float{}, float{});
  else if (s_type == at::kBFloat16)
    run(at::BFloat16{}, at::BFloat16{}, at::BFloat16{});
  else if (round_to_weight_dtype)
    run(float{}, at::BFloat16{}, at::BFloat16{});
  else
    run(float{}, at::BFloat16{}, float{});
  return {normed, new_stream};
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "residual_rms_norm(Tensor stream, Tensor? delta, Tensor weight, float eps, bool round_to_weight_dtype) "
      "-> (Tensor, Tensor)",
      &residual_rms_norm);
}
