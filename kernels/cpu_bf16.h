// fp32 <-> bf16 conversions for the CPU kernels' element loops (header-only). c10's conversions do not vectorise
// inside those loops (a residual RMSNorm over 1024 x 768 bf16 took 8x its fp32 time), so these work on the bits:
// widening shifts them up, narrowing rounds to nearest, ties to even, as c10 does; NaN and inf keep their class.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace rnnserve {

// run(T{}) with T the element type of a tensor of `type`, bf16 or (otherwise) fp32: the kernels check the dtype
// first, then instantiate their loops for both.
template <typename Run>
inline void with_element_type(at::ScalarType type, Run&& run) {
  if (type == at::kBFloat16)
    run(at::BFloat16{});
  else
    run(float{});
}

// The bits of v rounded to bf16 (its upper 16 bits; the lower ones zero).
inline uint32_t bf16_rounded_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t special = (bits | ((bits & 0xFFFFu) ? 0x00400000u : 0u)) & 0xFFFF0000u;  // inf; NaN stays NaN
  return (bits & 0x7F800000u) == 0x7F800000u ? special : rounded;
}

// A stored fp32 or bf16 value as fp32.
template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  } else {
    return static_cast<float>(v);
  }
}

// v rounded to T (fp32 or bf16), as fp32.
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint32_t bits = bf16_rounded_bits(v);
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

// p[j] = v in T (fp32 or bf16; bf16 written as raw bits).
template <typename T>
inline void store_as(T* p, int64_t j, float v) {
  if constexpr (std::is_same_v<T, at::BFloat16>)
    reinterpret_cast<uint16_t*>(p)[j] = static_cast<uint16_t>(bf16_rounded_bits(v) >> 16);
  else
    p[j] = static_cast<T>(v);
}

}  // namespace rnnserve
