// The middle of a Mamba-2 mixer decode step on CPU, between the conv update and out_proj, as one op:
//   x, B, C = silu(xBC)                                      (rounded to the model dtype, as the model does)
//   dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)   (fp32)
//   y = ssd_state_update(pool[slot_ids], x, dt, -exp(A_log), B, C, D)            (kernels/ssd, in place)
//   out = weight * rms_norm_per_group(y * silu(z))           (fp32 statistics, rounded as the model rounds)
// The PyTorch sequence is about 30 ops per layer; at batch 1 their dispatch cost a tenth of a Mamba-2 step.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "cpu_math.h"

namespace {
using OptTensor = std::optional<at::Tensor>;

// t[offset] as float, for the fp32 / bf16 tensors this op reads.
inline float read(const at::Tensor& t, int64_t offset) {
  return t.scalar_type() == at::kFloat ? t.data_ptr<float>()[offset]
                                       : static_cast<float>(t.data_ptr<at::BFloat16>()[offset]);
}

at::Tensor column_vector(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.numel() == numel, "mamba2_mixer_step: ", name, " must be [", numel, "]");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, ": fp32 or bf16");
  return t.contiguous();
}

// The step for activations of type T; see mamba2_mixer_step.
template <typename T>
at::Tensor step_typed(const at::Tensor& xbc, const at::Tensor& dt_raw, const at::Tensor& z, at::Tensor pool,
                      const at::Tensor& slot_ids, const at::Tensor& dt_bias, const at::Tensor& A_log,
                      const at::Tensor& D, const at::Tensor& norm_weight, int64_t groups, double eps, double dt_min,
                      double dt_max) {
  static const auto state_update =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("rnnserve::ssd_state_update", "")
          .typed<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  const int64_t batch = z.size(0), d_inner = z.size(1), heads = pool.size(1), head_dim = pool.size(2);
  const int64_t d_state = pool.size(3), bc = groups * d_state, group_size = d_inner / groups;
  const auto f32 = z.options().dtype(at::kFloat);
  at::Tensor x = at::empty({batch, heads, head_dim}, f32), B = at::empty({batch, groups, d_state}, f32);
  at::Tensor C = at::empty({batch, groups, d_state}, f32), dt = at::empty({batch, heads}, f32);
  at::Tensor A = at::empty({heads}, f32);
  float *xs = x.data_ptr<float>(), *bs = B.data_ptr<float>(), *cs = C.data_ptr<float>();
  float *dts = dt.data_ptr<float>(), *as = A.data_ptr<float>();
  const T *xbc_in = xbc.data_ptr<T>(), *dt_in = dt_raw.data_ptr<T>(), *z_in = z.data_ptr<T>();
  const T* weight = norm_weight.data_ptr<T>();
  for (int64_t h = 0; h < heads; ++h) as[h] = -std::exp(read(A_log, h));
  const auto silu_rounded = [](T v) { return static_cast<float>(static_cast<T>(rnnserve::silu(static_cast<float>(v)))); };
  for (int64_t b = 0; b < batch; ++b) {
    const T* row = xbc_in + b * xbc.stride(0);
    for (int64_t j = 0; j < d_inner; ++j) xs[b * d_inner + j] = silu_rounded(row[j]);
    for (int64_t j = 0; j < bc; ++j) {
      bs[b * bc + j] = silu_rounded(row[d_inner + j]);
      cs[b * bc + j] = silu_rounded(row[d_inner + bc + j]);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float v = rnnserve::softplus(static_cast<float>(dt_in[b * dt_raw.stride(0) + h]) + read(dt_bias, h));
      const float clamped = std::min(std::max(v, static_cast<float>(dt_min)), static_cast<float>(dt_max));
      dts[b * heads + h] = rnnserve::is_nan(v) ? v : clamped;  // torch.clamp keeps NaN; min/max took a limit
    }
  }
  const at::Tensor y = state_update.call(pool, slot_ids, x, dt, A, B, C, D).contiguous();  // held: ys points into it
  const float* ys = y.data_ptr<float>();

  at::Tensor out = at::empty({batch, d_inner}, z.options().memory_format(at::MemoryFormat::Contiguous));
  T* outs = out.data_ptr<T>();
  std::vector<float> gated(group_size);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t first = 0; first < d_inner; first += group_size) {
      const T* zs = z_in + b * z.stride(0) + first;
      float squares = 0.f;
      for (int64_t j = 0; j < group_size; ++j) {
        gated[j] = ys[b * d_inner + first + j] * rnnserve::silu(static_cast<float>(zs[j]));
        squares += gated[j] * gated[j];
      }
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(group_size) + static_cast<float>(eps));
      for (int64_t j = 0; j < group_size; ++j)
        outs[b * d_inner + first + j] =
            static_cast<T>(static_cast<float>(weight[first + j]) * static_cast<float>(static_cast<T>(gated[j] * scale)));
    }
  return out;
}

