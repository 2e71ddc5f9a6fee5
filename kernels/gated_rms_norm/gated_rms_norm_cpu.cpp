// Mamba-2's gated group RMSNorm on CPU, out = weight * RMSNorm(y * silu(z)) with statistics per group of channels,
// in one pass over each row's group, with the reference's roundings (kernels/gated_rms_norm/naive.py): y * silu(z)
// and the statistics in fp32, the normalised value rounded to z's dtype, its product with the weight rounded once.
// The reference is five ATen ops over [T, D] (the SiLU, two products, the powers and mean, the rounding), 8% of a
// mamba2-130m bf16 prefill.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_math.h"

namespace {

template <typename T>
void norm_rows(const float* y, int64_t y_row, const T* z, int64_t z_row, const T* weight, T* out, int64_t rows,
               int64_t width, int64_t group_size, float eps) {
  const int64_t groups = width / group_size;
  at::parallel_for(0, rows * groups, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> gated(group_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / groups, first = (task % groups) * group_size;
      const float* ys = y + r * y_row + first;
      const T* zs = z + r * z_row + first;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < group_size; ++j) {
        const float g = ys[j] * rnnserve::silu(rnnserve::to_float(zs[j]));
        gated[j] = g;
        squares += g * g;
      }
      const float scale = rnnserve::torch_rsqrt(squares / static_cast<float>(group_size) + eps);
      T* o = out + r * width + first;
#pragma omp simd
      for (int64_t j = 0; j < group_size; ++j)
        rnnserve::store_as(o, j, rnnserve::to_float(weight[first + j]) * rnnserve::round_to<T>(gated[j] * scale));
    }
  });
}

// y [T, D] fp32 (unit stride along D); z [T, D] (fp32 or bf16, unit stride along D); weight [D] of z's dtype,
// contiguous; groups dividing D. Returns [T, D] contiguous in z's dtype.
at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& z, const at::Tensor& weight, int64_t groups,
                          double eps) {
  TORCH_CHECK(y.dim() == 2 && z.sizes() == y.sizes(), "gated_rms_norm: y and z must both be [T, D]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.stride(1) == 1, "gated_rms_norm: y must be fp32, unit stride");
  TORCH_CHECK((z.scalar_type() == at::kFloat || z.scalar_type() == at::kBFloat16) && z.stride(1) == 1,
              "gated_rms_norm: z must be fp32 or bf16 with unit stride along D");
  TORCH_CHECK(weight.scalar_type() == z.scalar_type() && weight.is_contiguous() && weight.numel() == y.size(1),
              "gated_rms_norm: weight must be contiguous [D] in z's dtype");
  const int64_t rows = y.size(0), width = y.size(1);
  TORCH_CHECK(groups >= 1 && width % groups == 0, "gated_rms_norm: groups must divide D");
  auto out = at::empty({rows, width}, z.options().memory_format(at::MemoryFormat::Contiguous));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(y.data_ptr<float>(), y.stride(0), z.data_ptr<T>(), z.stride(0), weight.data_ptr<T>(),
                 out.data_ptr<T>(), rows, width, width / groups, static_cast<float>(eps));
  };
  rnnserve::with_element_type(z.scalar_type(), run);
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("gated_rms_norm(Tensor y, Tensor z, Tensor weight, int groups, float eps) -> Tensor", &gated_rms_norm);
}
