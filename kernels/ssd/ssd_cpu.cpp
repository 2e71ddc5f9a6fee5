// Mamba-2 (SSD) on CPU, per sequence b in slot s = slot_ids[b], head h (group g = h / (H / G)), token t:
//   state[s, h] = exp(dt[t, h] A[h]) state[s, h] + (dt[t, h] x[t, h, :]) B[t, g, :]^T     (fp32, in place)
//   y[t, h, :]  = state[s, h] C[t, g, :] + D[h] x[t, h, :]
// ssd_state_update is one decode step (kernels/ssd/torch_recurrent.py: ssd_state_update_torch) in one pass
// over the state; ssd_scan_varlen is the packed varlen prefill (kernels/ssd/torch_chunked.py), token by token.
// On a CPU the chunked (matmul) form of SSD does no fewer operations than the recurrence -- its state passing
// and chunk outputs are the same N x P products per token and head -- and PyTorch's version spends more than
// half of its time gathering chunks and in elementwise passes over [chunk, chunk] decay tables. Here one task
// keeps a head's block of up to 4 vectors of channels (64 under AVX-512) with its [N, block] state in L1 through
// the whole sequence: every input is read once and the state is read from and written to its pool slot once.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_vector.h"

namespace {
constexpr int64_t kMinHeadsPerTask = 8;  // a head is P x N state values (64 x 128: 32 KB)
constexpr int kScanVectors = 4;  // a prefill task's channels: 4 vectors (64 fp32 under AVX-512, 32 under AVX2)
constexpr int64_t kScanChannels = kScanVectors * rnnserve::kLanes;

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

// A token's inputs to one prefill task.
struct TokenInputs {
  rnnserve::vfloat xdt[kScanVectors];  // dt x, per channel
  float decay;                         // exp(dt A)
};

// Token inputs from x's channels (copied to `xs` as fp32; zeros past `width` stay from the caller) and dt.
template <typename T>
__attribute__((always_inline)) inline TokenInputs token_inputs(const T* x, float delta, float a, int64_t width,
                                                               float* xs) {
  for (int64_t p = 0; p < width; ++p) xs[p] = static_cast<float>(x[p]);
  TokenInputs in;
  for (int v = 0; v < kScanVectors; ++v) in.xdt[v] = rnnserve::load(xs + v * rnnserve::kLanes) * delta;
  in.decay = std::exp(delta * a);
  return in;
}

// y row of one token: the C . state sums plus the D skip, its `width` valid channels.
__attribute__((always_inline)) inline void write_row(const rnnserve::vfloat* sums, const float* xs, float d,
                                                     int64_t width, float* y) {
  alignas(64) float ys[kScanChannels];
  for (int v = 0; v < kScanVectors; ++v) {
    const rnnserve::vfloat out = sums[v] + rnnserve::load(xs + v * rnnserve::kLanes) * d;
    std::memcpy(ys + v * rnnserve::kLanes, &out, sizeof out);
  }
  std::copy(ys, ys + width, y);
}

// One prefill task: head h's channels [p0, p0 + width) of one sequence, tokens [begin, end). `state` is the
// task's [N, kScanChannels] fp32 state, transposed from the pool's [P, N] so that a token's update runs along
// channels in vector lanes: per state index n, state[n] = decay state[n] + B[n] (dt x) and y += C[n] state[n],
// with B[n] and C[n] broadcast (no horizontal sums). Tokens go in pairs, two updates per load and store of the
// state (one token a pass took 1.3x as long on Zen 5, mamba2-130m shapes: the loads and stores set the pace).
template <typename T>
void scan_channels(const T* x, int64_t x_row, const float* dt, int64_t dt_row, float a, const T* B, const T* C,
                   int64_t bc_row, float d, int64_t begin, int64_t end, int64_t width, int64_t d_state,
                   float* state, float* y, int64_t y_row) {
  using rnnserve::kLanes;
  using rnnserve::vfloat;
  alignas(64) float xs0[kScanChannels] = {}, xs1[kScanChannels] = {};
  int64_t t = begin;
  for (; t + 2 <= end; t += 2) {
    const TokenInputs in0 = token_inputs(x + t * x_row, dt[t * dt_row], a, width, xs0);
    const TokenInputs in1 = token_inputs(x + (t + 1) * x_row, dt[(t + 1) * dt_row], a, width, xs1);
    const T *b0 = B + t * bc_row, *c0 = C + t * bc_row, *b1 = b0 + bc_row, *c1 = c0 + bc_row;
    vfloat sums0[kScanVectors] = {}, sums1[kScanVectors] = {};
    for (int64_t n = 0; n < d_state; ++n) {
      const float bn0 = static_cast<float>(b0[n]), cn0 = static_cast<float>(c0[n]);
      const float bn1 = static_cast<float>(b1[n]), cn1 = static_cast<float>(c1[n]);
      float* row = state + n * kScanChannels;
      for (int v = 0; v < kScanVectors; ++v) {
        const vfloat s0 = rnnserve::load(row + v * kLanes) * in0.decay + in0.xdt[v] * bn0;
        const vfloat s1 = s0 * in1.decay + in1.xdt[v] * bn1;
        std::memcpy(row + v * kLanes, &s1, sizeof s1);
        sums0[v] += s0 * cn0;
        sums1[v] += s1 * cn1;
      }
    }
    write_row(sums0, xs0, d, width, y + t * y_row);
    write_row(sums1, xs1, d, width, y + (t + 1) * y_row);
  }
  if (t < end) {
    const TokenInputs in0 = token_inputs(x + t * x_row, dt[t * dt_row], a, width, xs0);
    const T *b0 = B + t * bc_row, *c0 = C + t * bc_row;
    vfloat sums0[kScanVectors] = {};
    for (int64_t n = 0; n < d_state; ++n) {
      const float bn0 = static_cast<float>(b0[n]), cn0 = static_cast<float>(c0[n]);
      float* row = state + n * kScanChannels;
      for (int v = 0; v < kScanVectors; ++v) {
        const vfloat s0 = rnnserve::load(row + v * kLanes) * in0.decay + in0.xdt[v] * bn0;
        std::memcpy(row + v * kLanes, &s0, sizeof s0);
        sums0[v] += s0 * cn0;
      }
    }
    write_row(sums0, xs0, d, width, y + t * y_row);
  }
}

// x [T, H, P] (fp32, bf16 or fp16, unit stride along P); dt [T, H] fp32 (already discretised); A [H] fp32;
// B, C [T, G, N] (x's dtype, unit stride along N, the same strides); D [H] or None; cu_seqlens [Bt + 1] int64;
// pool [S, H, P, N] fp32 with each slot's [H, P, N] contiguous, rows slot_ids [Bt] (int64, distinct) read as the
// initial states and overwritten with the final ones. Returns y [T, H, P] fp32 (with the D skip).
at::Tensor ssd_scan_varlen(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                           const at::Tensor& C, const std::optional<at::Tensor>& D, const at::Tensor& cu_seqlens,
                           at::Tensor pool, const at::Tensor& slot_ids) {
  TORCH_CHECK(x.dim() == 3 && dt.dim() == 2 && B.dim() == 3 && C.dim() == 3 && pool.dim() == 4,
              "ssd_scan_varlen: x [T, H, P], dt [T, H], B and C [T, G, N], pool [S, H, P, N]");
  const int64_t total = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t groups = B.size(1), d_state = B.size(2), batch = cu_seqlens.numel() - 1;
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "ssd_scan_varlen: x must be fp32, bf16 or fp16");
  TORCH_CHECK(B.scalar_type() == x.scalar_type() && C.scalar_type() == x.scalar_type(),
              "ssd_scan_varlen: x, B and C must share a dtype");
  TORCH_CHECK(x.stride(2) == 1 && B.stride(2) == 1 && C.stride(2) == 1 && B.strides() == C.strides(),
              "ssd_scan_varlen: x, B and C need unit strides along P and N, B and C the same strides");
  TORCH_CHECK(groups >= 1 && heads % groups == 0 && C.sizes() == B.sizes() && B.size(0) == total,
              "ssd_scan_varlen: B and C must be [T, G, N] with G dividing H");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.size(0) == total && dt.size(1) == heads && dt.stride(1) == 1,
              "ssd_scan_varlen: dt must be fp32 [T, H] with unit stride along H");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.numel() == heads && A.is_contiguous(),
              "ssd_scan_varlen: A must be contiguous fp32 [H]");
  TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.size(1) == heads && pool.size(2) == head_dim &&
                  pool.size(3) == d_state && pool.stride(3) == 1 && pool.stride(2) == d_state &&
                  pool.stride(1) == head_dim * d_state,
              "ssd_scan_varlen: pool must be fp32 [S, H, P, N] with each slot contiguous");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() && batch >= 0,
              "ssd_scan_varlen: cu_seqlens must be int64 [Bt + 1]");
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous() && slot_ids.numel() == batch,
              "ssd_scan_varlen: slot_ids must be int64 [Bt]");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  TORCH_CHECK(batch == 0 || (cu[0] == 0 && cu[batch] == total), "ssd_scan_varlen: cu_seqlens must run from 0 to T");
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(cu[b] <= cu[b + 1], "ssd_scan_varlen: cu_seqlens must not decrease");
    TORCH_CHECK(slots[b] >= 0 && slots[b] < pool.size(0), "ssd_scan_varlen: slot id out of range");
  }
  std::vector<float> d_values(heads, 0.f);
  if (D.has_value()) {
    TORCH_CHECK(D->numel() == heads && D->dim() == 1, "ssd_scan_varlen: D must be [H]");
    TORCH_CHECK(D->scalar_type() == at::kFloat || D->scalar_type() == at::kBFloat16, "D: fp32 or bf16");
    for (int64_t h = 0; h < heads; ++h) d_values[h] = value_at(*D, h * D->stride(0));
  }
  auto y = at::empty({total, heads, head_dim}, x.options().dtype(at::kFloat));
  const int64_t blocks = (head_dim + kScanChannels - 1) / kScanChannels, heads_per_group = heads / groups;
  float* state_base = pool.data_ptr<float>();
  const float* a = A.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ssd_scan_varlen", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* bs = B.data_ptr<scalar_t>();
    const scalar_t* cs = C.data_ptr<scalar_t>();
    // Sequences innermost: each thread's share of the tasks covers every sequence, whatever their lengths.
    at::parallel_for(0, heads * blocks * batch, 1, [&](int64_t first, int64_t last) {
      std::vector<float> buffer(d_state * kScanChannels);
      for (int64_t i = first; i < last; ++i) {
        const int64_t b = i % batch, h = i / batch / blocks, p0 = (i / batch % blocks) * kScanChannels;
        const int64_t width = std::min(kScanChannels, head_dim - p0), g = h / heads_per_group;
        if (cu[b] == cu[b + 1]) continue;
        float* slot = state_base + slots[b] * pool.stride(0) + (h * head_dim + p0) * d_state;
        std::fill(buffer.begin(), buffer.end(), 0.f);
        for (int64_t p = 0; p < width; ++p)
          for (int64_t n = 0; n < d_state; ++n) buffer[n * kScanChannels + p] = slot[p * d_state + n];
        scan_channels(xs + h * x.stride(1) + p0, x.stride(0), dt.data_ptr<float>() + h, dt.stride(0), a[h],
                      bs + g * B.stride(1), cs + g * C.stride(1), B.stride(0), d_values[h], cu[b], cu[b + 1], width,
                      d_state, buffer.data(), y.data_ptr<float>() + h * head_dim + p0, heads * head_dim);
        for (int64_t p = 0; p < width; ++p)
          for (int64_t n = 0; n < d_state; ++n) slot[p * d_state + n] = buffer[n * kScanChannels + p];
      }
    });
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "ssd_state_update(Tensor(a!) pool, Tensor slot_ids, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D) -> Tensor",
      &ssd_state_update);
  m.def(
      "ssd_scan_varlen(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor cu_seqlens, "
      "Tensor(a!) pool, Tensor slot_ids) -> Tensor",
      &ssd_scan_varlen);
}
