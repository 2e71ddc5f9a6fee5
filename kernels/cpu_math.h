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

// e^r / 2^n's polynomial for exp(x) with x = n ln2 + r: Cody-Waite reduction (|r| <= ln2/2, two-part ln2 via fma,
// which -ffast-math leaves alone) and a degree-7 Taylor polynomial, for a finite x the callers clamp.
__attribute__((always_inline)) inline float exp_mantissa(float x, float& n) {
  n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = std::fma(-n, 0.693145751953125f, x);
  r = std::fma(-n, 1.428606765330187045e-06f, r);
  float p = 1.0f / 5040;
  p = std::fma(p, r, 1.0f / 720);
  p = std::fma(p, r, 1.0f / 120);
  p = std::fma(p, r, 1.0f / 24);
  p = std::fma(p, r, 1.0f / 6);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  return std::fma(p, r, 1.0f);
}

// 2^e for an integer e in [-127, 128] (a float holding it), from the exponent bits: 0 at e = -127 and inf at 128.
__attribute__((always_inline)) inline float power_of_two(float e) {
  const int32_t bits = (static_cast<int32_t>(e) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
}

// exp(x) for fp32, inlined so that loops calling it vectorise without spilling around a libm call: max relative
// error 8e-8 on [-87, 88] (glibc's expf under -ffast-math: 2e-7). Inputs are clamped to that range; exp(-87) =
// 1.6e-38 stands in for smaller results and exp(88) = 1.65e38 for larger ones. NaN stays NaN, as in std::exp: under
// -ffast-math the clamp's vector max/min took NaN as -87, so sigmoid(NaN) was 1 and a NaN in the activations became
// finite numbers. The bit test and its select cost 4% in a loop of exp alone (docs/kernels.md).
__attribute__((always_inline)) inline float fast_exp(float x) {
  float n;
  const float p = exp_mantissa(std::fmin(std::fmax(x, -87.0f), 88.0f), n);
  return is_nan(x) ? x : p * power_of_two(n);
}

// fast_exp without the NaN test, for callers whose result is NaN for a NaN x anyway: silu's x / (1 + e), and the
// selective scan's exp(dt A) h + dt x B, where a NaN dt or x reaches h through its second term (the test cost the
// scan's prefill 1.2x).
__attribute__((always_inline)) inline float fast_exp_of_finite(float x) {
  float n;
  const float p = exp_mantissa(std::fmin(std::fmax(x, -87.0f), 88.0f), n);
  return p * power_of_two(n);
}

// exp(x) that ends where fp32's does: 0 below about -87 (exp(-inf) = 0; torch's exp gives subnormals down to
// -103.9, which -ffast-math flushes), inf above 88.72 (exp(inf) = inf), NaN for NaN; else fast_exp's value. Computed
// as 2p 2^(n-1), whose exponent bits are 0 at the clamp's bottom (n = -126) and all ones at its top (n = 129):
// selects on x instead (exp(-inf) took two compares and a bit test) made the log-space scan 2.6x slower.
__attribute__((always_inline)) inline float exp_to_limits(float x) {
  float n;
  const float p = exp_mantissa(std::fmin(std::fmax(x, -87.5f), 89.5f), n);
  return is_nan(x) ? x : (p + p) * power_of_two(n - 1.0f);
}

__attribute__((always_inline)) inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

// x sigmoid(x); 0 below -88, where torch's x / (1 + exp(-x)) has exp(-x) = inf (x / (1 + e^88), with the clamp,
// grew with |x|: -2 at -3.3e38, -0.006 at -1e36, turned into a large number by the up projection it gates), and
// silu(-inf) is NaN, as F.silu's -inf * sigmoid(-inf) = -inf * 0. The selects cost SwiGLU's gated_act about 1.2x
// (a few percent of an MLP); x / (1 + exp(-x)) with exp(inf) = inf instead gives NaN for large finite -x too:
// -ffast-math's vector division is a reciprocal estimate and a Newton step, which makes x / inf NaN.
__attribute__((always_inline)) inline float silu(float x) {
  const float y = x / (1.0f + fast_exp_of_finite(-x));
  const float below = is_nan(x) || is_negative_infinity(x) ? quiet_nan() : 0.0f;  // NaN: either way round the compare
  return x < -88.0f ? below : y;
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
