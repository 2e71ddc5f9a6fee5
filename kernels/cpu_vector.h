// Vector types and loads shared by the weight-streaming CPU kernels (gemv, int8_linear; header-only, included by
// kernels/<op>/<op>_cpu.cpp). GCC vector extensions, so one source gives 16 fp32 lanes under AVX-512, 8 under
// AVX2 and plain vector code elsewhere (-march=native).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rnnserve {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
using vfloat = float __attribute__((vector_size(kLanes * 4)));
using vfloat_unaligned = float __attribute__((vector_size(kLanes * 4), aligned(4)));

inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_unaligned*>(p); }

// The first `count` (0 < count < kLanes) floats from p, zeros after: the tail of a row whose length is not a
// multiple of kLanes as one more vector step. (A scalar loop per row of x after the lane sums, a chain of up to 15
// dependent FMAs each, made K = 1500 take 1.3x K = 1536's time at 8 rows.)
inline vfloat load_partial(const float* p, int64_t count) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), p));
#elif defined(__AVX2__)
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes);
  return reinterpret_cast<vfloat>(_mm256_maskload_ps(p, mask));
#else
  vfloat v{};
  for (int64_t i = 0; i < count; ++i) v[i] = p[i];
  return v;
#endif
}

inline float lane_sum(vfloat v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Rows of fp32 x a kernel multiplies at a time with each weight row: at most kFp32ChunkBytes of x, fewer than
// `max_rows` when K is long, so that the chunk stays in L1 beside the weight stream (Zen 5, 48 KB L1: 8 rows of
// K = 2048 took 1.3x oneDNN's time, 4 rows at a time 0.84x; mingru-100m fp32 decode, K = 3072 in a third of its
// layers, 1.15-1.2x at batch 12-16). bf16 x for vdpbf16ps keeps its 8 rows: 5 at K = 3072 made mingru-100m's
// bf16 decode 7% slower at batch 8 and 24.
constexpr int64_t kFp32ChunkBytes = 32 * 1024;

inline int64_t fp32_chunk_rows(int64_t k, int64_t max_rows) {
  return std::clamp<int64_t>(kFp32ChunkBytes / std::max<int64_t>(1, k * 4), 1, max_rows);
}

// Rows of x in a chunk and the elements of K it covers per pass over a block of weights, so that the chunk's part
// of x stays in L1 while the weights stream past it. fp32 x takes fewer rows as K grows (fp32_chunk_rows); where
// that leaves one row of 8 or more, the chunk takes 4. A chunk whose rows exceed kOnePassBytes goes over K in
// equal passes of at most kFp32ChunkBytes, whole lines of 64 weights but the last; the kernel adds up each pass's
// sums. (Over the whole of K such a bf16 chunk read x from L2 for every vector of W, and one fp32 row a chunk read
// the block of W from L2 once per row of x. Zen 5, 48 KB L1, cold weights, gemv: bf16 at K = 4096 / 7680 and 8
// rows 18 / 16 -> 25 / 23 GB/s (oneDNN 25-28), at 32 rows 10 -> 14 (oneDNN 16); fp32 at K = 5120 / 7680 and 24
// rows 9 / 8 -> 15 / 14 GB/s. Passes lost at K = 2304 and 3072 in bf16 with 8 rows (hawk-100m decode 4%), and in
// fp32 at 2-3 rows of K = 7680 (10-20%).)
constexpr int64_t kOnePassBytes = 48 * 1024;

struct ChunkShape {
  int64_t rows;    // rows of x multiplied together with each row of W
  int64_t k_pass;  // elements of K per pass (k: one pass)
};

inline ChunkShape chunk_shape(int64_t rows, int64_t k, int64_t max_rows, int64_t x_element_bytes) {
  constexpr int64_t kFp32RowsInPasses = 4;
  int64_t chunk = max_rows;
  if (x_element_bytes == 4) {
    chunk = fp32_chunk_rows(k, max_rows);
    if (chunk == 1 && rows >= max_rows) chunk = std::min(kFp32RowsInPasses, max_rows);
  }
  chunk = std::min(chunk, rows);
  const int64_t x_bytes = chunk * x_element_bytes;
  if (rows == 1 || x_bytes * k <= kOnePassBytes) return {chunk, k};
  const int64_t fits = kFp32ChunkBytes / x_bytes;
  const int64_t passes = (k + fits - 1) / fits;
  return {chunk, ((k + passes - 1) / passes + 63) / 64 * 64};
}

#if defined(__AVX512BF16__)
// 32 bf16 values for vdpbf16ps; `mask` selects the ones to read (the rest are zeros, which add nothing).
inline __m512bh load_bf16(const at::BFloat16* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

inline __m512bh load_bf16(const at::BFloat16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}
#endif

}  // namespace rnnserve
