// The RG-LRU of Griffin / Hawk on CPU, from its two gates' pre-activations (block-diagonal GEMMs, done by ATen):
//   i = sigmoid(pre_i);  r = sigmoid(pre_r);  log_a = (-8 r) softplus(param)
//   a = exp(log_a), b = (x i) sqrt(1 - exp(2 log_a)); at a sequence's first token a = 0 and the root is 1
//   h = a h + b  (fp32)
// with every op's result rounded to the activations' dtype as the Hugging Face model computes it (see
// kernels/rg_lru/naive.py). rg_lru_scan is the packed varlen prefill (coefficients and scan in one pass over the
// inputs), rg_lru_step the decode step on pool slots, which returns h * y in the activations' dtype. The PyTorch
// path is about twenty elementwise ops per layer over [T, D] (the selects, exps, roots and roundings), a tenth of
// a hawk-100m prefill.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "cpu_bf16.h"
#include "cpu_math.h"

namespace {

// Token inputs with strides: x [T, D]; the gates' pre-activations [T, H, w] (a transposed batched-GEMM output).
template <typename T>
struct Inputs {
  const T *x, *pre_i, *pre_r, *softplus;
  const bool* first;
  int64_t x_row, pre_row, pre_head, width;
};

// The square root of v >= 0 (0 where v is 0: under -ffast-math a vectorised sqrt is x * rsqrt(x), NaN at 0).
inline float root_of(float v) { return v > 0.0f ? std::sqrt(v) : 0.0f; }

constexpr int64_t kChunk = 64;  // channels whose coefficients are computed before they are used

// Token t, head `head`, channels [c0, c0 + count) of the head (count <= kChunk): each channel's (a, b) with the
// reference's roundings. A head's channels are contiguous in every input, so the loop vectorises.
template <typename T>
__attribute__((always_inline)) inline void coefficients(const Inputs<T>& in, int64_t t, int64_t head, int64_t c0,
                                                        int64_t count, float* a, float* b) {
  using rnnserve::round_to;
  using rnnserve::to_float;
  const int64_t offset = head * in.width + c0;
  const T* pre_i = in.pre_i + t * in.pre_row + head * in.pre_head + c0;
  const T* pre_r = in.pre_r + t * in.pre_row + head * in.pre_head + c0;
  const T* x = in.x + t * in.x_row + offset;
  const T* softplus = in.softplus + offset;
  const float keep = in.first[t] ? 0.0f : 1.0f;  // a sequence's first token: a = 0 and a root of 1
#pragma omp simd
  for (int64_t c = 0; c < count; ++c) {
    // sigmoid(-inf) is 1 / (1 + e^88) here, not torch's 0, which made (x i) for an infinite x infinite where the
    // reference's inf * 0 is NaN; the select costs nothing beside the GEMMs that give pre_i.
    const float pre = to_float(pre_i[c]);
    const float gate_i = rnnserve::is_negative_infinity(pre) ? 0.0f : round_to<T>(rnnserve::sigmoid(pre));
    const float gate_r = round_to<T>(rnnserve::sigmoid(to_float(pre_r[c])));
    const float log_a = round_to<T>(round_to<T>(-8.0f * gate_r) * to_float(softplus[c]));
    const float root = round_to<T>(root_of(round_to<T>(1.0f - round_to<T>(rnnserve::fast_exp(2.0f * log_a)))));
    b[c] = round_to<T>(round_to<T>(to_float(x[c]) * gate_i) * (keep > 0.0f ? root : 1.0f));
    a[c] = keep * round_to<T>(rnnserve::fast_exp(log_a));
  }
}

template <typename T>
Inputs<T> inputs_of(const at::Tensor& x, const at::Tensor& pre_i, const at::Tensor& pre_r,
                    const at::Tensor& softplus, const at::Tensor& first) {
  return {x.data_ptr<T>(), pre_i.data_ptr<T>(), pre_r.data_ptr<T>(), softplus.data_ptr<T>(), first.data_ptr<bool>(),
          x.stride(0),     pre_i.stride(0),     pre_i.stride(1),     pre_i.size(2)};
}

void check_inputs(const at::Tensor& x, const at::Tensor& pre_i, const at::Tensor& pre_r, const at::Tensor& softplus,
                  const at::Tensor& first) {
  TORCH_CHECK(x.dim() == 2 && pre_i.dim() == 3 && pre_r.dim() == 3, "rg_lru: x [T, D], pre-activations [T, H, w]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rg_lru: x must be fp32 or bf16");
  for (const at::Tensor* t : {&pre_i, &pre_r, &softplus})
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "rg_lru: the gates and softplus(param) must have x's dtype");
  TORCH_CHECK(pre_i.sizes() == pre_r.sizes() && pre_i.strides() == pre_r.strides() && pre_i.stride(2) == 1,
              "rg_lru: both pre-activations [T, H, w] with the same strides, unit stride along w");
  TORCH_CHECK(pre_i.size(0) == x.size(0) && pre_i.size(1) * pre_i.size(2) == x.size(1) && x.stride(1) == 1,
              "rg_lru: pre-activations must cover x [T, D = H w], x with unit stride along D");
  TORCH_CHECK(softplus.dim() == 1 && softplus.numel() == x.size(1) && softplus.is_contiguous(),
              "rg_lru: softplus(param) must be contiguous [D]");
  TORCH_CHECK(first.scalar_type() == at::kBool && first.is_contiguous() && first.numel() == x.size(0),
              "rg_lru: first must be bool [T]");
}

