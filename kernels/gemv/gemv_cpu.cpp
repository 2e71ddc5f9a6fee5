// y = x W^T (+ bias) for a few rows of x (a decode batch) on CPU, streaming W once at memory bandwidth.
//
// With few rows a linear layer is bound by reading W from memory. Each thread takes a contiguous range of W's
// rows (OpenMP over output rows) and reads each row from memory once: its dot products with every row of x
// are accumulated in fp32 vector registers, x (small: it stays in L1/L2) being read as often as needed. bf16
// weights are widened to fp32 in registers. Written with GCC vector extensions (plus the bf16 load in AVX2 /
// AVX-512 intrinsics), so the same code compiles to 8 lanes on AVX2 and 16 on AVX-512 under -march=native, and
// to plain vector code elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_vector.h"

namespace {
using rnnserve::kLanes;
using rnnserve::lane_sum;
using rnnserve::load;
using rnnserve::vfloat;
using vhalf_unaligned = uint16_t __attribute__((vector_size(kLanes * 2), aligned(2)));
using vuint = uint32_t __attribute__((vector_size(kLanes * 4)));

constexpr int64_t kMaxRows = 64;                   // rows of x the op takes
constexpr int kRowChunk = 8;                       // rows of x whose accumulators live in registers at once
constexpr int64_t kMinBytesPerThread = 64 * 1024;  // smaller products run on one thread (a barrier costs more)
constexpr int64_t kBlockBytes = 128 * 1024;  // rows of W multiplied with every chunk of x before the next (L2)
// With 4 or more rows of x (8 for vdpbf16ps) a row of W takes long enough to multiply that the hardware
// prefetcher no longer keeps enough of the stream in flight: those loops ask for the weight kPrefetchBytes ahead.
// Zen 5, cold weights: fp32 at 8-12 rows 15-16 -> 22-28 GB/s (mamba-130m decode at batch 8 and 12 1.5x), bf16 at
// 8-12 rows 5-20% more; at 1-3 rows nothing changed.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int kPrefetchFromRows = 4;
constexpr int kPrefetchFromRowsBf16 = 8;

// bf16 -> fp32 is a shift into the high half: one widening load and one shift per vector.
inline vfloat load(const at::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vfloat>(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vfloat>(_mm256_slli_epi32(wide, 16));
#else
  const vuint wide = __builtin_convertvector(*reinterpret_cast<const vhalf_unaligned*>(p), vuint) << 16;
  return reinterpret_cast<vfloat>(wide);
#endif
}

using rnnserve::load_partial;

// load_partial for bf16 weights: the tail's bits copied into a zeroed vector's worth, then widened.
inline vfloat load_partial(const at::BFloat16* p, int64_t count) {
  at::BFloat16 tail[kLanes] = {};
  std::memcpy(tail, p, count * sizeof(at::BFloat16));
  return load(tail);
}

#if defined(__AVX512F__)
// sums[m] = the lane sum of v[m] for m < M; 8 vectors (a full chunk of x) by one transposing add tree (24
// instructions, where a horizontal sum takes about 8 apiece: at K = 768 the sums were 15% of a row's fp32 FMAs
// and 29% of its vdpbf16ps). 48 products of mamba2-130m's shapes, cold: 3-8% faster at 8-64 rows, fp32 and bf16.
// From 3 vectors, padded with zeros, the tree measured no better in a decode step at batch 4.
template <int M>
inline void lane_sums(const __m512* v, float* sums) {
  if constexpr (M < 8) {
    for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(v[m]);
  } else {
    __m512 r[8];
    for (int m = 0; m < 8; ++m) r[m] = m < M ? v[m] : _mm512_setzero_ps();
    __m512 pairs[4];  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of vectors a, b = r[2i], r[2i + 1]
    for (int i = 0; i < 4; ++i)
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
    __m512 quads[2];  // per 128-bit lane: that lane's sums of four vectors
    for (int i = 0; i < 2; ++i)
      quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 halves = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 total = _mm512_add_ps(_mm512_shuffle_f32x4(halves, halves, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(halves, halves, _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm512_castps512_ps256(total));
    for (int m = 0; m < M; ++m) sums[m] = out[m];
  }
}
#else
template <int M>
inline void lane_sums(const vfloat* v, float* sums) {
  for (int m = 0; m < M; ++m) sums[m] = lane_sum(v[m]);
}
#endif

// sums[m] = sum_j x[m, j] * row[j] for M rows of x (rows k apart), with U independent accumulators per row of
// x so that short dot products still keep several FMAs in flight.
template <int M, int U, typename W>
inline void dot_rows(const W* row, const float* x, int64_t k, int64_t x_stride, float* sums) {
  vfloat acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = vfloat{};
  int64_t j = 0;
  for (; j + U * kLanes <= k; j += U * kLanes) {
    for (int u = 0; u < U; ++u) {
      if constexpr (M >= kPrefetchFromRows)
        __builtin_prefetch(reinterpret_cast<const char*>(row + j + u * kLanes) + kPrefetchBytes);
      const vfloat wv = load(row + j + u * kLanes);
      for (int m = 0; m < M; ++m) acc[m][u] += wv * load(x + m * x_stride + j + u * kLanes);
    }
  }
  for (; j + kLanes <= k; j += kLanes) {
    const vfloat wv = load(row + j);
    for (int m = 0; m < M; ++m) acc[m][0] += wv * load(x + m * x_stride + j);
  }
  if (j < k) {
    const vfloat wv = load_partial(row + j, k - j);
    for (int m = 0; m < M; ++m) acc[m][0] += wv * load_partial(x + m * x_stride + j, k - j);
  }
  if constexpr (M < 8) {  // few rows of x (batch 1 among them): one horizontal sum each, as lane_sums would
    for (int m = 0; m < M; ++m) {
      vfloat total = acc[m][0];
      for (int u = 1; u < U; ++u) total += acc[m][u];
      sums[m] = lane_sum(total);
    }
  } else {
    vfloat totals[M];
    for (int m = 0; m < M; ++m) {
      totals[m] = acc[m][0];
      for (int u = 1; u < U; ++u) totals[m] += acc[m][u];
    }
    lane_sums<M>(totals, sums);
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Dot products of eight consecutive rows of W with one row of x (a batch-1 step): each row's accumulators are
// folded into one vector and the eight vectors are summed by one transposing add tree (six hadds, two lane
// swaps, an add) instead of a horizontal sum per row. Same-process A/B on a 2-core AVX2 EPYC, cold weights:
// 2-7% more read bandwidth on mamba-130m's in_proj, out_proj and LM head, 14-17% on the short-row dt_proj.
template <typename W>
inline void dot_eight_rows(const W* w, int64_t w_stride, const float* x, int64_t k, float* sums) {
  __m256 folded[8];
  for (int r = 0; r < 8; ++r) {
    const W* row = w + r * w_stride;
    vfloat acc[4] = {vfloat{}, vfloat{}, vfloat{}, vfloat{}};
    int64_t j = 0;
    for (; j + 4 * kLanes <= k; j += 4 * kLanes)
      for (int u = 0; u < 4; ++u) acc[u] += load(row + j + u * kLanes) * load(x + j + u * kLanes);
    for (; j + kLanes <= k; j += kLanes) acc[0] += load(row + j) * load(x + j);
    if (j < k) acc[1] += load_partial(row + j, k - j) * load_partial(x + j, k - j);
    folded[r] = reinterpret_cast<__m256>((acc[0] + acc[1]) + (acc[2] + acc[3]));
  }
  const __m256 h01 = _mm256_hadd_ps(folded[0], folded[1]), h23 = _mm256_hadd_ps(folded[2], folded[3]);
  const __m256 h45 = _mm256_hadd_ps(folded[4], folded[5]), h67 = _mm256_hadd_ps(folded[6], folded[7]);
  const __m256 low = _mm256_hadd_ps(h01, h23), high = _mm256_hadd_ps(h45, h67);
  _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                       _mm256_permute2f128_ps(low, high, 0x31)));
}
#endif

#if defined(__AVX512BF16__)
// bf16 weights and activations on CPUs with AVX512-BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids): one
// vdpbf16ps multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes, with no widening of the weight,
// so a row of W costs half the arithmetic instructions of the widening path (which made this kernel 2.4-8.7x
// slower than oneDNN's bf16 GEMM from 16 rows of x on a Zen 5). x stays bf16 (half the cache footprint).
using rnnserve::load_bf16;

// sums[m] = sum_j x[m, j] * row[j] for M rows of x (rows k apart), U accumulators per row of x.
template <int M, int U>
inline void dot_rows(const at::BFloat16* row, const at::BFloat16* x, int64_t k, int64_t x_stride, float* sums) {
  constexpr int64_t kPairs = 32;  // bf16 elements of one vdpbf16ps
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + U * kPairs <= k; j += U * kPairs) {
    for (int u = 0; u < U; ++u) {
      if constexpr (M >= kPrefetchFromRowsBf16)
        __builtin_prefetch(reinterpret_cast<const char*>(row + j + u * kPairs) + kPrefetchBytes);
      const __m512bh wv = load_bf16(row + j + u * kPairs);
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, load_bf16(x + m * x_stride + j + u * kPairs));
    }
  }
  for (; j < k; j += kPairs) {  // the last vectors, the final one masked to the row's end (zeros add nothing)
    const __mmask32 mask = k - j >= kPairs ? ~__mmask32{0} : static_cast<__mmask32>((1u << (k - j)) - 1);
    const __m512bh wv = load_bf16(row + j, mask);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, load_bf16(x + m * x_stride + j, mask));
  }
  __m512 totals[M];
  for (int m = 0; m < M; ++m) {
    totals[m] = acc[m][0];
    for (int u = 1; u < U; ++u) totals[m] = _mm512_add_ps(totals[m], acc[m][u]);
  }
  lane_sums<M>(totals, sums);
}
#endif

#if defined(__AVX512F__)
// With 8 rows of x the one-row loop above loads 9 vectors for 8 FMAs, and the load ports, not the FMA units, set
// its pace once W is in L2 (from 8 rows of x). Three rows of W at once load 11 vectors for 24 FMAs: 32 vector
// registers hold the 24 accumulators (AVX2's 16 do not, so it keeps one row).
constexpr int kRowsOfW = 3;

// sums[r * kRowChunk + m] = sum_j x[m, j] * w[r, j] for kRowsOfW rows of W (w_stride apart) and M rows of x.
// One accumulator array per row of W: GCC keeps arrays of up to 8 vectors in registers, not a [3][8] one.
template <int M, typename W>
inline void dot_block(const W* w, int64_t w_stride, const float* x, int64_t k, int64_t x_stride, float* sums) {
  static_assert(kRowsOfW == 3);
  vfloat a0[M], a1[M], a2[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = a2[m] = vfloat{};
  const W *w0 = w, *w1 = w + w_stride, *w2 = w + 2 * w_stride;
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes) {
    const vfloat v0 = load(w0 + j), v1 = load(w1 + j), v2 = load(w2 + j);
    for (int m = 0; m < M; ++m) {
      vfloat xv = load(x + m * x_stride + j);
      asm("" : "+v"(xv));  // one load into a register: GCC would fold it into each of the three FMAs
      a0[m] += v0 * xv;
      a1[m] += v1 * xv;
      a2[m] += v2 * xv;
    }
  }
  if (j < k) {
    const vfloat v0 = load_partial(w0 + j, k - j), v1 = load_partial(w1 + j, k - j);
    const vfloat v2 = load_partial(w2 + j, k - j);
    for (int m = 0; m < M; ++m) {
      const vfloat xv = load_partial(x + m * x_stride + j, k - j);
      a0[m] += v0 * xv;
      a1[m] += v1 * xv;
      a2[m] += v2 * xv;
    }
  }
  lane_sums<M>(a0, sums);
  lane_sums<M>(a1, sums + kRowChunk);
  lane_sums<M>(a2, sums + 2 * kRowChunk);
}

#if defined(__AVX512BF16__)
template <int M>
inline void dot_block(const at::BFloat16* w, int64_t w_stride, const at::BFloat16* x, int64_t k, int64_t x_stride,
                      float* sums) {
  constexpr int64_t kPairs = 32;
  __m512 a0[M], a1[M], a2[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = a2[m] = _mm512_setzero_ps();
  const at::BFloat16 *w0 = w, *w1 = w + w_stride, *w2 = w + 2 * w_stride;
  int64_t j = 0;
  for (; j + kPairs <= k; j += kPairs) {
    const __m512bh v0 = load_bf16(w0 + j), v1 = load_bf16(w1 + j), v2 = load_bf16(w2 + j);
    for (int m = 0; m < M; ++m) {
      __m512bh xv = load_bf16(x + m * x_stride + j);
      asm("" : "+v"(xv));
      a0[m] = _mm512_dpbf16_ps(a0[m], v0, xv);
      a1[m] = _mm512_dpbf16_ps(a1[m], v1, xv);
      a2[m] = _mm512_dpbf16_ps(a2[m], v2, xv);
    }
  }
  if (j < k) {  // the last vector, masked to the rows' end (zeros add nothing)
    const __mmask32 mask = static_cast<__mmask32>((1u << (k - j)) - 1);
    const __m512bh v0 = load_bf16(w0 + j, mask), v1 = load_bf16(w1 + j, mask), v2 = load_bf16(w2 + j, mask);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16(x + m * x_stride + j, mask);
      a0[m] = _mm512_dpbf16_ps(a0[m], v0, xv);
      a1[m] = _mm512_dpbf16_ps(a1[m], v1, xv);
      a2[m] = _mm512_dpbf16_ps(a2[m], v2, xv);
    }
  }
  lane_sums<M>(a0, sums);
  lane_sums<M>(a1, sums + kRowChunk);
  lane_sums<M>(a2, sums + 2 * kRowChunk);
}
#endif

// dot_block for a chunk of `rows` (<= kRowChunk) rows of x.
template <typename W, typename X>
inline void dot_block_chunk(const W* w, int64_t w_stride, const X* x, int64_t rows, int64_t k, int64_t x_stride,
                            float* sums) {
  switch (rows) {
    case 1: dot_block<1>(w, w_stride, x, k, x_stride, sums); break;
    case 2: dot_block<2>(w, w_stride, x, k, x_stride, sums); break;
    case 3: dot_block<3>(w, w_stride, x, k, x_stride, sums); break;
    case 4: dot_block<4>(w, w_stride, x, k, x_stride, sums); break;
    case 5: dot_block<5>(w, w_stride, x, k, x_stride, sums); break;
    case 6: dot_block<6>(w, w_stride, x, k, x_stride, sums); break;
    case 7: dot_block<7>(w, w_stride, x, k, x_stride, sums); break;
    default: dot_block<8>(w, w_stride, x, k, x_stride, sums); break;
  }
}

// y[m, r] for the chunk's rows of x and rows r of W from i0, kRowsOfW at a time while they fill a block, handed
// to store(m, r, sum); returns the first row left. Not inlined: in the loop that streams W one row at a time
// (batch 1 among others) its code made that loop 10-15% slower.
template <typename W, typename X, typename Store>
__attribute__((noinline)) int64_t block_rows(const W* w, int64_t w_stride, const X* x, int64_t x_stride, int64_t k,
                                             int64_t chunk, int64_t i0, int64_t i1, Store&& store) {
  float sums[kRowsOfW * kRowChunk];
  int64_t r = i0;
  for (; r + kRowsOfW <= i1; r += kRowsOfW) {
    dot_block_chunk(w + r * w_stride, w_stride, x, chunk, k, x_stride, sums);
    for (int q = 0; q < kRowsOfW; ++q)
      for (int64_t m = 0; m < chunk; ++m) store(m, r + q, sums[q * kRowChunk + m]);
  }
  return r;
}
#endif

// sums[m] for one chunk of `rows` (<= kRowChunk) rows of x, `x_stride` apart (fp32, or bf16 for the vdpbf16ps
// overload of dot_rows).
template <typename W, typename X>
inline void dot_chunk(const W* row, const X* x, int64_t rows, int64_t k, int64_t x_stride, float* sums) {
  switch (rows) {
    case 1: dot_rows<1, 4>(row, x, k, x_stride, sums); break;
    case 2: dot_rows<2, 2>(row, x, k, x_stride, sums); break;
    case 3: dot_rows<3, 2>(row, x, k, x_stride, sums); break;
    case 4: dot_rows<4, 1>(row, x, k, x_stride, sums); break;
    case 5: dot_rows<5, 1>(row, x, k, x_stride, sums); break;
    case 6: dot_rows<6, 1>(row, x, k, x_stride, sums); break;
    case 7: dot_rows<7, 1>(row, x, k, x_stride, sums); break;
    default: dot_rows<8, 1>(row, x, k, x_stride, sums); break;
  }
}

// Each thread reads its contiguous range of W's rows front to back: one sequential stream per core, which the
// hardware prefetchers follow (reading several rows side by side measured up to 1.8x slower from DRAM). The range
// is taken in blocks of about kBlockBytes: a block streams from memory while the first chunk of x's rows runs
// through it and stays in L2 for the other chunks, each chunk of x staying in L1 across the block. (Chunk by chunk
// over whole rows of W, x no longer fit L1 past ~16 rows and the kernel fell to 5-10 GB/s.) A chunk over K in
// passes adds each pass's sums into `partial` and writes y after the last; every pass after the first finds the
// block in L2, and the first reads it in pieces of k_pass elements, three rows at a time as well (as fast as one).
template <typename W, typename Y, typename X>
void gemv_typed(const W* w, int64_t w_stride, const X* x, int64_t x_stride, const float* bias, Y* y, int64_t rows,
                int64_t n, int64_t k) {
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(1, row_bytes));
  const rnnserve::ChunkShape shape = rnnserve::chunk_shape(rows, k, kRowChunk, sizeof(X));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float sums[kRowChunk];
    int64_t i = begin;
#if defined(__AVX2__) && !defined(__AVX512F__)
    if (rows == 1) {  // batch 1: eight rows of W per add tree (kRowChunk sums)
      for (; i + 8 <= end; i += 8) {
        dot_eight_rows(w + i * w_stride, w_stride, x, k, sums);
        for (int r = 0; r < 8; ++r) y[i + r] = static_cast<Y>(sums[r] + (bias ? bias[i + r] : 0.f));
      }
    }
#endif
    const int64_t block = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, row_bytes));
    std::vector<float> partial(shape.k_pass < k ? shape.rows * block : 0);
    for (int64_t i0 = i; i0 < end; i0 += block) {
      const int64_t i1 = std::min(end, i0 + block), block_rows_of_w = i1 - i0;
      for (int64_t m0 = 0; m0 < rows; m0 += shape.rows) {
        const int64_t chunk = std::min<int64_t>(shape.rows, rows - m0);
        const X* xm = x + m0 * x_stride;
        Y* ym = y + m0 * n;
        if (shape.k_pass == k) {
          const auto store = [&](int64_t m, int64_t r, float v) {
            ym[m * n + r] = static_cast<Y>(v + (bias ? bias[r] : 0.f));
          };
          int64_t r = i0;
#if defined(__AVX512F__)
          if (m0 > 0)  // the block of W is in L2 (the first chunk streamed it from memory)
            r = block_rows(w, w_stride, xm, x_stride, k, chunk, i0, i1, store);
#endif
          for (; r < i1; ++r) {
            dot_chunk(w + r * w_stride, xm, chunk, k, x_stride, sums);
            for (int64_t m = 0; m < chunk; ++m) store(m, r, sums[m]);
          }
          continue;
        }
        std::fill(partial.begin(), partial.begin() + chunk * block_rows_of_w, 0.f);
        const auto add = [&](int64_t m, int64_t r, float v) { partial[m * block_rows_of_w + r - i0] += v; };
        for (int64_t k0 = 0; k0 < k; k0 += shape.k_pass) {
          const int64_t pass = std::min(shape.k_pass, k - k0);
          int64_t r = i0;
#if defined(__AVX512F__)
          r = block_rows(w + k0, w_stride, xm + k0, x_stride, pass, chunk, i0, i1, add);
#endif
          for (; r < i1; ++r) {
            dot_chunk(w + r * w_stride + k0, xm + k0, chunk, pass, x_stride, sums);
            for (int64_t m = 0; m < chunk; ++m) add(m, r, sums[m]);
          }
        }
        for (int64_t m = 0; m < chunk; ++m)
          for (int64_t r = i0; r < i1; ++r)
            ym[m * n + r] = static_cast<Y>(partial[m * block_rows_of_w + r - i0] + (bias ? bias[r] : 0.f));
      }
    }
  });
}

