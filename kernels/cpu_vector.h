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

#if defined(__AVX512BF16__)
// 32 bf16 values for vdpbf16ps; `mask` selects the ones to read (the rest are zeros, which add nothing).
inline __m512bh load_bf16(const at::BFloat16* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

inline __m512bh load_bf16(const at::BFloat16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}
#endif

}  // namespace rnnserve
