// One decode step of Based's Taylor linear attention on CPU, in one pass over each sequence's state:
//   S += phi(k) v^T,  z += phi(k),  y = (phi(q) S) / (phi(q) . z + eps)        (per head; S [D, d], z [D], fp32)
// with the feature maps phi(q), phi(k) [D] (D = 1 + f + f^2) computed by the caller. The PyTorch path updated S
// in place, then read it again for the read-out, and its matmul copied S whenever the pool's slot rows were not
// one contiguous block (always: a slot holds every layer's states): three to four passes over a state of about
// 1.1 MB a layer and sequence for based-360m. Here each row of S is updated and multiplied while in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

namespace {

// phi_q, phi_k [B, H, D] fp32, v [B, H, d] fp32 (contiguous); s_pool [N, H, D, d], z_pool [N, H, D] fp32 with
// any slot strides, each slot's [H, D, d] / [H, D] contiguous.
void step(const float* phi_q, const float* phi_k, const float* v, float* s_pool, int64_t s_slot_stride, float* z_pool,
          int64_t z_slot_stride, const int64_t* slots, double eps, float* out, int64_t batch, int64_t heads,
          int64_t features, int64_t dim) {
  at::parallel_for(0, batch * heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / heads, h = task % heads;
      float* s = s_pool + slots[b] * s_slot_stride + h * features * dim;
      float* z = z_pool + slots[b] * z_slot_stride + h * features;
      const float* pq = phi_q + task * features;
      const float* pk = phi_k + task * features;
      const float* value = v + task * dim;
      float* y = out + task * dim;
      std::fill(y, y + dim, 0.f);
      float denominator = 0.f;
      for (int64_t i = 0; i < features; ++i) {
        const float key = pk[i], query = pq[i];
        float* row = s + i * dim;
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) {
          row[j] += key * value[j];
          y[j] += query * row[j];
        }
        z[i] += key;
        denominator += query * z[i];
      }
      const float inverse = 1.f / static_cast<float>(denominator + eps);
      for (int64_t j = 0; j < dim; ++j) y[j] *= inverse;
    }
  });
}

// phi_q, phi_k [B, H, D] and v [B, H, d] (any float dtype); s_pool [N, H, D, d] and z_pool [N, H, D] fp32 (a
// pool's layer views); slot_ids [B] int64, distinct. Updates the rows slot_ids in place; returns fp32 [B, H, d].
at::Tensor based_decode_step(const at::Tensor& phi_q, const at::Tensor& phi_k, const at::Tensor& v, at::Tensor s_pool,
                             at::Tensor z_pool, const at::Tensor& slot_ids, double eps) {
  TORCH_CHECK(phi_q.dim() == 3 && phi_q.sizes() == phi_k.sizes() && v.dim() == 3, "based_decode_step: phi [B, H, D], v [B, H, d]");
  const int64_t batch = phi_q.size(0), heads = phi_q.size(1), features = phi_q.size(2), dim = v.size(2);
  TORCH_CHECK(v.size(0) == batch && v.size(1) == heads, "based_decode_step: v must be [B, H, d]");
  TORCH_CHECK(s_pool.scalar_type() == at::kFloat && z_pool.scalar_type() == at::kFloat, "based_decode_step: fp32 pools");
  TORCH_CHECK(s_pool.dim() == 4 && s_pool.size(1) == heads && s_pool.size(2) == features && s_pool.size(3) == dim,
              "based_decode_step: s_pool must be [N, H, D, d]");
  TORCH_CHECK(z_pool.dim() == 3 && z_pool.size(0) == s_pool.size(0) && z_pool.size(1) == heads && z_pool.size(2) == features,
              "based_decode_step: z_pool must be [N, H, D]");
  TORCH_CHECK(s_pool.stride(3) == 1 && s_pool.stride(2) == dim && s_pool.stride(1) == features * dim &&
                  z_pool.stride(2) == 1 && z_pool.stride(1) == features,
              "based_decode_step: each slot's states must be contiguous");
  TORCH_CHECK(slot_ids.numel() == batch, "based_decode_step: one slot per row");
  const at::Tensor q32 = phi_q.to(at::kFloat).contiguous(), k32 = phi_k.to(at::kFloat).contiguous();
  const at::Tensor v32 = v.to(at::kFloat).contiguous(), slots = slot_ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({batch, heads, dim}, v.options().dtype(at::kFloat));
  if (batch == 0) return out;
  step(q32.data_ptr<float>(), k32.data_ptr<float>(), v32.data_ptr<float>(), s_pool.data_ptr<float>(), s_pool.stride(0),
       z_pool.data_ptr<float>(), z_pool.stride(0), slots.data_ptr<int64_t>(), eps, out.data_ptr<float>(), batch, heads,
       features, dim);
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "based_decode_step(Tensor phi_q, Tensor phi_k, Tensor v, Tensor(a!) s_pool, Tensor(b!) z_pool, Tensor slot_ids, "
      "float eps) -> Tensor",
      &based_decode_step);
}
