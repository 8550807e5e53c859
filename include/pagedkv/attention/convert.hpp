// fp16 / bf16 -> float32 conversions for the attention kernel's portable
// path and for the tails of the vector paths.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pagedkv {
namespace attention_kernels {

inline float float_from_bits(uint32_t bits) noexcept {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint32_t bits_from_float(float f) noexcept {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

/// IEEE half -> float, bit-identical to c10::Half's conversion but written
/// without a branch, so the compiler vectorises loops over it (c10's select
/// is not if-converted by g++ 12 at -O3).
inline float half_to_float(uint16_t h) noexcept {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  // Normal numbers: re-bias the exponent (Inf/NaN stay Inf/NaN).
  const uint32_t normalized =
      bits_from_float(float_from_bits((two_w >> 4) + (UINT32_C(0xE0) << 23)) * float_from_bits(UINT32_C(15) << 23));
  // Zeros and subnormals: mantissa * 2^-24 via a magic bias.
  const uint32_t denormalized = bits_from_float(float_from_bits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f);
  const uint32_t is_denormal = UINT32_C(0) - static_cast<uint32_t>(two_w < (UINT32_C(1) << 27));
  return float_from_bits(sign | (denormalized & is_denormal) | (normalized & ~is_denormal));
}

inline float bfloat16_to_float(uint16_t h) noexcept { return float_from_bits(static_cast<uint32_t>(h) << 16); }

/// One element of a cache, whatever its dtype, as float32.
inline float to_float32(float x) noexcept { return x; }
inline float to_float32(c10::Half x) noexcept { return half_to_float(x.x); }
inline float to_float32(c10::BFloat16 x) noexcept { return bfloat16_to_float(x.x); }

}  // namespace attention_kernels
}  // namespace pagedkv
