// y = (x W^T) * scale + bias for a weight-only int8 linear layer: W [N, K] int8 with one fp32 scale per
// output row, x [M, K] in the model's dtype (fp32, bf16 or fp16), fp32 accumulation, y [M, N] in x's dtype.
//
// Few rows (a decode batch): the layer is bound by streaming W, a quarter of the bytes of fp32. Each thread
// takes a contiguous range of W's rows and reads it once from memory, converting int8 -> fp32 in registers
// (16 lanes a vector on AVX-512, 8 on AVX2: GCC vector extensions, with intrinsics only for the conversion),
// with fp32 FMAs against the rows of x (the loops over W's rows and x's chunks: kernels/weight_stream.h). Up to 8
// rows of x, one weight row at a time, front to back: one sequential stream per core (tiles of 4 rows side by side
// streamed the 154 MB-fp32 LM head of mamba-130m at half the speed here),
// which the loop also prefetches a few KB ahead: on the Zen 3 VM where this was tuned, the hardware prefetchers
// alone left a cold int8 weight at about 80% of torch.sum's read bandwidth at batch 1 and the software prefetch
// brought it level (on a Zen 4 VM, against the loop without it: level at one row of x, 1.1-1.2x at eight). From 9 to
// 32 rows W's rows are taken in ~128 KB blocks that stay in L2 while x passes chunk by chunk of 8 rows (in L1),
// each chunk as a batch of 8 would. (Tiles of 4 weight rows x 2 rows of x over all of x, before, fell to half
// the 8-row throughput at 16 rows on a Zen 5: x left L1 and the 4 side-by-side streams lost the prefetchers.)
// The scale is applied once per output, after the K loop.
//
// Many rows (prefill): the product is bound by arithmetic, where a BLAS GEMM is far ahead of a hand-written
// loop. Blocks of W rows are dequantised (w * scale, exact in fp32 up to one rounding) for the fp32 GEMM
// (rnnserve::dequantized_gemm).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "cpu_vector.h"
#include "weight_stream.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

using rnnserve::kLanes;
using rnnserve::lane_sum;
using rnnserve::load;
using rnnserve::load_partial;
using rnnserve::vfloat;

constexpr int64_t kMaxStreamRows = 32;          // above this, the dequantise + GEMM path
constexpr int64_t kLine = 64;                   // int8 weights per cache line: one prefetch each
constexpr int64_t kPrefetchAhead = 2048;        // bytes of the weight stream prefetched ahead of the loads

// kLanes int8 weights as fp32 lanes (GCC scalarises a generic int8 -> float vector conversion).
inline vfloat load_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// sums[r] = sum_j row[j] * x[r, j] for R rows of x, with U independent accumulators per row of x so that a
// short dot product still keeps several FMAs in flight; each vector of weights is converted once for all R rows. The
// loop takes a cache line of weights a step and prefetches the line kPrefetchAhead bytes on (the rows of a
// thread's range follow each other in memory, so this runs into the next rows; prefetches never fault).
template <int R, int U>
inline void dot_rows(const int8_t* row, const float* x, int64_t x_stride, int64_t k, float* sums) {
  static_assert(kLine % (U * kLanes) == 0, "a step is whole groups of U vectors");
  vfloat acc[R][U];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[r][u] = vfloat{};
  int64_t j = 0;
  for (; j + kLine <= k; j += kLine) {
    __builtin_prefetch(row + j + kPrefetchAhead, 0, 3);
#pragma GCC unroll 8
    for (int v = 0; v < kLine / kLanes; ++v) {
      const vfloat wv = load_int8(row + j + v * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][v % U] += wv * load(x + r * x_stride + j + v * kLanes);
    }
  }
  for (; j + kLanes <= k; j += kLanes) {
    const vfloat wv = load_int8(row + j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] += wv * load(x + r * x_stride + j);
  }
  if (j < k) {  // the row's tail as one more vector step (see rnnserve::load_partial)
    int8_t tail[kLanes] = {};
    std::memcpy(tail, row + j, k - j);
    const vfloat wv = load_int8(tail);
    for (int r = 0; r < R; ++r) acc[r][0] += wv * load_partial(x + r * x_stride + j, k - j);
  }
  for (int r = 0; r < R; ++r) {
    vfloat total = acc[r][0];
    for (int u = 1; u < U; ++u) total += acc[r][u];
    sums[r] = lane_sum(total);
  }
}

#if defined(__AVX512BF16__)
constexpr int64_t kPairs = 32;  // int8 weights a vdpbf16ps step takes (16 lanes of bf16 pairs)
// From this many bf16 rows of x, vdpbf16ps; below, the fp32 loop on the widened rows (at 1 row the conversion
// bounds the bf16 loop: 0.75-0.85x the fp32 loop on mamba-130m's in_proj and out_proj on a Zen 5; level at 2,
// 1.1-1.2x at 3 and 4, 1.3-1.6x at 8-32).
constexpr int64_t kBf16DotFromRows = 3;

// 32 int8 weights as bf16 (exact: every int8 is a bf16 value), in order.
inline __m512bh int8_to_bf16(__m256i bytes) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(high, low);
}

