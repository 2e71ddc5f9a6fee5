// The decode step of softmax attention over a per-slot key/value cache on CPU: query row b (one token of slot
// slot_ids[b] at position positions[b]) stores its key and value at that position, then attends to its slot's
// positions 0 .. positions[b], read where they lie in the cache [N, H, L, D]. One (row, head) a task: the store,
// one pass over the keys for the scores, an fp32 softmax, one pass over the values. (The store as an indexed
// assignment in PyTorch took 70 us a cache at batch 32, 5% of a looped transformer's step.) The PyTorch path made one SDPA call per row and converted each slot's cache prefix to
// fp32 first: for a looped transformer, whose 24 loops each attend, about 3,000 small copies and 768 calls a step
// at batch 32.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_math.h"

namespace {

template <typename T>
void decode_rows(const float* q, const T* k_new, const T* v_new, T* k_cache, T* v_cache, int64_t slot_stride,
                 int64_t head_stride, const int64_t* slots, const int64_t* positions, float scale, float* out,
                 int64_t rows, int64_t heads, int64_t dim) {
  at::parallel_for(0, rows * heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t task = first; task < last; ++task) {
      const int64_t r = task / heads, h = task % heads, count = positions[r] + 1;
      T* keys = k_cache + slots[r] * slot_stride + h * head_stride;
      T* values = v_cache + slots[r] * slot_stride + h * head_stride;
      std::copy(k_new + task * dim, k_new + (task + 1) * dim, keys + positions[r] * dim);
      std::copy(v_new + task * dim, v_new + (task + 1) * dim, values + positions[r] * dim);
      const float* query = q + task * dim;
      scores.resize(count);
      float top = -INFINITY;
      for (int64_t j = 0; j < count; ++j) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < dim; ++i) s += query[i] * static_cast<float>(keys[j * dim + i]);
        scores[j] = s * scale;
        top = std::max(top, scores[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < count; ++j) total += (scores[j] = rnnserve::fast_exp(scores[j] - top));
      float* o = out + task * dim;
      std::fill(o, o + dim, 0.f);
      for (int64_t j = 0; j < count; ++j) {
        const float p = scores[j] / total;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) o[i] += p * static_cast<float>(values[j * dim + i]);
      }
    }
  });
}

// q, k, v [R, H, D] (any float dtype); k_cache, v_cache [N, H, L, D] (fp32, bf16 or fp16; any slot stride, each
// slot's [H, L, D] with unit stride along D and rows D apart), written at the rows' slots and positions;
// slot_ids (distinct), positions [R] int64 with 0 <= position < L. Returns fp32 [R, H, D].
at::Tensor cached_attention_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                   at::Tensor v_cache, const at::Tensor& slot_ids, const at::Tensor& positions,
                                   double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "cached_attention_decode: q [R, H, D], caches [N, H, L, D]");
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "cached_attention_decode: q, k and v must match");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "cached_attention_decode: the caches must match");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), length = k_cache.size(2);
  TORCH_CHECK(k_cache.size(1) == heads && k_cache.size(3) == dim, "cached_attention_decode: cache rows are [H, L, D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == dim, "cached_attention_decode: cache rows must be contiguous");
  TORCH_CHECK(slot_ids.numel() == rows && positions.numel() == rows, "cached_attention_decode: one slot and position per row");
  const at::Tensor q32 = q.to(at::kFloat).contiguous();
  const at::Tensor slots = slot_ids.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < length, "cached_attention_decode: position ", p[r], " outside the cache");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(s[r] >= 0 && s[r] < k_cache.size(0), "cached_attention_decode: slot ", s[r], " outside the cache");
  at::Tensor out = at::empty({rows, heads, dim}, q.options().dtype(at::kFloat));
  if (rows == 0) return out;
  const at::Tensor k_rows = k.to(k_cache.scalar_type()).contiguous(), v_rows = v.to(v_cache.scalar_type()).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "cached_attention_decode", [&] {
    decode_rows<scalar_t>(q32.data_ptr<float>(), k_rows.data_ptr<scalar_t>(), v_rows.data_ptr<scalar_t>(),
                          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k_cache.stride(0),
                          k_cache.stride(1), s, p, static_cast<float>(scale), out.data_ptr<float>(), rows, heads, dim);
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "cached_attention_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_ids, Tensor positions, float scale) -> Tensor",
      &cached_attention_decode);
}
