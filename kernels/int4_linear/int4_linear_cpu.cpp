// y = x W^T + bias for a weight-only int4 linear layer (the layout of kernels/int4_linear/naive.py: each row of W in
// groups of 32 inputs, a group one fp16 scale and 16 bytes of 4-bit values q in [-8, 7]), x [M, K] in the model's
// dtype (fp32, bf16 or fp16), fp32 accumulation, y [M, N] in x's dtype. The weights are the reference's: q * scale
// in fp32, rounded to x's dtype (as a model of that dtype holds its weights).
//
// Few rows (a decode batch): the layer is bound by streaming W, 4.5 bits a weight (a seventh of fp32's bytes, 0.56x
// int8's). Each thread streams a contiguous range of W's rows once (the loops over W's rows and x's chunks:
// kernels/weight_stream.h) and decodes each group in registers: on AVX-512 the group's scale times the 16 levels,
// rounded to x's dtype, is a table that one permute per 16 weights indexes by their nibbles; on AVX2 the nibbles
// are converted, scaled and rounded. The weights are multiplied with every row of x by fp32 FMAs (bf16 and fp16
// rows widened first), or, for bf16 rows from kBf16DotFromRows on a CPU with AVX512-BF16, decoded to bf16 by one
// 16-bit permute per group and multiplied by vdpbf16ps (one instruction per 32 weights and row, where the fp32
// loop takes two).
//
// Many rows (prefill): blocks of W's rows are dequantised for the fp32 GEMM (rnnserve::dequantized_gemm).
#include <ATen/ATen.h>
#include <torch/library.h>

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

constexpr int64_t kGroup = 32;                  // inputs sharing one scale
constexpr int64_t kGroupBytes = kGroup / 2;     // two 4-bit values a byte
constexpr int kVectors = kGroup / kLanes;       // fp32 vectors a group decodes to
constexpr int64_t kLineGroups = 64 / kGroupBytes;  // groups in a cache line of W: one prefetch each
constexpr int64_t kPrefetchAhead = 2048;        // bytes of the weight stream prefetched ahead of the loads
constexpr int64_t kMaxStreamRows = 32;          // above this, the dequantise + GEMM path

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// The 16 levels q = -8..7 as fp32 lanes (the decode table before its scale).
inline vfloat levels() {
  vfloat v{};
  for (int i = 0; i < kLanes && i < 16; ++i) v[i] = static_cast<float>(i - 8);
  return v;
}

inline vfloat splat(float value) { return vfloat{} + value; }

using vuint = uint32_t __attribute__((vector_size(kLanes * 4)));

// v rounded to W (fp32: unchanged; bf16 and fp16: to nearest, ties to even, as torch's .to(dtype)), as fp32. The
// values are products of finite scales and small integers: no NaN or inf to keep.
template <typename W>
inline vfloat round_to(vfloat v) {
  if constexpr (std::is_same_v<W, at::BFloat16>) {
    const vuint bits = reinterpret_cast<vuint>(v);
    return reinterpret_cast<vfloat>((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
  } else if constexpr (std::is_same_v<W, at::Half>) {
#if defined(__AVX512F__)
    return reinterpret_cast<vfloat>(
        _mm512_cvtph_ps(_mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT)));
#elif defined(__F16C__)
    return reinterpret_cast<vfloat>(
        _mm256_cvtph_ps(_mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT)));
#else
    vfloat out;
    for (int i = 0; i < kLanes; ++i) out[i] = static_cast<float>(static_cast<at::Half>(v[i]));
    return out;
#endif
  } else {
    return v;
  }
}

// The scales of a cache line's kLineGroups groups, each in all lanes: converted together (one vcvtph2ps) and
// spread by one permute each, where a scale at a time took a load, a conversion and a broadcast per group.
inline void line_scales(const at::Half* scales, vfloat* out) {
#if defined(__AVX512F__) && defined(__F16C__)
  const __m512 four = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales))));
  for (int l = 0; l < kLineGroups; ++l) out[l] = reinterpret_cast<vfloat>(_mm512_permutexvar_ps(_mm512_set1_epi32(l), four));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 four = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales))));
  for (int l = 0; l < kLineGroups; ++l) out[l] = reinterpret_cast<vfloat>(_mm256_permutevar8x32_ps(four, _mm256_set1_epi32(l)));
#else
  for (int l = 0; l < kLineGroups; ++l) out[l] = splat(half_to_float(scales[l]));
#endif
}