// dst[i] = t[offset + i * stride] in fp32, for i < count (t: fp32 or bf16).
void widen(const at::Tensor& t, int64_t offset, int64_t count, int64_t stride, float* dst) {
  if (t.scalar_type() == at::kFloat) {
    const float* src = t.data_ptr<float>() + offset;
    for (int64_t i = 0; i < count; ++i) dst[i] = src[i * stride];
  } else {
    const at::BFloat16* src = t.data_ptr<at::BFloat16>() + offset;
    for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i * stride]);
  }
}

bool is_supported(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// An fp32 element of y holding its value rounded to bf16 (gemv_widened), assigned from the fp32 sum as a bf16
// element of y would be.
struct Bf16AsFloat {
  float value;
  Bf16AsFloat(float v) : value(rnnserve::round_to<at::BFloat16>(v)) {}
};
static_assert(sizeof(Bf16AsFloat) == sizeof(float), "Bf16AsFloat is stored as an fp32 tensor");

// Room in `buffer` for `rows` rows of k elements, zeroed, each starting on a 64-byte line and a whole number of lines
// long; returns the first row and sets `stride` (elements). Rows of x read in place from strides that are not whole
// lines have every vector operand straddle two cache lines.
template <typename T>
T* line_aligned_rows(std::vector<T>& buffer, int64_t rows, int64_t k, int64_t& stride) {
  constexpr int64_t per_line = 64 / sizeof(T);
  stride = (k + per_line - 1) / per_line * per_line;
  buffer.assign(rows * stride + per_line, T(0.0f));
  return buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64 / sizeof(T);
}

// y's elements for a bf16 product: bf16, or (widened) fp32 holding the bf16-rounded values.
template <typename Run>
void with_bf16_output(at::Tensor& y, Run&& run) {
  if (y.scalar_type() == at::kFloat)
    run(reinterpret_cast<Bf16AsFloat*>(y.data_ptr<float>()));
  else
    run(y.data_ptr<at::BFloat16>());
}

// x [M, K] (1 <= M <= 64, any strides), weight [N, K] (unit stride along K) of the same dtype (fp32 or bf16),
// bias [N] (fp32 or bf16) or None. Returns y [M, N] contiguous: fp32 accumulation, one rounding to x's dtype,
// and y in fp32 if `widened` (the same values; an LM head's logits, which would be converted next).
at::Tensor gemv_impl(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     bool widened) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "gemv: x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "gemv: CPU tensors only");
  TORCH_CHECK(is_supported(x.scalar_type()) && x.scalar_type() == weight.scalar_type(),
              "gemv: x and weight must both be fp32 or both bf16");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "gemv: weight has ", weight.size(1), " inputs, x has ", k);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "gemv takes 1 to ", kMaxRows, " rows, got ", rows);
  TORCH_CHECK(weight.stride(1) == 1 || k <= 1, "gemv: weight needs a unit stride along K");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "gemv: bias must be [N]");
    TORCH_CHECK(is_supported(bias->scalar_type()), "gemv: bias must be fp32 or bf16");
  }
  auto y = at::empty({rows, n}, x.options().dtype(widened ? at::kFloat : x.scalar_type()));
  // x and the bias are converted and packed here, not by ATen ops: at batch 1 those few-KB copies cost more in
  // dispatch than in work, dozens of times per decode step.
  std::vector<float> bias32;
  if (bias.has_value()) {
    bias32.resize(n);
    widen(*bias, 0, n, bias->stride(0), bias32.data());
  }
  const float* bias_data = bias.has_value() ? bias32.data() : nullptr;
  const int64_t w_stride = weight.stride(0);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {  // x stays bf16
    // Rows of x whose length is not a multiple of 32 are packed 64 bytes apart from a 64-byte boundary, with
    // zeros between: read from their own strides every vdpbf16ps operand of x straddled two cache lines, and
    // from 8 rows the kernel took twice its time (K = 1000 or 1500 against 992; Zen 5).
    std::vector<at::BFloat16> packed;
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    int64_t x_stride = x.stride(0);
    if (x.stride(1) != 1 || x.stride(0) != k || k % 32 != 0) {
      at::BFloat16* base = line_aligned_rows(packed, rows, k, x_stride);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < k; ++j) base[m * x_stride + j] = xb[m * x.stride(0) + j * x.stride(1)];
      xb = base;
    }
    with_bf16_output(y, [&](auto* out) {
      gemv_typed(weight.data_ptr<at::BFloat16>(), w_stride, xb, x_stride, bias_data, out, rows, n, k);
    });
    return y;
  }
