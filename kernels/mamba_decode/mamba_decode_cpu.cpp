// One Mamba-1 mixer decode step as a single op on CPU:
//   x, z = in_proj(h);  x = silu(conv_update(x));  dt, B, C = x_proj(x);  dt = dt_proj(dt)
//   y = selective_state_update(x, dt, A, B, C, D, z);  return out_proj(y)
// It calls the other fused CPU kernels through the dispatcher and picks each GEMM path exactly as matmul_t
// (engine/models/layers/linear.py) does, so it computes the same numbers as the Python mixer. The Python step
// is about 30 calls plus their glue, which took about a quarter of a bf16 decode step at batch 1.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {
using OptTensor = std::optional<at::Tensor>;
constexpr int64_t kSkinnyMaxRows = 32;     // kernels/skinny_linear: MAX_ROWS
constexpr int64_t kSmallBatchRows = 128;   // engine/models/layers/linear.py: SMALL_BATCH_ROWS

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// x @ w^T + b, by the same rules as engine/models/layers/linear.py: matmul_t.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
  static const bool amx = find_op<bool()>("rnnserve::skinny_linear_available").call();
  static const auto skinny =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>("rnnserve::skinny_linear");
  const int64_t rows = x.size(0);
  if (amx && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && rows >= 1 &&
      rows <= kSkinnyMaxRows && x.stride(1) == 1 && w.stride(1) == 1)
    return skinny.call(x, w, b);
  if (rows < 2 || rows > kSmallBatchRows) return at::linear(x, w, b);
  at::Tensor out = at::mm(w, x.t()).t();
  return b.has_value() ? out + *b : out;
}

at::Tensor mamba_mixer_decode(const at::Tensor& h, const at::Tensor& in_weight, const OptTensor& in_bias,
                              at::Tensor conv_pool, const at::Tensor& conv_weight, const OptTensor& conv_bias,
                              const at::Tensor& slot_ids, const at::Tensor& x_proj_weight,
                              const at::Tensor& dt_proj_weight, const at::Tensor& dt_bias, const at::Tensor& A,
                              const at::Tensor& D, at::Tensor ssm_pool, const at::Tensor& out_weight,
                              const OptTensor& out_bias) {
  static const auto conv_update =
      find_op<at::Tensor(const at::Tensor&, at::Tensor, const at::Tensor&, const OptTensor&, const at::Tensor&, bool)>(
          "rnnserve::causal_conv1d_update");
  static const auto state_update =
      find_op<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                         bool)>("rnnserve::selective_state_update");
  TORCH_CHECK(h.dim() == 2, "h must be [B, d_model]");
  const int64_t d_inner = conv_weight.size(0), dt_rank = dt_proj_weight.size(1), d_state = A.size(1);
  const at::Tensor xz = project(h, in_weight, in_bias);
  const at::Tensor z = xz.narrow(1, d_inner, d_inner);
  const at::Tensor x = conv_update.call(xz.narrow(1, 0, d_inner), conv_pool, conv_weight, conv_bias, slot_ids, true);
  const at::Tensor projected = project(x, x_proj_weight, std::nullopt);
  const at::Tensor dt = project(projected.narrow(1, 0, dt_rank), dt_proj_weight, std::nullopt);
  const at::Tensor y = state_update.call(ssm_pool, slot_ids, x, dt, dt_bias, A, projected.narrow(1, dt_rank, d_state),
                                         projected.narrow(1, dt_rank + d_state, d_state), D, z, true);
  return project(y.to(h.scalar_type()), out_weight, out_bias);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "mamba_mixer_decode(Tensor h, Tensor in_weight, Tensor? in_bias, Tensor(a!) conv_pool, Tensor conv_weight, "
      "Tensor? conv_bias, Tensor slot_ids, Tensor x_proj_weight, Tensor dt_proj_weight, Tensor dt_bias, Tensor A, "
      "Tensor D, Tensor(b!) ssm_pool, Tensor out_weight, Tensor? out_bias) -> Tensor",
      &mamba_mixer_decode);
}