// A group's 32 weights q * scale (`scale` in all lanes) rounded to W, as kVectors fp32 vectors, in the weight's
// order (low nibbles of the 16 bytes first, then the high ones).
template <typename W>
inline void decode_group(const uint8_t* p, vfloat scale, [[maybe_unused]] vfloat level_table, vfloat* w) {
#if defined(__AVX512F__)
  const __m512 table = reinterpret_cast<__m512>(round_to<W>(level_table * scale));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w[0] = reinterpret_cast<vfloat>(_mm512_permutexvar_ps(bytes, table));  // indexes by bits 0-3: the low nibble
  w[1] = reinterpret_cast<vfloat>(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table));
#elif defined(__AVX2__)
  const __m256 scales = reinterpret_cast<__m256>(scale), eight = _mm256_set1_ps(8.f);
  const __m256i nibble = _mm256_set1_epi32(15);
  for (int half = 0; half < 2; ++half) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
    const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, nibble));
    const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    w[half] = round_to<W>(reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_sub_ps(low, eight), scales)));
    w[2 + half] = round_to<W>(reinterpret_cast<vfloat>(_mm256_mul_ps(_mm256_sub_ps(high, eight), scales)));
  }
#else
  for (int j = 0; j < kGroupBytes; ++j) {
    w[j / kLanes][j % kLanes] = static_cast<float>((p[j] & 15) - 8) * scale[0];
    w[(j + kGroupBytes) / kLanes][(j + kGroupBytes) % kLanes] = static_cast<float>((p[j] >> 4) - 8) * scale[0];
  }
  for (int v = 0; v < kVectors; ++v) w[v] = round_to<W>(w[v]);
#endif
}

// sums[r] = sum_j W[j] * x[r, j] over the k inputs of a pass that starts at a group: `row` and `scales` point at
// its first group. The groups of a cache line are decoded once for all R rows; kAcc independent accumulators a row
// keep several FMAs in flight (one row of x has few otherwise). Not inlined into the loops of
// kernels/weight_stream.h (there, 1.1x slower at one row; see int8_linear's bf16 dot_rows).
template <int R, typename W>
__attribute__((noinline)) void dot_rows(const uint8_t* row, const at::Half* scales, const float* x,
                                    int64_t x_stride, int64_t k, float* sums) {
  constexpr int kAcc = R == 1 ? 4 : 2;
  static_assert(kLineGroups * kVectors % kAcc == 0, "a line is whole rounds of the accumulators");
  const vfloat table = levels();
  vfloat acc[R][kAcc];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < kAcc; ++a) acc[r][a] = vfloat{};
  vfloat w[kVectors], scale[kLineGroups];
  const int64_t groups = k / kGroup;
  int64_t g = 0;
  for (; g + kLineGroups <= groups; g += kLineGroups) {
    __builtin_prefetch(row + g * kGroupBytes + kPrefetchAhead, 0, 3);
    line_scales(scales + g, scale);
#pragma GCC unroll 4
    for (int64_t l = 0; l < kLineGroups; ++l) {
      decode_group<W>(row + (g + l) * kGroupBytes, scale[l], table, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v)
          acc[r][(l * kVectors + v) % kAcc] += w[v] * load(x + r * x_stride + (g + l) * kGroup + v * kLanes);
    }
  }
  for (; g < groups; ++g) {
    decode_group<W>(row + g * kGroupBytes, splat(half_to_float(scales[g])), table, w);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) acc[r][v % kAcc] += w[v] * load(x + r * x_stride + g * kGroup + v * kLanes);
  }
  if (const int64_t rest = k - groups * kGroup; rest > 0) {  // the row's last group, padded with zero weights
    decode_group<W>(row + groups * kGroupBytes, splat(half_to_float(scales[groups])), table, w);
    for (int v = 0; v < kVectors && v * kLanes < rest; ++v) {
      const int64_t count = std::min<int64_t>(kLanes, rest - v * kLanes);
      for (int r = 0; r < R; ++r) {
        const float* xv = x + r * x_stride + groups * kGroup + v * kLanes;
        acc[r][v % kAcc] += w[v] * (count == kLanes ? load(xv) : load_partial(xv, count));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vfloat total = acc[r][0];
    for (int a = 1; a < kAcc; ++a) total += acc[r][a];
    sums[r] = lane_sum(total);
  }
}

#if defined(__AVX512BF16__)
// bf16 rows of x take vdpbf16ps from one row: at 1-2 rows 1.1-1.4x the fp32 loop on the widened rows (whose weights
// are rounded to bf16 as well), on mamba-130m-sized weights on a Zen 5.
constexpr int64_t kBf16DotFromRows = 1;

using rnnserve::load_bf16;

// A group's 32 weights q * scale rounded to bf16, in order: the scaled levels converted to bf16 are a table of 16
// 16-bit entries that one permute indexes by the 32 nibbles (widened to 16-bit lanes, low nibbles first).
inline __m512bh decode_group_bf16(const uint8_t* p, vfloat scale, vfloat level_table) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
  const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_srli_epi16(bytes, 4), 1);
  const __m256bh table = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(level_table * scale));
  return reinterpret_cast<__m512bh>(
      _mm512_permutexvar_epi16(nibbles, _mm512_castsi256_si512(reinterpret_cast<__m256i>(table))));
}

