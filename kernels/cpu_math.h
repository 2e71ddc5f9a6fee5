// Small math and memory helpers shared by the fused CPU kernels (header-only, included by kernels/<op>/<op>_cpu.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace rnnserve {

// Whether x is NaN, read from its bits: the extension is built with -ffast-math, whose -ffinite-math-only lets the
// compiler fold std::isnan(x) and x != x to false and reorder compares as if no operand were NaN. Dropping that
// flag costs more than these tests: without __FAST_MATH__ glibc declares no vector math, and the exact GELU's
// erf loop stopped vectorising (mingru-100m prefill 27% slower, docs/kernels.md).
__attribute__((always_inline)) inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// Whether x is +-inf or NaN, and whether it is -inf, read from its bits (as is_nan, for -ffast-math).
__attribute__((always_inline)) inline bool is_non_finite(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7fffffffu) >= 0x7f800000u;
}

__attribute__((always_inline)) inline bool is_negative_infinity(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits == 0xff800000u;
}

// A quiet NaN built from its bits: under -ffinite-math-only a NaN constant or an expression such as x * 0 may be
// folded to something finite.
__attribute__((always_inline)) inline float quiet_nan() {
  const uint32_t bits = 0x7fc00000u;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// exp(x) for fp32, inlined so that loops calling it vectorise without spilling around a libm call.
// Cody-Waite reduction x = n ln2 + r (|r| <= ln2/2, two-part ln2 via fma, which -ffast-math leaves alone)
// and a degree-7 Taylor polynomial: max relative error 8e-8 on [-86.9, 88] (glibc's expf under -ffast-math:
// 2e-7). Inputs are clamped to [-87.5, 88]: results below 2.4e-38 are 0 (2p 2^(n-1) with n = -126 has exponent
// bits 0; std::exp gives subnormals down to 1.4e-45, which -ffast-math flushes anyway), and exp(88) = 1.65e38 stands
// in for larger ones. NaN stays NaN, as in std::exp: under -ffast-math the clamp's vector max/min took NaN as -87,
// so sigmoid(NaN) was 1 and a NaN in the activations became finite numbers; the bit test costs nothing measurable
// (docs/kernels.md).
__attribute__((always_inline)) inline float fast_exp(float x) {
  const float clamped = std::fmin(std::fmax(x, -87.5f), 88.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = std::fma(-n, 0.693145751953125f, clamped);
  r = std::fma(-n, 1.428606765330187045e-06f, r);
  float p = 1.0f / 5040;
  p = std::fma(p, r, 1.0f / 720);
  p = std::fma(p, r, 1.0f / 120);
  p = std::fma(p, r, 1.0f / 24);
  p = std::fma(p, r, 1.0f / 6);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 126) << 23;  // 2^(n - 1), n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return is_nan(x) ? x : (p + p) * scale;
}

__attribute__((always_inline)) inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

// x sigmoid(x); silu(-inf) is NaN, as F.silu's -inf * sigmoid(-inf) = -inf * 0 (here -inf / (1 + e^88) was -inf).
__attribute__((always_inline)) inline float silu(float x) {
  const float y = x / (1.0f + fast_exp(-x));
  return is_negative_infinity(x) ? quiet_nan() : y;
}

// log(1 + t) for t in [0, 1], inlined so that loops calling it vectorise (a libm log1pf call does not, or only
// through glibc's vector library): 2 atanh(s) with s = t / (2 + t) in [0, 1/3], which keeps small t's digits,
// and atanh's odd series to s^13 (what it leaves out is under 1.5e-8 relative). Within 3e-7 relative of log1p
// (a few units in fp32's last place: the roundings of s); glibc's log1pf is within 1.2e-7.
__attribute__((always_inline)) inline float log1p_unit(float t) {
  const float s = t / (2.0f + t);
  const float s2 = s * s;
  float p = 1.0f / 13;
  p = std::fma(p, s2, 1.0f / 11);
  p = std::fma(p, s2, 1.0f / 9);
  p = std::fma(p, s2, 1.0f / 7);
  p = std::fma(p, s2, 1.0f / 5);
  p = std::fma(p, s2, 1.0f / 3);
  p = std::fma(p, s2, 1.0f);
  return 2.0f * s * p;
}

// torch.nn.functional.softplus (beta 1, threshold 20) as max(x, 0) + log(1 + e^-|x|), which never overflows
// and vectorises: within 3.1e-7 relative of the exact value (log1pf(expf(x)): 1.2e-7).
__attribute__((always_inline)) inline float softplus(float x) {
  const float tail = log1p_unit(fast_exp(-std::fabs(x)));
  return x > 20.0f ? x : std::fmax(x, 0.0f) + tail;
}

// tanh(t) = sign(t) (1 - e) / (1 + e) with e = exp(-2|t|) in (0, 1]: no overflow, a few fp32 units of the last
// place where |t| >= 1/8; below, where 1 - e would cancel, its odd Taylor polynomial to t^7 (next term < 2e-10 t).
// From |t| = 9.1, where tanh rounds to 1 in fp32, it is 1 outright: -ffast-math may divide by a reciprocal
// estimate, which gave 1 - 6e-8 for t = inf in an AVX2 build. NaN stays NaN, as in std::tanh (the clamp in
// fast_exp made it +-1).
__attribute__((always_inline)) inline float tanh_approx(float t) {
  const float a = std::fabs(t);
  const float e = fast_exp(-2.0f * a);
  const float t2 = t * t;
  const float series = t * std::fma(t2, std::fma(t2, std::fma(t2, -17.0f / 315, 2.0f / 15), -1.0f / 3), 1.0f);
  const float magnitude = a >= 9.1f ? 1.0f : (1.0f - e) / (1.0f + e);
  return is_nan(t) ? t : a < 0.125f ? series : std::copysign(magnitude, t);
}

// 1 / sqrt(v) with torch's fp32 rounding (a rounded sqrt, then a rounded division), immune to -ffast-math's
// approximate reciprocal square root: both steps in double are exact before the final rounding to fp32. rsqrt(inf)
// is 0, as torch's (-ffast-math's sqrt, x rsqrt(x), made it NaN: an infinity in a group of an RMSNorm turned the
// group's finite values into NaN where torch gives 0).
inline float torch_rsqrt(float v) {
  const float root = static_cast<float>(std::sqrt(static_cast<double>(v)));
  const float inverse = static_cast<float>(1.0 / static_cast<double>(root));
  return is_non_finite(v) && !is_nan(v) ? 0.0f : inverse;
}

// Asks for `bytes` from `p` on to be brought into cache. Long scans call it a few tokens ahead: rows of a
// packed batch are pages apart, which the hardware prefetchers do not follow.
inline void prefetch(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

}  // namespace rnnserve
