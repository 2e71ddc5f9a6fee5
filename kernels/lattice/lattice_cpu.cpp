// Fused CPU kernel for Lattice's orthogonal state recurrence (packed varlen prefill and decode, in place on
// the state pool's slots).
//
// The recurrence has no parallel form: a PyTorch loop pays about twenty op dispatches per token and layer,
// which dominates CPU prefill. Here one work item owns one (sequence, head) and runs all of the sequence's
// tokens on the head's [d, m] state in the pool's own layout, the m memory slots along vector lanes (in place
// when the slots are contiguous and fill whole vectors, else in a padded copy). Per token and slot:
//   n = |s|, phi = s / n;  DEC: e = phi(S) k - v, h = e, c = k;  ENC: c = phi(S)^T v - k, h = v;  SIM: h = -v, c = k
//   a = -gamma c / n;  s <- mu s + a (h - phi (phi . h))            (Eq. 13 and 16, a two-term update)
//   normalise: the same update rescaled per slot (no overflow for huge inputs), then s <- s / |s|   (Eq. 14)
//   y = S q.
// Per-slot sums (norms, phi^T h, phi^T v) run down the d rows with a vector accumulator; only S k and S q sum
// across lanes. A token is four passes over the state: S k (DEC), phi^T h, the update, then the rescale with
// y and the next token's norms. (A slot-major copy took six passes and four horizontal sums per slot, and a
// transpose in and out at every decode step.) Same arithmetic as kernels/lattice/naive.py: lattice_step_ref.
// Inputs are fp32 (the wrapper converts them); q, k [T, H, m], v [T, H, d], gamma, mu [T, H] contiguous;
// y [T, H, d] fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_math.h"
#include "cpu_vector.h"

namespace {
constexpr float kTiny = 1e-30f;
constexpr float kHuge = 1.0f / kTiny;  // 1 / |s| of a zero column, as the reference clamps it
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

using rnnserve::kLanes;
using rnnserve::load;
using rnnserve::vfloat;

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// A pass goes over the slots in blocks of NV vectors, down the d rows of each block, so that its per-slot sums
// stay in NV registers (sums kept in memory waited on their own stores at every row: 1.3x the time).
template <int NV>
struct Block {
  vfloat lanes[NV];