inline __m512bh load_int8_as_bf16(const int8_t* p) {
  return int8_to_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512bh load_int8_as_bf16(const int8_t* p, __mmask32 mask) {
  return int8_to_bf16(_mm256_maskz_loadu_epi8(mask, p));
}

using rnnserve::load_bf16;

// dot_rows for bf16 rows of x on a CPU with bf16 dot products: each 32 weights are converted to bf16 once and
// multiplied with every row of x by vdpbf16ps (32 products a step, summed in pairs into fp32 lanes). A product of
// an int8 and a bf16 is exact in fp32, so this equals the fp32 loop on the widened x up to summation order; the
// conversion (5 instructions per 32 weights) is shared by the R rows, where the fp32 loop spends 2 per 16. Not
// inlined: inside the loops of kernels/weight_stream.h GCC moved each row of x's operand through the stack before
// its vdpbf16ps (12-25% slower at 8-32 rows on a Zen 5).
template <int R, int U>
__attribute__((noinline)) void dot_rows(const int8_t* row, const at::BFloat16* x, int64_t x_stride, int64_t k,
                                    float* sums) {
  static_assert(kLine % (U * kPairs) == 0, "a step is whole groups of U vectors");
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kLine <= k; j += kLine) {
    __builtin_prefetch(row + j + kPrefetchAhead, 0, 3);
    for (int v = 0; v < kLine / kPairs; ++v) {
      const __m512bh wv = load_int8_as_bf16(row + j + v * kPairs);
      for (int r = 0; r < R; ++r)
        acc[r][v % U] = _mm512_dpbf16_ps(acc[r][v % U], wv, load_bf16(x + r * x_stride + j + v * kPairs));
    }
  }
  for (; j + kPairs <= k; j += kPairs) {
    const __m512bh wv = load_int8_as_bf16(row + j);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, load_bf16(x + r * x_stride + j));
  }
  if (j < k) {
    const __mmask32 mask = static_cast<__mmask32>((1u << (k - j)) - 1);
    const __m512bh wv = load_int8_as_bf16(row + j, mask);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, load_bf16(x + r * x_stride + j, mask));
  }
  for (int r = 0; r < R; ++r) {
    __m512 total = acc[r][0];
    for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[r][u]);
    sums[r] = _mm512_reduce_add_ps(total);
  }
}
#endif

// dot_rows for 1..kStreamChunkRows rows of x (fp32, or bf16 where the CPU has bf16 dot products).
template <typename X>
inline void dot_few_rows(const int8_t* row, const X* x, int64_t x_stride, int64_t rows, int64_t k, float* sums) {
  constexpr int kVectorsPerLine = std::is_same_v<X, float> ? kLine / kLanes : 2;
  switch (rows) {
    case 1: dot_rows<1, kVectorsPerLine>(row, x, x_stride, k, sums); break;
    case 2: dot_rows<2, 2>(row, x, x_stride, k, sums); break;
    case 3: dot_rows<3, 2>(row, x, x_stride, k, sums); break;
    case 4: dot_rows<4, 2>(row, x, x_stride, k, sums); break;
    case 5: dot_rows<5, 1>(row, x, x_stride, k, sums); break;
    case 6: dot_rows<6, 1>(row, x, x_stride, k, sums); break;
    case 7: dot_rows<7, 1>(row, x, x_stride, k, sums); break;
    default: dot_rows<8, 1>(row, x, x_stride, k, sums); break;
  }
}

// x_rows: fp32, or bf16 where the CPU has bf16 dot products; y in out_t.
template <typename X, typename out_t>
void stream_rows(const at::Tensor& x_rows, const at::Tensor& weight, const float* scale, const float* bias,
                 at::Tensor& y) {
  const int8_t* w = weight.data_ptr<int8_t>();
  const int64_t w_stride = weight.stride(0);
  const auto dot = [=](int64_t i, int64_t k0, int64_t count, const X* xm, int64_t x_stride, int64_t chunk,
                       float* sums) { dot_few_rows(w + i * w_stride + k0, xm + k0, x_stride, chunk, count, sums); };
  const auto finish = [=](int64_t i, float sum) { return sum * scale[i] + (bias ? bias[i] : 0.f); };
  rnnserve::stream_weight_rows(x_rows.data_ptr<X>(), x_rows.stride(0), x_rows.size(0), x_rows.size(1),
                               weight.size(0), weight.size(1), y.data_ptr<out_t>(), dot, finish);
}

// x [M, K] float (fp32, bf16, fp16), weight [N, K] int8 (unit stride along K), scale [N] fp32, bias [N] or None.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [M, K] and weight [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight must be int8");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "x must be fp32, bf16 or fp16");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "weight has ", weight.size(1), " inputs, x has ", k);
  TORCH_CHECK(weight.stride(1) == 1 || k <= 1, "weight needs a unit stride along K");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n, "scale must be [N]");
  const at::Tensor scale32 = scale.to(at::kFloat).contiguous();
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [N]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  if (rows > kMaxStreamRows) {
    const int8_t* w = weight.data_ptr<int8_t>();
    const float* s = scale32.data_ptr<float>();
    const auto dequantize_row = [&](int64_t i, float* dst) {
      const int8_t* src = w + i * weight.stride(0);
      for (int64_t j = 0; j < k; ++j) dst[j] = static_cast<float>(src[j]) * s[i];
    };
    return rnnserve::dequantized_gemm(x.to(at::kFloat).contiguous(), n, bias32, dequantize_row).to(dtype);
  }
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* bias_data = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  const float* scale_data = scale32.data_ptr<float>();
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16 && rows >= kBf16DotFromRows) {
    const at::Tensor x_rows = x.stride(1) == 1 || k <= 1 ? x : x.contiguous();
    stream_rows<at::BFloat16, at::BFloat16>(x_rows, weight, scale_data, bias_data, y);
    return y;
  }
#endif
  at::Tensor x32 = x.to(at::kFloat);
  if (x32.stride(1) != 1 && k > 1) x32 = x32.contiguous();
  if (dtype == at::kFloat)
    stream_rows<float, float>(x32, weight, scale_data, bias_data, y);
  else if (dtype == at::kBFloat16)
    stream_rows<float, at::BFloat16>(x32, weight, scale_data, bias_data, y);
  else
    stream_rows<float, at::Half>(x32, weight, scale_data, bias_data, y);
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor", &int8_linear);
}
