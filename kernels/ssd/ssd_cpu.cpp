// One Mamba-2 (SSD) decode step on CPU, per sequence b in slot s = slot_ids[b], head h (group g = h / (H / G)):
//   state[s, h] = exp(dt[b, h] A[h]) state[s, h] + (dt[b, h] x[b, h, :]) B[b, g, :]^T     (fp32, in place)
//   y[b, h, :]  = state[s, h] C[b, g, :] + D[h] x[b, h, :]
// as kernels/ssd/torch_recurrent.py: ssd_state_update_torch, in one pass over the state (the PyTorch step is
// about 15 ops per layer, a quarter of a batch-1 Mamba-2 step on CPU).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

namespace {
constexpr int64_t kMinHeadsPerTask = 8;  // a head is P x N state values (64 x 128: 32 KB)

float value_at(const at::Tensor& t, int64_t offset) {
  return t.scalar_type() == at::kFloat ? t.data_ptr<float>()[offset]
                                       : static_cast<float>(t.data_ptr<at::BFloat16>()[offset]);
}

// Copies t [B, R, C] (fp32 or bf16, any strides) into a packed fp32 buffer: the step reads each value P or N
// times, and this keeps the inner loops over contiguous fp32.
std::vector<float> packed_fp32(const at::Tensor& t) {
  const int64_t rows = t.size(0), mid = t.size(1), cols = t.size(2);
  std::vector<float> out(rows * mid * cols);
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t r = 0; r < mid; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out[(b * mid + r) * cols + c] = value_at(t, b * t.stride(0) + r * t.stride(1) + c * t.stride(2));
  return out;
}

// pool [S, H, P, N] fp32 (any slot stride, each slot's [H, P, N] contiguous); x [B, H, P]; dt [B, H] fp32
// (already discretised); A [H] fp32; B, C [B, G, N]; D [H] or None; slot_ids [B] int64. Returns y [B, H, P]
// fp32.
at::Tensor ssd_state_update(at::Tensor pool, const at::Tensor& slot_ids, const at::Tensor& x, const at::Tensor& dt,
                            const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                            const std::optional<at::Tensor>& D) {
  TORCH_CHECK(pool.dim() == 4 && x.dim() == 3 && dt.dim() == 2 && B.dim() == 3 && C.dim() == 3,
              "ssd_state_update: pool [S, H, P, N], x [B, H, P], dt [B, H], B and C [B, G, N]");
  const int64_t batch = x.size(0), heads = x.size(1), head_dim = x.size(2), d_state = pool.size(3);
  const int64_t groups = B.size(1);
  TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.size(1) == heads && pool.size(2) == head_dim &&
                  pool.stride(3) == 1 && pool.stride(2) == d_state && pool.stride(1) == head_dim * d_state,
              "ssd_state_update: pool must be fp32 [S, H, P, N] with each slot contiguous");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && A.scalar_type() == at::kFloat && A.numel() == heads &&
                  A.is_contiguous() && dt.size(0) == batch && dt.size(1) == heads,
              "ssd_state_update: dt [B, H] and A [H] must be fp32");
  TORCH_CHECK(groups >= 1 && heads % groups == 0 && C.size(1) == groups && B.size(2) == d_state &&
                  C.size(2) == d_state && B.size(0) == batch && C.size(0) == batch,
              "ssd_state_update: B and C must be [B, G, N] with G dividing H");
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous() && slot_ids.numel() == batch,
              "ssd_state_update: slot_ids must be int64 [B]");
  for (const at::Tensor* t : {&x, &B, &C})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, "x, B and C: fp32 or bf16");
  std::vector<float> d_values(heads, 0.f);
  if (D.has_value()) {
    TORCH_CHECK(D->numel() == heads && D->dim() == 1, "ssd_state_update: D must be [H]");
    TORCH_CHECK(D->scalar_type() == at::kFloat || D->scalar_type() == at::kBFloat16, "D: fp32 or bf16");
    for (int64_t h = 0; h < heads; ++h) d_values[h] = value_at(*D, h * D->stride(0));
  }
  const std::vector<float> xs = packed_fp32(x), bs = packed_fp32(B), cs = packed_fp32(C);
  auto y = at::empty({batch, heads, head_dim}, x.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  float* state = pool.data_ptr<float>();
  const float* a = A.data_ptr<float>();
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  const int64_t heads_per_group = heads / groups;
  at::parallel_for(0, batch * heads, kMinHeadsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, g = h / heads_per_group;
      const float delta = dt.data_ptr<float>()[b * dt.stride(0) + h * dt.stride(1)];
      const float decay = std::exp(delta * a[h]);
      const float* bv = bs.data() + (b * groups + g) * d_state;
      const float* cv = cs.data() + (b * groups + g) * d_state;
      const float* xv = xs.data() + (b * heads + h) * head_dim;
      float* s = state + slots[b] * pool.stride(0) + h * head_dim * d_state;
      for (int64_t p = 0; p < head_dim; ++p) {
        const float input = delta * xv[p];
        float* row = s + p * d_state;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < d_state; ++n) {
          const float next = row[n] * decay + input * bv[n];
          row[n] = next;
          acc += next * cv[n];
        }
        out[(b * heads + h) * head_dim + p] = acc + d_values[h] * xv[p];
      }
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "ssd_state_update(Tensor(a!) pool, Tensor slot_ids, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D) -> Tensor",
      &ssd_state_update);
}
