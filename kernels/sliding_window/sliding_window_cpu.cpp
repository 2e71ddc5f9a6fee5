// One decode step of sliding-window softmax attention on CPU, reading each sequence's ring where it lies in
// the pool. A query at position p sees the ring's rows of positions p - W .. p - 1 (row r holds the latest
// position < p congruent to r mod W; rows never written are those with r >= p while p < W) and its own key.
// Each task is one (sequence, key/value head): the H / Hkv query heads of that key/value head score every
// visible ring row in one pass over the keys, take a softmax in fp32, and sum the values in one pass over the
// values; then the token's key and value replace ring row p mod W (the oldest visible one, read above). The
// PyTorch path gathered each ring, widened it to fp32 and appended the token (three copies of the ring a layer).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_math.h"

namespace {

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

// q [B, H, d], k, v [B, Hkv, d] fp32 contiguous; pools [N, W, Hkv, d] (unit stride inside a slot's ring).
template <typename P>
void decode_step(const float* q, const float* k, const float* v, const int64_t* positions, P* k_pool, P* v_pool,
                 int64_t slot_stride, const int64_t* slots, float scale, float* out, int64_t batch, int64_t heads,
                 int64_t kv_heads, int64_t dim, int64_t window) {
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(group * (window + 1));
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, p = positions[b];
      const int64_t visible = std::min(p, window);  // ring rows 0 .. visible - 1 (all of them once p >= W)
      P* k_ring = k_pool + slots[b] * slot_stride + h * dim;
      P* v_ring = v_pool + slots[b] * slot_stride + h * dim;
      const float* queries = q + (b * heads + h * group) * dim;
      const float* key = k + (b * kv_heads + h) * dim;
      const float* value = v + (b * kv_heads + h) * dim;
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * (window + 1);
        for (int64_t r = 0; r < visible; ++r) s[r] = scale * dot(queries + g * dim, k_ring + r * row_stride, dim);
        s[visible] = scale * dot(queries + g * dim, key, dim);
        float top = s[visible];
        for (int64_t r = 0; r < visible; ++r) top = std::max(top, s[r]);
        float total = 0.f;
        for (int64_t r = 0; r <= visible; ++r) total += (s[r] = rnnserve::fast_exp(s[r] - top));
        const float inverse = 1.f / total;
        for (int64_t r = 0; r <= visible; ++r) s[r] *= inverse;
      }
      float* o = out + (b * heads + h * group) * dim;
      std::fill(o, o + group * dim, 0.f);
      for (int64_t r = 0; r < visible; ++r)
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * (window + 1) + r], v_ring + r * row_stride, o + g * dim, dim);
      for (int64_t g = 0; g < group; ++g) axpy(scores[g * (window + 1) + visible], value, o + g * dim, dim);
      const int64_t row = (p % window) * row_stride;
      for (int64_t i = 0; i < dim; ++i) {
        k_ring[row + i] = static_cast<P>(key[i]);
        v_ring[row + i] = static_cast<P>(value[i]);
      }
    }
  });
}

// q [B, H, d], k, v [B, Hkv, d] (any float dtype), positions [B] int64 (>= 0), k_pool, v_pool [N, W, Hkv, d]
// (fp32, bf16 or fp16; any slot stride, each slot's ring contiguous), slot_ids [B] int64 (distinct). Returns fp32
// [B, H, d]; the token's key and value go to ring row positions mod W of each slot, in place.
at::Tensor sliding_window_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& positions, at::Tensor k_pool, at::Tensor v_pool,
                                 const at::Tensor& slot_ids, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "sliding_window_decode: q [B, H, d], k, v [B, Hkv, d]");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.strides() == v_pool.strides(),
              "sliding_window_decode: k_pool, v_pool must be [N, W, Hkv, d] alike");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "sliding_window_decode: pools must share a dtype");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  const int64_t window = k_pool.size(1);
  TORCH_CHECK(k.size(0) == batch && k.size(2) == dim && heads % kv_heads == 0, "sliding_window_decode: shapes");
  TORCH_CHECK(k_pool.size(2) == kv_heads && k_pool.size(3) == dim, "sliding_window_decode: pool rows are [Hkv, d]");
  TORCH_CHECK(k_pool.stride(3) == 1 && k_pool.stride(2) == dim && k_pool.stride(1) == kv_heads * dim,
              "sliding_window_decode: each slot's ring must be contiguous");
  TORCH_CHECK(positions.numel() == batch && slot_ids.numel() == batch, "sliding_window_decode: one position and slot per row");
  const at::Tensor q32 = q.to(at::kFloat).contiguous(), k32 = k.to(at::kFloat).contiguous();
  const at::Tensor v32 = v.to(at::kFloat).contiguous();
  const at::Tensor pos = positions.to(at::kLong).contiguous(), slots = slot_ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({batch, heads, dim}, q.options().dtype(at::kFloat));
  if (batch == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_pool.scalar_type(), "sliding_window_decode", [&] {
    decode_step<scalar_t>(q32.data_ptr<float>(), k32.data_ptr<float>(), v32.data_ptr<float>(), pos.data_ptr<int64_t>(),
                          k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(), k_pool.stride(0),
                          slots.data_ptr<int64_t>(), static_cast<float>(scale), out.data_ptr<float>(), batch, heads,
                          kv_heads, dim, window);
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "sliding_window_decode(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "Tensor slot_ids, float scale) -> Tensor",
      &sliding_window_decode);
}
