// Fused CPU selective scan (packed varlen prefill) and state update (decode, in place on pool slots).
//
// A PyTorch formulation of the scan materialises exp(dt A) and dt B x as [tokens, d_inner, d_state]
// tensors and streams over them several times. These kernels keep a block of 64 channels' [64, d_state]
// state in L1, read every input once, and fuse dt's discretisation (bias + softplus), the D skip
// and the SiLU gate. Activations (x, dt, z, B, C) may be fp32 or bf16 and any 2-D strides (GEMM outputs are
// often transposed views); A, D, dt_bias and the states are fp32; y is fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <cmath>
#include <optional>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kBlock = 64;  // channels per work item of short runs (decode)
constexpr int64_t kWideBlock = 256;  // channels per work item of a prefill
constexpr int64_t kMaxState = 64;
constexpr int64_t kMinTokensByChannel = 4;  // shorter runs (decode) skip the state transposes
constexpr int64_t kPrefetchTokens = 2;  // how far ahead a long scan prefetches its input rows

template <typename T>
struct View2d {  // read-only [rows, cols] view with element strides
  const T* data;
  int64_t row_stride, col_stride;

  // out[0, count) = row i, columns [j0, j0 + count), as fp32; a plain (vectorisable) loop for unit strides.
  __attribute__((always_inline)) void load_row(int64_t i, int64_t j0, int64_t count, float* out) const {
    const T* p = data + i * row_stride + j0 * col_stride;
    if (col_stride == 1) {
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) out[j] = static_cast<float>(p[j]);
    } else {
      for (int64_t j = 0; j < count; ++j) out[j] = static_cast<float>(p[j * col_stride]);
    }
  }

  // Asks for row i, columns [j0, j0 + count) to be brought into cache (see rnnserve::prefetch).
  void prefetch_row(int64_t i, int64_t j0, int64_t count) const {
    if (data) rnnserve::prefetch(data + i * row_stride + j0 * col_stride, ((count - 1) * col_stride + 1) * sizeof(T));
  }
};

template <typename T>
View2d<T> view2d(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

template <typename T>
struct Args {
  View2d<T> x, dt, B, C, z;  // z.data null when absent
  const float *dt_bias, *A, *D;  // dt_bias, D may be null
  float* y;
  float* state;
  int64_t channels, d_state;
  bool softplus;
};

// Token t's inputs for channels [d0, d0 + width): B_t, C_t, x and the discretised dt (bias, softplus).
template <typename T>
__attribute__((always_inline)) inline void load_token(const Args<T>& a, int64_t t, int64_t d0, int64_t width,
                                                      int64_t N, const float* bias, float* Bt, float* Ct, float* xs,
                                                      float* delta) {
  a.B.load_row(t, 0, N, Bt);
  a.C.load_row(t, 0, N, Ct);
  a.x.load_row(t, d0, width, xs);
  a.dt.load_row(t, d0, width, delta);
  if (a.softplus) {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
      delta[j] = rnnserve::softplus(delta[j] + bias[j]);
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) delta[j] += bias[j];
  }
}

// y[t, d0 : d0 + width] = (acc + D x) * silu(z), or without the gate when z is absent.
template <typename T>
__attribute__((always_inline)) inline void write_output(const Args<T>& a, int64_t t, int64_t d0, int64_t width,
                                                        const float* acc, const float* skip, const float* xs,
                                                        float* zs) {
  float* y = a.y + t * a.channels + d0;
  if (a.z.data) {
    a.z.load_row(t, d0, width, zs);
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) y[j] = (acc[j] + skip[j] * xs[j]) * rnnserve::silu(zs[j]);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) y[j] = acc[j] + skip[j] * xs[j];
  }
}

