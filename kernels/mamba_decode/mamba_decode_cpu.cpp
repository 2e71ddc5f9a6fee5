// One Mamba-1 mixer decode step as a single op on CPU:
//   x, z = in_proj(h);  x = silu(conv_update(x));  dt, B, C = x_proj(x);  dt = dt_proj(dt)
//   y = selective_state_update(x, dt, A, B, C, D, z);  return out_proj(y)
// It calls the other fused CPU kernels through the dispatcher and picks each GEMM path exactly as matmul_t
// (engine/models/layers/linear.py) does, so it computes the same numbers as the Python mixer. The Python step
// is about 30 calls plus their glue, which took about a quarter of a bf16 decode step at batch 1.
// mamba_decode_stack runs the whole layer loop of a decode step (mixer, residual add, next norm) in one call,
// for float projections or weight-only quantized ones (engine/quantize.py: Int8Linear, Int4Linear), which it
// multiplies with the int8_linear or int4_linear kernel exactly as the quantized Python mixer does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>

#include <optional>
#include <tuple>
#include <utility>

#include "onednn_linear.h"

namespace {
using OptTensor = std::optional<at::Tensor>;
constexpr int64_t kSkinnyMaxRows = 32;     // kernels/skinny_linear: MAX_ROWS
constexpr int64_t kSmallBatchRows = 128;   // engine/models/layers/linear.py: SMALL_BATCH_ROWS

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// How matmul_t (engine/models/layers/linear.py) routes float products: `gemv_rows` holds the most rows the gemv
// kernel takes for each projection (in, x, dt, out), by its dtype and inputs (kernels/gemv: row_limit; 0 when it
// is switched off), `upcast_bf16` says bf16 products beyond them run in fp32 (kernels/gemv: UPCAST_BF16_GEMM) and
// `onednn_fp32` that fp32 ones run oneDNN's inner product (kernels/gemv: ONEDNN_FP32_GEMM).
enum Projection { kIn, kX, kDt, kOut };

struct GemmRules {
  std::array<int64_t, 4> gemv_rows;
  bool upcast_bf16;
  bool onednn_fp32;
};

GemmRules gemm_rules(at::IntArrayRef gemv_rows, bool upcast_bf16, bool onednn_fp32) {
  TORCH_CHECK(gemv_rows.size() == 4, "gemv_rows: one limit per projection (in, x, dt, out)");
  return GemmRules{{gemv_rows[0], gemv_rows[1], gemv_rows[2], gemv_rows[3]}, upcast_bf16, onednn_fp32};
}

// x @ w^T + b, by the same rules as engine/models/layers/linear.py: linear. A `scale` marks a quantized weight:
// int8 with one scale per output row (the int8_linear kernel) or packed int4 (uint8) with one fp16 scale per group
// (int4_linear); float weights go by matmul_t's rules.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const OptTensor& scale, const OptTensor& b,
                   const GemmRules& rules, Projection which) {
  using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&);
  static const bool amx = find_op<bool()>("rnnserve::skinny_linear_available").call();
  static const auto skinny = find_op<Linear>("rnnserve::skinny_linear");
  static const auto gemv = find_op<Linear>("rnnserve::gemv");
  using Quantized = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&);
  static const auto int8_linear = find_op<Quantized>("rnnserve::int8_linear");
  static const auto int4_linear = find_op<Quantized>("rnnserve::int4_linear");
  if (scale.has_value())
    return (w.scalar_type() == at::kByte ? int4_linear : int8_linear).call(x, w, *scale, b);
  const int64_t rows = x.size(0);
  const bool unit_stride = x.stride(1) == 1 && w.stride(1) == 1;
  if (amx && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && rows >= 1 &&
      rows <= kSkinnyMaxRows && unit_stride)
    return skinny.call(x, w, b);
  if (x.scalar_type() == w.scalar_type() && rows >= 1 && rows <= rules.gemv_rows[which] && unit_stride)
    return gemv.call(x, w, b);
  if (rules.upcast_bf16 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    const OptTensor b32 = b.has_value() ? OptTensor(b->to(at::kFloat)) : std::nullopt;
    return at::linear(x.to(at::kFloat), w.to(at::kFloat), b32).to(at::kBFloat16);
  }
  if (rules.onednn_fp32 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
      (!b.has_value() || b->scalar_type() == at::kFloat))
    return rnnserve::onednn_linear(x, w, b);
  if (rows < 2 || rows > kSmallBatchRows) return at::linear(x, w, b);
  at::Tensor out = at::mm(w, x.t()).t();
  return b.has_value() ? out + *b : out;
}