// xbc [B, d_inner + 2 G N] after the conv (before SiLU), dt_raw [B, H], z [B, d_inner] (the in_proj output's
// slices, any row stride, unit column stride), all in the model dtype (fp32 or bf16); pool [S, H, P, N] fp32;
// dt_bias, A_log, D [H]; norm_weight [d_inner] (one group of d_inner / G channels per B/C group). Returns the
// gated, normalised rows [B, d_inner] in the model dtype, ready for out_proj.
at::Tensor mamba2_mixer_step(const at::Tensor& xbc, const at::Tensor& dt_raw, const at::Tensor& z, at::Tensor pool,
                             const at::Tensor& slot_ids, const at::Tensor& dt_bias, const at::Tensor& A_log,
                             const at::Tensor& D, const at::Tensor& norm_weight, int64_t groups, double eps,
                             double dt_min, double dt_max) {
  TORCH_CHECK(xbc.dim() == 2 && dt_raw.dim() == 2 && z.dim() == 2 && pool.dim() == 4,
              "mamba2_mixer_step: xbc [B, C], dt [B, H], z [B, Di], pool [S, H, P, N]");
  const at::ScalarType dtype = z.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "mamba2_mixer_step: fp32 or bf16 activations");
  TORCH_CHECK(xbc.scalar_type() == dtype && dt_raw.scalar_type() == dtype, "xbc, dt and z: one dtype");
  TORCH_CHECK(xbc.stride(1) == 1 && dt_raw.stride(1) == 1 && z.stride(1) == 1, "unit column strides");
  const int64_t batch = z.size(0), d_inner = z.size(1), heads = pool.size(1), head_dim = pool.size(2);
  const int64_t d_state = pool.size(3);
  TORCH_CHECK(groups >= 1 && heads % groups == 0 && d_inner % groups == 0 && heads * head_dim == d_inner,
              "mamba2_mixer_step: H P must be d_inner and G must divide H");
  TORCH_CHECK(xbc.size(0) == batch && dt_raw.size(0) == batch && xbc.size(1) == d_inner + 2 * groups * d_state &&
                  dt_raw.size(1) == heads,
              "mamba2_mixer_step: xbc must be [B, d_inner + 2 G N] and dt [B, H]");
  const at::Tensor bias = column_vector(dt_bias, heads, "dt_bias"), a_log = column_vector(A_log, heads, "A_log");
  const at::Tensor weight = column_vector(norm_weight, d_inner, "norm_weight");
  TORCH_CHECK(weight.scalar_type() == dtype, "mamba2_mixer_step: norm_weight in the activations' dtype");
  return dtype == at::kFloat
             ? step_typed<float>(xbc, dt_raw, z, pool, slot_ids, bias, a_log, D, weight, groups, eps, dt_min, dt_max)
             : step_typed<at::BFloat16>(xbc, dt_raw, z, pool, slot_ids, bias, a_log, D, weight, groups, eps, dt_min,
                                        dt_max);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "mamba2_mixer_step(Tensor xbc, Tensor dt, Tensor z, Tensor(a!) pool, Tensor slot_ids, Tensor dt_bias, "
      "Tensor A_log, Tensor D, Tensor norm_weight, int groups, float eps, float dt_min, float dt_max) -> Tensor",
      &mamba2_mixer_step);
}