// dot_rows for bf16 rows of x: each group's bf16 weights multiplied with every row by vdpbf16ps, two accumulators
// a row (the groups of a line alternate).
template <int R>
inline void dot_rows_bf16(const uint8_t* row, const at::Half* scales, const at::BFloat16* x, int64_t x_stride,
                          int64_t k, float* sums) {
  const vfloat table = levels();
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  vfloat scale[kLineGroups];
  const int64_t groups = k / kGroup;
  int64_t g = 0;
  for (; g + kLineGroups <= groups; g += kLineGroups) {
    __builtin_prefetch(row + g * kGroupBytes + kPrefetchAhead, 0, 3);
    line_scales(scales + g, scale);
#pragma GCC unroll 4
    for (int64_t l = 0; l < kLineGroups; ++l) {
      const __m512bh w = decode_group_bf16(row + (g + l) * kGroupBytes, scale[l], table);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][l % 2] = _mm512_dpbf16_ps(acc[r][l % 2], w, load_bf16(x + r * x_stride + (g + l) * kGroup));
    }
  }
  for (; g < groups; ++g) {
    const __m512bh w = decode_group_bf16(row + g * kGroupBytes, splat(half_to_float(scales[g])), table);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, load_bf16(x + r * x_stride + g * kGroup));
  }
  if (const int64_t rest = k - groups * kGroup; rest > 0) {  // the last group: its padding weights are zeros
    const __m512bh w = decode_group_bf16(row + groups * kGroupBytes, splat(half_to_float(scales[groups])), table);
    const __mmask32 mask = static_cast<__mmask32>((1u << rest) - 1);
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, load_bf16(x + r * x_stride + groups * kGroup, mask));
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

template <int R>
inline void dot_rows(const uint8_t* row, const at::Half* scales, const at::BFloat16* x, int64_t x_stride, int64_t k,
                     float* sums) {
  dot_rows_bf16<R>(row, scales, x, x_stride, k, sums);
}
#endif

// dot_rows for 1..kStreamChunkRows rows of x: fp32 rows with weights rounded to W, or bf16 rows (vdpbf16ps).
template <typename W, typename X>
inline void dot_few_rows(const uint8_t* row, const at::Half* scales, const X* x, int64_t x_stride, int64_t rows,
                         int64_t k, float* sums) {
  if constexpr (std::is_same_v<X, float>) {
    switch (rows) {
      case 1: dot_rows<1, W>(row, scales, x, x_stride, k, sums); break;
      case 2: dot_rows<2, W>(row, scales, x, x_stride, k, sums); break;
      case 3: dot_rows<3, W>(row, scales, x, x_stride, k, sums); break;
      case 4: dot_rows<4, W>(row, scales, x, x_stride, k, sums); break;
      case 5: dot_rows<5, W>(row, scales, x, x_stride, k, sums); break;
      case 6: dot_rows<6, W>(row, scales, x, x_stride, k, sums); break;
      case 7: dot_rows<7, W>(row, scales, x, x_stride, k, sums); break;
      default: dot_rows<8, W>(row, scales, x, x_stride, k, sums); break;
    }
  } else {
#if defined(__AVX512BF16__)
    switch (rows) {
      case 1: dot_rows<1>(row, scales, x, x_stride, k, sums); break;
      case 2: dot_rows<2>(row, scales, x, x_stride, k, sums); break;
      case 3: dot_rows<3>(row, scales, x, x_stride, k, sums); break;
      case 4: dot_rows<4>(row, scales, x, x_stride, k, sums); break;
      case 5: dot_rows<5>(row, scales, x, x_stride, k, sums); break;
      case 6: dot_rows<6>(row, scales, x, x_stride, k, sums); break;
      case 7: dot_rows<7>(row, scales, x, x_stride, k, sums); break;
      default: dot_rows<8>(row, scales, x, x_stride, k, sums); break;
    }
#endif
  }
}

