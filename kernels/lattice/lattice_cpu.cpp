// Fused CPU kernel for Lattice's orthogonal state recurrence (packed varlen prefill and decode, in place on
// the state pool's slots).
//
// The recurrence has no parallel form: a PyTorch loop pays about twenty op dispatches per token and layer,
// which dominates CPU prefill. Here one work item owns one (sequence, head): it copies the head's [d, m] state
// from its slot into a slot-major [m][d] buffer (each memory slot contiguous, so every reduction is a
// contiguous dot product), runs all of the sequence's tokens on it and writes it back. Per token and slot:
//   n = |s|, phi = s / n;  DEC: e = phi(S) k - v, h = e, c = k;  ENC: c = phi(S)^T v - k, h = v;  SIM: h = -v, c = k
//   a = -gamma c / n;  s <- mu s + a (h - phi (phi . h))            (Eq. 13 and 16, a two-term update)
//   normalise: the same update rescaled per slot (no overflow for huge inputs), then s <- s / |s|   (Eq. 14)
//   y = S q.
// Same arithmetic as kernels/lattice/naive.py: lattice_step_ref. Inputs are fp32 (the wrapper converts them);
// q, k [T, H, m], v [T, H, d], gamma, mu [T, H] contiguous; y [T, H, d] fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {
constexpr float kTiny = 1e-30f;
enum Variant : int64_t { kDec = 0, kEnc = 1, kSim = 2 };

struct Problem {
  const float *q, *k, *v, *gamma, *mu;  // mu may be null (no forget gate)
  float* y;
  float* state;
  int64_t heads, dim, slots;
  int64_t stride_n, stride_h, stride_d, stride_m;
  int64_t variant;
  bool normalize;
};

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
  return acc;
}

// Tokens [bos, eos) of one sequence on head `head`, starting from and ending in the state at `slot`.
void scan_head(const Problem& p, int64_t bos, int64_t eos, int64_t slot, int64_t head) {
  const int64_t d = p.dim, m = p.slots;
  std::vector<float> buffer(static_cast<size_t>(m * d + 4 * d + 2 * m));
  float* s = buffer.data();  // [m][d]: slot i is s[i * d, (i + 1) * d)
  float* h = s + m * d;
  float* h_hat = h + d;
  float* col = h_hat + d;
  float* y = col + d;
  float* inv_n = y + d;
  float* c = inv_n + m;
  float* base = p.state + slot * p.stride_n + head * p.stride_h;
  for (int64_t j = 0; j < d; ++j)
    for (int64_t i = 0; i < m; ++i) s[i * d + j] = base[j * p.stride_d + i * p.stride_m];
  for (int64_t t = bos; t < eos; ++t) {
    const int64_t row = t * p.heads + head;
    const float *q = p.q + row * m, *k = p.k + row * m, *v = p.v + row * d;
    const float gamma = p.gamma[row], mu = p.mu ? p.mu[row] : 1.0f;
    for (int64_t i = 0; i < m; ++i) inv_n[i] = 1.0f / std::max(std::sqrt(dot(s + i * d, s + i * d, d)), kTiny);
    if (p.variant == kDec) {
      std::fill(h, h + d, 0.0f);
      for (int64_t i = 0; i < m; ++i) {
        const float w = k[i] * inv_n[i];
        const float* si = s + i * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) h[j] += w * si[j];
      }
      for (int64_t j = 0; j < d; ++j) h[j] -= v[j];
      std::copy(k, k + m, c);
    } else if (p.variant == kEnc) {
      std::copy(v, v + d, h);
      for (int64_t i = 0; i < m; ++i) c[i] = inv_n[i] * dot(s + i * d, v, d) - k[i];
    } else {
      for (int64_t j = 0; j < d; ++j) h[j] = -v[j];
      std::copy(k, k + m, c);
    }
    float scale = 1.0f;  // with normalisation the update is computed from h / max|h|
    if (p.normalize) {
      float top = 0.0f;
      for (int64_t j = 0; j < d; ++j) top = std::max(top, std::fabs(h[j]));
      scale = std::max(top, kTiny);
    }
    for (int64_t j = 0; j < d; ++j) h_hat[j] = h[j] / scale;
    std::fill(y, y + d, 0.0f);
    for (int64_t i = 0; i < m; ++i) {
      float* si = s + i * d;
      const float a = -gamma * c[i] * inv_n[i];
      const float r = inv_n[i] * dot(si, h_hat, d);  // phi_i . h_hat
      float coef_s = mu, coef_w = a;                 // s_i <- coef_s s_i + coef_w (h_hat - phi_i r)
      if (p.normalize) {
        const float b = a * scale, b_abs = std::fabs(b), denom = std::max(mu, b_abs);
        coef_s = denom > 0.0f ? mu / denom : 1.0f;
        coef_w = b_abs >= mu ? (b > 0.0f ? 1.0f : (b < 0.0f ? -1.0f : 0.0f)) : b / denom;
      }
      const float self = coef_s - coef_w * r * inv_n[i];
      float norm2 = 0.0f;
#pragma omp simd reduction(+ : norm2)
      for (int64_t j = 0; j < d; ++j) {
        col[j] = self * si[j] + coef_w * h_hat[j];
        norm2 += col[j] * col[j];
      }
      if (!p.normalize || norm2 > 0.0f) {
        const float inv = p.normalize ? 1.0f / std::sqrt(norm2) : 1.0f;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) si[j] = col[j] * inv;
      }
      const float qi = q[i];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) y[j] += qi * si[j];
    }
    std::copy(y, y + d, p.y + row * d);
  }
  for (int64_t j = 0; j < d; ++j)
    for (int64_t i = 0; i < m; ++i) base[j * p.stride_d + i * p.stride_m] = s[i * d + j];
}