// The quantized weights' scales of in_proj, x_proj and out_proj (each None for a float weight); dt_proj stays
// float.
struct QuantScales {
  OptTensor in_proj, x_proj, out_proj;
};

at::Tensor mixer_step(const at::Tensor& h, const at::Tensor& in_weight, const OptTensor& in_bias,
                      at::Tensor conv_pool, const at::Tensor& conv_weight, const OptTensor& conv_bias,
                      const at::Tensor& slot_ids, const at::Tensor& x_proj_weight, const at::Tensor& dt_proj_weight,
                      const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, at::Tensor ssm_pool,
                      const at::Tensor& out_weight, const OptTensor& out_bias, const QuantScales& scales,
                      const GemmRules& rules) {
  static const auto conv_update =
      find_op<at::Tensor(const at::Tensor&, at::Tensor, const at::Tensor&, const OptTensor&, const at::Tensor&, bool)>(
          "rnnserve::causal_conv1d_update");
  static const auto state_update =
      find_op<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                         bool)>("rnnserve::selective_state_update");
  TORCH_CHECK(h.dim() == 2, "h must be [B, d_model]");
  const int64_t d_inner = conv_weight.size(0), dt_rank = dt_proj_weight.size(1), d_state = A.size(1);
  const at::Tensor xz = project(h, in_weight, scales.in_proj, in_bias, rules, kIn);
  const at::Tensor z = xz.narrow(1, d_inner, d_inner);
  const at::Tensor x = conv_update.call(xz.narrow(1, 0, d_inner), conv_pool, conv_weight, conv_bias, slot_ids, true);
  const at::Tensor projected = project(x, x_proj_weight, scales.x_proj, std::nullopt, rules, kX);
  const at::Tensor dt =
      project(projected.narrow(1, 0, dt_rank), dt_proj_weight, std::nullopt, std::nullopt, rules, kDt);
  const at::Tensor y = state_update.call(ssm_pool, slot_ids, x, dt, dt_bias, A, projected.narrow(1, dt_rank, d_state),
                                         projected.narrow(1, dt_rank + d_state, d_state), D, z, true);
  return project(y.to(h.scalar_type()), out_weight, scales.out_proj, out_bias, rules, kOut);
}

at::Tensor mamba_mixer_decode(const at::Tensor& h, const at::Tensor& in_weight, const OptTensor& in_bias,
                              at::Tensor conv_pool, const at::Tensor& conv_weight, const OptTensor& conv_bias,
                              const at::Tensor& slot_ids, const at::Tensor& x_proj_weight,
                              const at::Tensor& dt_proj_weight, const at::Tensor& dt_bias, const at::Tensor& A,
                              const at::Tensor& D, at::Tensor ssm_pool, const at::Tensor& out_weight,
                              const OptTensor& out_bias, at::IntArrayRef gemv_rows, bool upcast_bf16,
                              bool onednn_fp32) {
  return mixer_step(h, in_weight, in_bias, std::move(conv_pool), conv_weight, conv_bias, slot_ids, x_proj_weight,
                    dt_proj_weight, dt_bias, A, D, std::move(ssm_pool), out_weight, out_bias, QuantScales{},
                    gemm_rules(gemv_rows, upcast_bf16, onednn_fp32));
}