// x_rows: fp32 (W: the dtype the weights are rounded to, x's own), or bf16 where the CPU has bf16 dot products.
template <typename W, typename X, typename out_t>
void stream_rows(const at::Tensor& x_rows, const at::Tensor& packed, const at::Tensor& scale, const float* bias,
                 at::Tensor& y) {
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const int64_t w_stride = packed.stride(0), groups = scale.size(1);
  const auto dot = [=](int64_t i, int64_t k0, int64_t count, const X* xm, int64_t x_stride, int64_t chunk,
                       float* sums) {
    dot_few_rows<W>(w + i * w_stride + k0 / 2, s + i * groups + k0 / kGroup, xm + k0, x_stride, chunk, count, sums);
  };
  const auto finish = [=](int64_t i, float sum) { return sum + (bias ? bias[i] : 0.f); };
  rnnserve::stream_weight_rows(x_rows.data_ptr<X>(), x_rows.stride(0), x_rows.size(0), x_rows.size(1),
                               packed.size(0), packed.size(1), y.data_ptr<out_t>(), dot, finish);
}

// W's row i as k fp32 values (rounded to W).
template <typename W>
void dequantize_row(const uint8_t* row, const at::Half* scales, int64_t k, float* dst) {
  const vfloat table = levels();
  vfloat w[kVectors];
  for (int64_t g = 0; g * kGroup < k; ++g) {
    decode_group<W>(row + g * kGroupBytes, splat(half_to_float(scales[g])), table, w);
    const int64_t count = std::min(kGroup, k - g * kGroup);
    if (count == kGroup) {
      std::memcpy(dst + g * kGroup, w, sizeof(w));
    } else {
      float group[kGroup];
      std::memcpy(group, w, sizeof(w));
      std::memcpy(dst + g * kGroup, group, count * sizeof(float));
    }
  }
}

// x [M, K] float (fp32, bf16, fp16), packed [N, G * 16] uint8 (unit stride along its columns), scale [N, G] fp16,
// bias [N] or None; G = ceil(K / 32).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && scale.dim() == 2, "x must be [M, K], packed [N, G*16], scale [N, G]");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "packed must be uint8");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous(), "scale must be contiguous fp16");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "x must be fp32, bf16 or fp16");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(scale.size(0) == n && scale.size(1) == groups, "scale must be [N, ceil(K / 32)]");
  TORCH_CHECK(packed.size(1) == groups * kGroupBytes, "packed must be [N, ceil(K / 32) * 16]");
  TORCH_CHECK(packed.stride(1) == 1 || packed.size(1) <= 1, "packed needs a unit stride along its columns");
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [N]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({rows, n}, x.options());
  if (n == 0) return y;
  const float* bias_data = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  at::Tensor x32;
  const auto run = [&](auto element) {  // the weights are rounded to x's dtype, y is written in it
    using W = decltype(element);
    using out_t = W;
    if (rows > kMaxStreamRows) {
      const uint8_t* w = packed.data_ptr<uint8_t>();
      const at::Half* s = scale.data_ptr<at::Half>();
      const auto row = [&](int64_t i, float* dst) {
        dequantize_row<W>(w + i * packed.stride(0), s + i * groups, k, dst);
      };
      y = rnnserve::dequantized_gemm(x.to(at::kFloat).contiguous(), n, bias32, row).to(dtype);
      return;
    }
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<out_t, at::BFloat16>) {
      if (rows >= kBf16DotFromRows) {
        const at::Tensor x_rows = x.stride(1) == 1 || k <= 1 ? x : x.contiguous();
        stream_rows<W, at::BFloat16, out_t>(x_rows, packed, scale, bias_data, y);
        return;
      }
    }
#endif
    x32 = x.to(at::kFloat);
    if (x32.stride(1) != 1 && k > 1) x32 = x32.contiguous();
    stream_rows<W, float, out_t>(x32, packed, scale, bias_data, y);
  };
  if (rows == 0) return y;
  if (dtype == at::kFloat)
    run(float{});
  else if (dtype == at::kBFloat16)
    run(at::BFloat16{});
  else
    run(at::Half{});
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor", &int4_linear);
}