// q, k [T, H, m], v [T, H, d], gamma, mu [T, H] fp32 contiguous; state [N, H, d, m] fp32 (any strides), rows
// slot_ids [B] (int64) updated in place. cu_seqlens [B + 1] (int64) packs B sequences; None means one token per
// sequence (decode). Returns y [T, H, d] fp32.
at::Tensor lattice_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& gamma,
                        const std::optional<at::Tensor>& mu, const std::optional<at::Tensor>& cu_seqlens,
                        at::Tensor state, const at::Tensor& slot_ids, int64_t variant, bool normalize) {
  for (const at::Tensor* t : {&q, &k, &v, &gamma, static_cast<const at::Tensor*>(&state)})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "lattice_scan: inputs and state must be fp32");
  for (const at::Tensor* t : {&q, &k, &v, &gamma})
    TORCH_CHECK(t->is_contiguous(), "lattice_scan: q, k, v, gamma must be contiguous");
  TORCH_CHECK(!mu || (mu->scalar_type() == at::kFloat && mu->is_contiguous()), "lattice_scan: mu must be fp32");
  TORCH_CHECK(state.dim() == 4 && v.dim() == 3 && q.dim() == 3, "lattice_scan: bad ranks");
  TORCH_CHECK(variant >= kDec && variant <= kSim, "lattice_scan: variant must be 0 (dec), 1 (enc) or 2 (sim)");
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous(), "slot_ids must be int64");
  auto y = at::empty(v.sizes(), v.options());
  const Problem p{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), gamma.data_ptr<float>(),
                  mu ? mu->data_ptr<float>() : nullptr, y.data_ptr<float>(), state.data_ptr<float>(),
                  v.size(1), v.size(2), q.size(2), state.stride(0), state.stride(1), state.stride(2),
                  state.stride(3), variant, normalize};
  const int64_t batch = slot_ids.size(0);
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  const int64_t* cu = nullptr;
  if (cu_seqlens) {
    TORCH_CHECK(cu_seqlens->scalar_type() == at::kLong && cu_seqlens->is_contiguous(), "cu_seqlens must be int64");
    TORCH_CHECK(cu_seqlens->size(0) == batch + 1, "cu_seqlens must have one more entry than slot_ids");
    cu = cu_seqlens->data_ptr<int64_t>();
  }
  at::parallel_for(0, batch * p.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / p.heads, head = w % p.heads;
      scan_head(p, cu ? cu[b] : b, cu ? cu[b + 1] : b + 1, slots[b], head);
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "lattice_scan(Tensor q, Tensor k, Tensor v, Tensor gamma, Tensor? mu, Tensor? cu_seqlens, Tensor(a!) state, "
      "Tensor slot_ids, int variant, bool normalize) -> Tensor",
      &lattice_scan);
}