// Every layer of a Mamba-1 decode step in one call (the Python loop costs a few dispatches per layer):
//   for each layer i:  out = mixer_i(normed);  normed, stream = residual_rms_norm(stream, out, norm_weights[i])
// starting from the first block's normed input and its residual stream; norm_weights[i] is block i + 1's
// norm, the last one the final norm (which does not round to the weight's dtype: see kernels/residual_rms_norm).
// conv_pool [N, L, Di, K-1] and ssm_pool [N, L, Di, Ns] are the whole pools; returns the final normed rows.
// in_scales/x_proj_scales/out_scales[i]: layer i's quantized weight scales, None where that weight is float.
at::Tensor mamba_decode_stack(const at::Tensor& normed_in, const at::Tensor& stream_in, at::TensorList norm_weights,
                              double eps, at::TensorList in_weights, const c10::List<OptTensor>& in_biases,
                              at::Tensor conv_pool, at::TensorList conv_weights,
                              const c10::List<OptTensor>& conv_biases,
                              const at::Tensor& slot_ids, at::TensorList x_proj_weights,
                              at::TensorList dt_proj_weights, at::TensorList dt_biases, at::TensorList As,
                              at::TensorList Ds, at::Tensor ssm_pool, at::TensorList out_weights,
                              const c10::List<OptTensor>& out_biases, const c10::List<OptTensor>& in_scales,
                              const c10::List<OptTensor>& x_proj_scales, const c10::List<OptTensor>& out_scales,
                              at::IntArrayRef gemv_rows, bool upcast_bf16, bool onednn_fp32) {
  static const auto add_norm =
      find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, const at::Tensor&, double, bool)>(
          "rnnserve::residual_rms_norm");
  const int64_t layers = static_cast<int64_t>(in_weights.size());
  TORCH_CHECK(static_cast<int64_t>(norm_weights.size()) == layers && conv_pool.size(1) == layers &&
                  ssm_pool.size(1) == layers,
              "mamba_decode_stack: one norm weight and one pool layer per mixer");
  const auto per_layer = [layers](const c10::List<OptTensor>& list) {
    return static_cast<int64_t>(list.size()) == layers;
  };
  TORCH_CHECK(per_layer(in_scales) && per_layer(x_proj_scales) && per_layer(out_scales),
              "mamba_decode_stack: one entry of each scale list per mixer");
  const GemmRules rules = gemm_rules(gemv_rows, upcast_bf16, onednn_fp32);
  at::Tensor normed = normed_in, stream = stream_in;
  for (int64_t i = 0; i < layers; ++i) {
    const QuantScales scales{in_scales.get(i), x_proj_scales.get(i), out_scales.get(i)};
    const at::Tensor out = mixer_step(normed, in_weights[i], in_biases.get(i), conv_pool.select(1, i),
                                      conv_weights[i], conv_biases.get(i), slot_ids, x_proj_weights[i],
                                      dt_proj_weights[i], dt_biases[i], As[i], Ds[i], ssm_pool.select(1, i),
                                      out_weights[i], out_biases.get(i), scales, rules);
    std::tie(normed, stream) = add_norm.call(stream, out, norm_weights[i], eps, i + 1 < layers);
  }
  return normed;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "mamba_mixer_decode(Tensor h, Tensor in_weight, Tensor? in_bias, Tensor(a!) conv_pool, Tensor conv_weight, "
      "Tensor? conv_bias, Tensor slot_ids, Tensor x_proj_weight, Tensor dt_proj_weight, Tensor dt_bias, Tensor A, "
      "Tensor D, Tensor(b!) ssm_pool, Tensor out_weight, Tensor? out_bias, int[] gemv_rows, bool upcast_bf16, "
      "bool onednn_fp32) -> Tensor",
      &mamba_mixer_decode);
  m.def(
      "mamba_decode_stack(Tensor normed, Tensor stream, Tensor[] norm_weights, float eps, Tensor[] in_weights, "
      "Tensor?[] in_biases, Tensor(a!) conv_pool, Tensor[] conv_weights, Tensor?[] conv_biases, Tensor slot_ids, "
      "Tensor[] x_proj_weights, Tensor[] dt_proj_weights, Tensor[] dt_biases, Tensor[] As, Tensor[] Ds, "
      "Tensor(b!) ssm_pool, Tensor[] out_weights, Tensor?[] out_biases, Tensor?[] in_scales, "
      "Tensor?[] x_proj_scales, Tensor?[] out_scales, int[] gemv_rows, bool upcast_bf16, bool onednn_fp32) -> Tensor",
      &mamba_decode_stack);
}