  static Block zero() { return Block{}; }
  static Block at(const float* p) {
    Block b;
    for (int v = 0; v < NV; ++v) b.lanes[v] = load(p + v * kLanes);
    return b;
  }
  void put(float* p) const {
    for (int v = 0; v < NV; ++v) store(p + v * kLanes, lanes[v]);
  }
};

// sq[i] = sum_j s[j, i]^2 over the d rows (row stride `ld`), slots [0, mp).
template <int NV>
void column_squares(const float* s, int64_t ld, int64_t d, int64_t mp, float* sq) {
  for (int64_t c = 0; c < mp; c += NV * kLanes) {
    Block<NV> acc = Block<NV>::zero();
    for (int64_t j = 0; j < d; ++j)
      for (int v = 0; v < NV; ++v) {
        const vfloat x = load(s + j * ld + c + v * kLanes);
        acc.lanes[v] += x * x;
      }
    acc.put(sq + c);
  }
}

// out[i] = scale[i] * sum_j s[j, i] x[j]: the per-slot dot products with a d-vector, down the rows.
template <int NV>
void column_dots(const float* s, int64_t ld, int64_t d, int64_t mp, const float* x, const float* scale,
                 float* out) {
  for (int64_t c = 0; c < mp; c += NV * kLanes) {
    Block<NV> acc = Block<NV>::zero();
    for (int64_t j = 0; j < d; ++j)
      for (int v = 0; v < NV; ++v) acc.lanes[v] += load(s + j * ld + c + v * kLanes) * x[j];
    for (int v = 0; v < NV; ++v) acc.lanes[v] *= load(scale + c + v * kLanes);
    acc.put(out + c);
  }
}

// out[j] = sum_i s[j, i] w[i]: the sums across lanes.
template <int NV>
void row_dots(const float* s, int64_t ld, int64_t d, int64_t mp, const float* w, float* out) {
  std::fill(out, out + d, 0.0f);
  for (int64_t c = 0; c < mp; c += NV * kLanes) {
    const Block<NV> weights = Block<NV>::at(w + c);
    for (int64_t j = 0; j < d; ++j) {
      vfloat acc{};
      for (int v = 0; v < NV; ++v) acc += load(s + j * ld + c + v * kLanes) * weights.lanes[v];
      out[j] += rnnserve::lane_sum(acc);
    }
  }
}

// Per-slot values of one token, each [mp] (m rounded up to whole blocks; zero past m).
struct SlotValues {
  float *sq, *inv_n, *q, *k, *c, *coef_s, *coef_w, *r;
};

// Tokens [bos, eos) of one sequence on head `head`, starting from and ending in the state at `slot`.
template <int NV>
void scan_head(const Problem& p, int64_t bos, int64_t eos, int64_t slot, int64_t head) {
  constexpr int64_t kBlock = NV * kLanes;
  const int64_t d = p.dim, m = p.slots, mp = (m + kBlock - 1) / kBlock * kBlock;
  float* base = p.state + slot * p.stride_n + head * p.stride_h;
  const bool in_place = p.stride_m == 1 && m == mp;
  std::vector<float> buffer(static_cast<size_t>((in_place ? 0 : d * mp) + d * mp + 8 * mp + 2 * d), 0.0f);
  float* s = in_place ? base : buffer.data();  // [d][ld]
  const int64_t ld = in_place ? p.stride_d : mp;
  float* u = buffer.data() + (in_place ? 0 : d * mp);  // the updated, not yet rescaled state [d][mp]
  float* values = u + d * mp;
  const SlotValues sv{values,          values + mp,     values + 2 * mp, values + 3 * mp,
                      values + 4 * mp, values + 5 * mp, values + 6 * mp, values + 7 * mp};
  float* h = values + 8 * mp;
  float* h_hat = h + d;
  std::vector<char> gone(mp);  // per slot: its update vanished this token
  if (!in_place)
    for (int64_t j = 0; j < d; ++j)
      for (int64_t i = 0; i < m; ++i) s[j * mp + i] = base[j * p.stride_d + i * p.stride_m];
  column_squares<NV>(s, ld, d, mp, sv.sq);
  for (int64_t t = bos; t < eos; ++t) {
    const int64_t row = t * p.heads + head;
    const float* v = p.v + row * d;
    const float gamma = p.gamma[row], mu = p.mu ? p.mu[row] : 1.0f;
    std::copy(p.q + row * m, p.q + row * m + m, sv.q);
    std::copy(p.k + row * m, p.k + row * m + m, sv.k);
#pragma omp simd
    for (int64_t i = 0; i < mp; ++i)
      sv.inv_n[i] = sv.sq[i] > 0.0f ? 1.0f / std::max(std::sqrt(sv.sq[i]), kTiny) : kHuge;
    if (p.variant == kDec) {
#pragma omp simd
      for (int64_t i = 0; i < mp; ++i) sv.c[i] = sv.k[i] * sv.inv_n[i];  // phi weights for S k
      row_dots<NV>(s, ld, d, mp, sv.c, h);
      for (int64_t j = 0; j < d; ++j) h[j] -= v[j];
      std::copy(sv.k, sv.k + mp, sv.c);
    } else if (p.variant == kEnc) {
      std::copy(v, v + d, h);
      column_dots<NV>(s, ld, d, mp, v, sv.inv_n, sv.c);
#pragma omp simd
      for (int64_t i = 0; i < mp; ++i) sv.c[i] -= sv.k[i];
    } else {
      for (int64_t j = 0; j < d; ++j) h[j] = -v[j];
      std::copy(sv.k, sv.k + mp, sv.c);
    }
    float scale = 1.0f;  // with normalisation the update is computed from h / max|h|
    if (p.normalize) {
      float top = 0.0f;
      for (int64_t j = 0; j < d; ++j) top = std::max(top, std::fabs(h[j]));
      scale = std::max(top, kTiny);
    }
    for (int64_t j = 0; j < d; ++j) h_hat[j] = h[j] / scale;
    column_dots<NV>(s, ld, d, mp, h_hat, sv.inv_n, sv.r);  // phi_i . h_hat
    // s_i <- coef_s s_i + coef_w (h_hat - phi_i r_i) = (coef_s - coef_w r_i / n_i) s_i + coef_w h_hat. With
    // normalisation, b = a scale, coef_s = mu / max(mu, |b|) and coef_w = b / max(mu, |b|), computed against
    // mu / scale so that nothing overflows (b does for huge inputs, and -ffast-math's divisions turn x / inf
    // into NaN on some targets).
    const float mu_scaled = mu / scale;
#pragma omp simd
    for (int64_t i = 0; i < mp; ++i) {
      const float a = -gamma * sv.c[i] * sv.inv_n[i];
      float coef_s = mu, coef_w = a;
      if (p.normalize) {
        const float a_abs = std::fabs(a);
        const bool capped = a_abs >= mu_scaled;  // |b| >= mu
        const bool zero = a_abs == 0.0f;         // then mu = 0 too: no update
        coef_s = capped && !zero ? mu_scaled / std::max(a_abs, kTiny) : 1.0f;
        coef_w = capped ? (a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : 0.0f)) : a / std::max(mu_scaled, kTiny);
      }
      sv.coef_s[i] = coef_s - coef_w * sv.r[i] * sv.inv_n[i];
      sv.coef_w[i] = coef_w;
    }
    for (int64_t c = 0; c < mp; c += kBlock) {  // u and its squared norms
      const Block<NV> self = Block<NV>::at(sv.coef_s + c), step = Block<NV>::at(sv.coef_w + c);
      Block<NV> acc = Block<NV>::zero();
      for (int64_t j = 0; j < d; ++j)
        for (int v = 0; v < NV; ++v) {
          const vfloat x = self.lanes[v] * load(s + j * ld + c + v * kLanes) + step.lanes[v] * h_hat[j];
          store(u + j * mp + c + v * kLanes, x);
          acc.lanes[v] += x * x;
        }
      acc.put(sv.sq + c);
    }
    // s = u / |u| per slot (without normalisation s = u); the same pass reads y = S q and the next token's
    // squared norms. A slot whose update vanished (possible only with mu = 0) keeps its old value.
    bool vanished = false;
    for (int64_t i = 0; i < mp; ++i) {
      const bool padding = i >= m;
      // NaN too (an infinite v or k made the update inf - inf): the reference's where(|u| > 0, u / |u|, s) keeps
      // the column then, and -ffast-math may compile !(x > 0) as x <= 0, false for NaN. Padding columns stay 0;
      // their update is not finite when gamma is (inf * 0), and y = S q would read it (0 * NaN).
      const bool not_positive = !(sv.sq[i] > 0.0f) || rnnserve::is_nan(sv.sq[i]);
      gone[i] = padding || (p.normalize && not_positive);
      vanished |= padding ? rnnserve::is_non_finite(sv.sq[i]) : gone[i];
      sv.inv_n[i] = gone[i] ? 0.0f : (p.normalize ? 1.0f / std::sqrt(sv.sq[i]) : 1.0f);
    }
    float* y = p.y + row * d;
    std::fill(y, y + d, 0.0f);
    for (int64_t c = 0; c < mp; c += kBlock) {
      const Block<NV> inv = Block<NV>::at(sv.inv_n + c), query = Block<NV>::at(sv.q + c);
      Block<NV> acc = Block<NV>::zero();
      for (int64_t j = 0; j < d; ++j) {
        float* sj = s + j * ld + c;
        if (vanished)
          for (int64_t i = 0; i < kBlock; ++i) sj[i] = gone[c + i] ? sj[i] : u[j * mp + c + i] * sv.inv_n[c + i];
        vfloat row_sum{};
        for (int v = 0; v < NV; ++v) {
          const vfloat x = vanished ? load(sj + v * kLanes) : load(u + j * mp + c + v * kLanes) * inv.lanes[v];
          store(sj + v * kLanes, x);
          row_sum += x * query.lanes[v];
          acc.lanes[v] += x * x;
        }
        y[j] += rnnserve::lane_sum(row_sum);
      }
      acc.put(sv.sq + c);
    }
  }
  if (!in_place)
    for (int64_t j = 0; j < d; ++j)
      for (int64_t i = 0; i < m; ++i) base[j * p.stride_d + i * p.stride_m] = s[j * mp + i];
}

// The state's slots in blocks of up to four vectors (64 slots under AVX-512, 32 under AVX2).
void scan_head_any(const Problem& p, int64_t bos, int64_t eos, int64_t slot, int64_t head) {
  switch (std::min<int64_t>(4, (p.slots + kLanes - 1) / kLanes)) {
    case 1: return scan_head<1>(p, bos, eos, slot, head);
    case 2: return scan_head<2>(p, bos, eos, slot, head);
    case 3: return scan_head<3>(p, bos, eos, slot, head);
    default: return scan_head<4>(p, bos, eos, slot, head);
  }
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
      scan_head_any(p, cu ? cu[b] : b, cu ? cu[b + 1] : b + 1, slots[b], head);
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