#ifdef __AVX512F__
// Sixteen vectors -> one vector of their sums (lane j = sum of rows[j]): a transposing add tree, about three
// instructions per row where a horizontal sum per row takes eight.
__attribute__((always_inline)) inline __m512 sum_rows_of_16(const __m512* rows) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [r0 0+2, r1 0+2, r0 1+3, r1 1+3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]),
                             _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum of rows 4i .. 4i + 3
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scan_block's per-token state update for d_state 16, sixteen channels at a time: each channel's state row is
// one vector, and the sixteen C . h sums come out of one add tree. Decode is bound by streaming the states, so
// the rows 64 channels ahead are prefetched. Returns the channels done (a multiple of 16).
__attribute__((always_inline)) inline int64_t update_rows_of_16(float* h0, const float* A0, const float* Bt,
                                                                const float* Ct, const float* xs,
                                                                const float* delta, float* acc, int64_t width) {
  const __m512 b = _mm512_loadu_ps(Bt), c = _mm512_loadu_ps(Ct);
  alignas(64) float exps[16];
  __m512 products[16];
  int64_t j0 = 0;
  for (; j0 + 16 <= width; j0 += 16) {
    rnnserve::prefetch(h0 + (j0 + 64) * 16, 16 * 16 * sizeof(float));
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t j = j0 + i;
      float* hj = h0 + j * 16;
#pragma omp simd
      for (int64_t n = 0; n < 16; ++n) exps[n] = rnnserve::fast_exp_of_finite(delta[j] * A0[j * 16 + n]);
      const __m512 h = _mm512_fmadd_ps(_mm512_load_ps(exps), _mm512_loadu_ps(hj),
                                       _mm512_mul_ps(_mm512_set1_ps(delta[j] * xs[j]), b));
      _mm512_storeu_ps(hj, h);
      products[i] = _mm512_mul_ps(h, c);
    }
    _mm512_storeu_ps(acc + j0, sum_rows_of_16(products));
  }
  return j0;
}
#endif

// Tokens [t0, t1) of one sequence, channels [d0, d1), states at `state` ([channels, N] rows, updated in place):
// h[d, n] = exp(dt A) h + dt x B;  y[t, d] = (C_t . h[d] + D x) * silu(z).
// Per token, the per-channel math (softplus, skip, gate) runs as vector loops over the block's channels, and
// the state update as one vector over n per channel. NS > 0 fixes d_state at compile time.
template <int64_t NS, typename T>
void scan_block(const Args<T>& a, int64_t t0, int64_t t1, int64_t d0, int64_t d1, float* state) {
  const int64_t N = NS > 0 ? NS : a.d_state, width = d1 - d0;
  alignas(64) float Bt[kMaxState], Ct[kMaxState];
  alignas(64) float xs[kBlock], delta[kBlock], zs[kBlock], acc[kBlock], bias[kBlock], skip[kBlock];
  for (int64_t j = 0; j < width; ++j) {
    bias[j] = a.dt_bias ? a.dt_bias[d0 + j] : 0.f;
    skip[j] = a.D ? a.D[d0 + j] : 0.f;
  }
  float* h0 = state + d0 * N;
  const float* A0 = a.A + d0 * N;
  for (int64_t t = t0; t < t1; ++t) {
    load_token(a, t, d0, width, N, bias, Bt, Ct, xs, delta);
    int64_t j = 0;
#ifdef __AVX512F__
    if constexpr (NS == 16) j = update_rows_of_16(h0, A0, Bt, Ct, xs, delta, acc, width);
#endif
    for (; j < width; ++j) {
      float* hj = h0 + j * N;
      const float* Aj = A0 + j * N;
      const float dj = delta[j], uj = delta[j] * xs[j];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t n = 0; n < N; ++n) {
        const float hn = rnnserve::fast_exp_of_finite(dj * Aj[n]) * hj[n] + uj * Bt[n];
        hj[n] = hn;
        sum += hn * Ct[n];
      }
      acc[j] = sum;
    }
    write_output(a, t, d0, width, acc, skip, xs, zs);
  }
}