#endif
  // fp32 rows of x are packed as the bf16 ones above unless they are contiguous whole cache lines: with every
  // load of x straddling two lines lstm-large's K = 1500 took 1.3-1.5x oneDNN's time from 8 rows (Zen 5).
  std::vector<float> packed_x;
  const float* xs = nullptr;
  int64_t x_stride = k;
  if (x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.stride(0) == k && k % 16 == 0) {
    xs = x.data_ptr<float>();
  } else {
    float* base = line_aligned_rows(packed_x, rows, k, x_stride);
    for (int64_t m = 0; m < rows; ++m) widen(x, m * x.stride(0), k, x.stride(1), base + m * x_stride);
    xs = base;
  }
  if (weight.scalar_type() == at::kFloat)
    gemv_typed(weight.data_ptr<float>(), w_stride, xs, x_stride, bias_data, y.data_ptr<float>(), rows, n, k);
  else
    with_bf16_output(y, [&](auto* out) {
      gemv_typed(weight.data_ptr<at::BFloat16>(), w_stride, xs, x_stride, bias_data, out, rows, n, k);
    });
  return y;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return gemv_impl(x, weight, bias, false);
}

// gemv(x, weight, bias) widened to fp32 in the same pass: for a bf16 LM head of 256K outputs at 32 rows, writing
// bf16 and converting it after took as long as a fifth of the head's own product.
at::Tensor gemv_widened(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return gemv_impl(x, weight, bias, true);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &gemv);
  m.def("gemv_widened(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &gemv_widened);
}