// x [T, D]; pre_i, pre_r [T, H, w] (x's dtype, fp32 or bf16); softplus(param) [D]; first [T] bool; cu_seqlens
// [B + 1] int64; state [B, D] fp32 contiguous, the initial states overwritten with the final ones. Returns h [T, D]
// fp32. One task takes one sequence's head through all its tokens.
at::Tensor rg_lru_scan(const at::Tensor& x, const at::Tensor& pre_i, const at::Tensor& pre_r,
                       const at::Tensor& softplus, const at::Tensor& first, const at::Tensor& cu_seqlens,
                       at::Tensor state) {
  check_inputs(x, pre_i, pre_r, softplus, first);
  const int64_t total = x.size(0), dim = x.size(1), batch = state.size(0);
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 2 && state.size(1) == dim,
              "rg_lru_scan: state must be contiguous fp32 [B, D]");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() && cu_seqlens.numel() == batch + 1,
              "rg_lru_scan: cu_seqlens must be int64 [B + 1]");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == total, "rg_lru_scan: cu_seqlens must run from 0 to T");
  for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(cu[b] <= cu[b + 1], "rg_lru_scan: cu_seqlens must not decrease");
  auto h = at::empty({total, dim}, x.options().dtype(at::kFloat));
  const int64_t heads = pre_i.size(1), width = pre_i.size(2);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Inputs<T> in = inputs_of<T>(x, pre_i, pre_r, softplus, first);
    float* out = h.data_ptr<float>();
    float* states = state.data_ptr<float>();
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / heads, head = task % heads;
        float* carry = states + b * dim + head * width;
        alignas(64) float a[kChunk], gain[kChunk];
        for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
          float* row = out + t * dim + head * width;
          for (int64_t c0 = 0; c0 < width; c0 += kChunk) {
            const int64_t count = std::min(kChunk, width - c0);
            coefficients(in, t, head, c0, count, a, gain);
#pragma omp simd
            for (int64_t c = 0; c < count; ++c) row[c0 + c] = carry[c0 + c] = a[c] * carry[c0 + c] + gain[c];
          }
        }
      }
    });
  };
  rnnserve::with_element_type(x.scalar_type(), run);
  return h;
}

// One token per sequence: x, y [B, D] (y with unit stride along D); pre_i, pre_r [B, H, w]; softplus(param) [D];
// first [B] bool; pool [N, D] fp32 (any slot stride, unit stride along D) advanced in place at slot_ids [B] int64.
// Returns h * y [B, D] in x's dtype (h rounded to it first).
at::Tensor rg_lru_step(const at::Tensor& x, const at::Tensor& y, const at::Tensor& pre_i, const at::Tensor& pre_r,
                       const at::Tensor& softplus, const at::Tensor& first, at::Tensor pool,
                       const at::Tensor& slot_ids) {
  check_inputs(x, pre_i, pre_r, softplus, first);
  const int64_t batch = x.size(0), dim = x.size(1);
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type() && y.stride(1) == 1,
              "rg_lru_step: y must be x's shape and dtype, unit stride along D");
  TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.dim() == 2 && pool.size(1) == dim && pool.stride(1) == 1,
              "rg_lru_step: pool must be fp32 [N, D] with unit stride along D");
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous() && slot_ids.numel() == batch,
              "rg_lru_step: slot_ids must be int64 [B]");
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(slots[b] >= 0 && slots[b] < pool.size(0), "rg_lru_step: slot id out of range");
  auto out = at::empty({batch, dim}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Inputs<T> in = inputs_of<T>(x, pre_i, pre_r, softplus, first);
    const T* ys = y.data_ptr<T>();
    T* o = out.data_ptr<T>();
    float* rows = pool.data_ptr<float>();
    const int64_t heads = pre_i.size(1), width = pre_i.size(2);
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / heads, head = task % heads;
        float* carry = rows + slots[b] * pool.stride(0) + head * width;
        const T* gate = ys + b * y.stride(0) + head * width;
        T* row = o + b * dim + head * width;
        alignas(64) float a[kChunk], gain[kChunk];
        for (int64_t c0 = 0; c0 < width; c0 += kChunk) {
          const int64_t count = std::min(kChunk, width - c0);
          coefficients(in, b, head, c0, count, a, gain);
#pragma omp simd
          for (int64_t c = 0; c < count; ++c) {
            const float h = a[c] * carry[c0 + c] + gain[c];
            carry[c0 + c] = h;
            rnnserve::store_as(row, c0 + c, rnnserve::round_to<T>(h) * rnnserve::to_float(gate[c0 + c]));
          }
        }
      }
    });
  };
  rnnserve::with_element_type(x.scalar_type(), run);
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "rg_lru_scan(Tensor x, Tensor pre_i, Tensor pre_r, Tensor softplus, Tensor first, Tensor cu_seqlens, "
      "Tensor(a!) state) -> Tensor",
      &rg_lru_scan);
  m.def(
      "rg_lru_step(Tensor x, Tensor y, Tensor pre_i, Tensor pre_r, Tensor softplus, Tensor first, Tensor(a!) pool, "
      "Tensor slot_ids) -> Tensor",
      &rg_lru_step);
}