// scan_block for long runs of tokens over up to 256 channels: the state is transposed once into a local
// [N][256] buffer so that every per-token operation is a vector over channels (no horizontal sums), and each
// token reads 1 KB runs of its input rows (prefetched a few tokens ahead: rows of a packed batch are pages
// apart, which hardware prefetchers do not follow). The transposes are amortised over the tokens. Same
// arithmetic per element as scan_block.
template <int64_t NS, typename T>
void scan_block_by_channel(const Args<T>& a, int64_t t0, int64_t t1, int64_t d0, int64_t d1, float* state) {
  const int64_t N = NS > 0 ? NS : a.d_state, width = d1 - d0;
  alignas(64) float Bt[kMaxState], Ct[kMaxState];
  alignas(64) float xs[kWideBlock], delta[kWideBlock], zs[kWideBlock], acc[kWideBlock], bias[kWideBlock],
      skip[kWideBlock];
  std::vector<float> buffer(2 * N * kWideBlock);  // h and A, [N][kWideBlock] each
  float* h = buffer.data();
  float* A = h + N * kWideBlock;
  for (int64_t j = 0; j < width; ++j) {
    bias[j] = a.dt_bias ? a.dt_bias[d0 + j] : 0.f;
    skip[j] = a.D ? a.D[d0 + j] : 0.f;
    for (int64_t n = 0; n < N; ++n) {
      h[n * kWideBlock + j] = state[(d0 + j) * N + n];
      A[n * kWideBlock + j] = a.A[(d0 + j) * N + n];
    }
  }
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetchTokens < t1) {
      const int64_t ahead = t + kPrefetchTokens;
      a.x.prefetch_row(ahead, d0, width);
      a.dt.prefetch_row(ahead, d0, width);
      a.z.prefetch_row(ahead, d0, width);
      a.B.prefetch_row(ahead, 0, N);
      a.C.prefetch_row(ahead, 0, N);
    }
    load_token(a, t, d0, width, N, bias, Bt, Ct, xs, delta);
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
      xs[j] *= delta[j];  // u = dt x; x itself is re-read for the skip term below
      acc[j] = 0.f;
    }
    for (int64_t n = 0; n < N; ++n) {
      const float b = Bt[n], c = Ct[n];
      float* hn = h + n * kWideBlock;
      const float* An = A + n * kWideBlock;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const float v = rnnserve::fast_exp_of_finite(delta[j] * An[j]) * hn[j] + xs[j] * b;
        hn[j] = v;
        acc[j] += v * c;
      }
    }
    a.x.load_row(t, d0, width, xs);
    write_output(a, t, d0, width, acc, skip, xs, zs);
  }
  for (int64_t j = 0; j < width; ++j)
    for (int64_t n = 0; n < N; ++n) state[(d0 + j) * N + n] = h[n * kWideBlock + j];
}

// Channels [d0, d1) (at most kWideBlock) of tokens [t0, t1) of one sequence.
template <typename T>
void scan_range(const Args<T>& a, int64_t t0, int64_t t1, int64_t d0, int64_t d1, float* state) {
  if (t1 - t0 >= kMinTokensByChannel) {
    if (a.d_state == 16) return scan_block_by_channel<16>(a, t0, t1, d0, d1, state);
    return scan_block_by_channel<0>(a, t0, t1, d0, d1, state);
  }
  for (int64_t c = d0; c < d1; c += kBlock) {
    const int64_t c1 = std::min(c + kBlock, d1);
    switch (a.d_state) {
      case 16: scan_block<16>(a, t0, t1, c, c1, state); break;
      case 8: scan_block<8>(a, t0, t1, c, c1, state); break;
      default: scan_block<0>(a, t0, t1, c, c1, state);
    }
  }
}

const float* optional_f32(const std::optional<at::Tensor>& t) {
  if (!t) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "parameters must be contiguous fp32");
  return t->data_ptr<float>();
}

template <typename T>
Args<T> make_args(const at::Tensor& x, const at::Tensor& dt, const std::optional<at::Tensor>& dt_bias,
                  const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                  const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z, at::Tensor& y,
                  at::Tensor& state, bool softplus) {
  return Args<T>{view2d<T>(x),
                 view2d<T>(dt),
                 view2d<T>(B),
                 view2d<T>(C),
                 z ? view2d<T>(*z) : View2d<T>{nullptr, 0, 0},
                 optional_f32(dt_bias),
                 A.data_ptr<float>(),
                 optional_f32(D),
                 y.data_ptr<float>(),
                 state.data_ptr<float>(),
                 x.size(1),
                 A.size(1),
                 softplus};
}

// Runs f(scalar) with a value of the activations' element type (fp32 or bf16).
template <typename F>
void dispatch_activation_type(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16)
    f(at::BFloat16{});
  else
    f(float{});
}

void check_inputs(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C, const std::optional<at::Tensor>& z, const at::Tensor& state) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  for (const at::Tensor* t : {&dt, &B, &C})
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "x, dt, B, C and z must share a dtype");
  TORCH_CHECK(!z || z->scalar_type() == x.scalar_type(), "x, dt, B, C and z must share a dtype");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous(), "A must be contiguous fp32");
  TORCH_CHECK(A.size(1) <= kMaxState, "d_state > 64 is not supported by the fused CPU scan");
  TORCH_CHECK(state.scalar_type() == at::kFloat, "states must be fp32");
}

// Packed varlen prefill. x, dt, z [T, Dm]; dt_bias, D [Dm]; A [Dm, N]; B, C [T, N]; cu_seqlens [Bt + 1]
// (int64); state [Bt, Dm, N] contiguous, updated in place to the final states. Returns y [T, Dm] fp32.
at::Tensor selective_scan(const at::Tensor& x, const at::Tensor& dt, const std::optional<at::Tensor>& dt_bias,
                          const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                          const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                          const at::Tensor& cu_seqlens, at::Tensor state, bool softplus) {
  check_inputs(x, dt, A, B, C, z, state);
  TORCH_CHECK(state.is_contiguous(), "state must be contiguous [Bt, Dm, N]");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous(), "cu_seqlens must be int64");
  auto y = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t batch = cu_seqlens.size(0) - 1, channels = x.size(1), d_state = A.size(1);
  const int64_t blocks = (channels + kWideBlock - 1) / kWideBlock;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  dispatch_activation_type(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const Args<scalar_t> a = make_args<scalar_t>(x, dt, dt_bias, A, B, C, D, z, y, state, softplus);
    at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / blocks, d0 = (i % blocks) * kWideBlock;
        scan_range(a, cu[b], cu[b + 1], d0, std::min(d0 + kWideBlock, channels), a.state + b * channels * d_state);
      }
    });
  });
  return y;
}

// Decode, one token per sequence. pool [S, Dm, N] fp32 (slot rows may be strided, each row contiguous) is
// updated in place at slot_ids [Bt] (int64); x, dt, z [Bt, Dm]; B, C [Bt, N]. Returns y [Bt, Dm] fp32.
at::Tensor selective_state_update(at::Tensor pool, const at::Tensor& slot_ids, const at::Tensor& x,
                                  const at::Tensor& dt, const std::optional<at::Tensor>& dt_bias,
                                  const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                                  const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                  bool softplus) {
  check_inputs(x, dt, A, B, C, z, pool);
  TORCH_CHECK(pool.stride(2) == 1 && pool.stride(1) == A.size(1), "pool rows must be contiguous [Dm, N]");
  TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous(), "slot_ids must be int64");
  auto y = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t batch = x.size(0), channels = x.size(1), row_stride = pool.stride(0);
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  dispatch_activation_type(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const Args<scalar_t> a = make_args<scalar_t>(x, dt, dt_bias, A, B, C, D, z, y, pool, softplus);
    at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / blocks, d0 = (i % blocks) * kBlock;
        scan_range(a, b, b + 1, d0, std::min(d0 + kBlock, channels), a.state + slots[b] * row_stride);
      }
    });
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "selective_scan(Tensor x, Tensor dt, Tensor? dt_bias, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
      "Tensor cu_seqlens, Tensor(a!) state, bool softplus) -> Tensor",
      &selective_scan);
  m.def(
      "selective_state_update(Tensor(a!) pool, Tensor slot_ids, Tensor x, Tensor dt, Tensor? dt_bias, Tensor A, "
      "Tensor B, Tensor C, Tensor? D, Tensor? z, bool softplus) -> Tensor",
      &selective_state_update);
}
