// Page elements -> float32 for the attention kernel's portable path and the
// tails of the vector paths: fp16, bf16, and the codes of quantized pages
// (fp8 e4m3, int8), which every path decodes the same way.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pagedkv {
namespace simd {

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

/// An fp8 e4m3 code as stored in a quantized page (a kByte element): a type
/// of its own, so that kernels templated on the element tell it from int8.
struct E4m3Code {
  uint8_t bits;
};

/// What every attention path decodes an e4m3 code c to is e4m3(c) / 2^8:
/// c's bits moved into an fp16 (sign; exponent and mantissa shifted left by
/// 7) are e4m3(c) with the exponent bias of fp16 (15) instead of 7, for the
/// 16 subnormal codes too, so the vector paths decode 16 codes with one
/// integer shift, one mask and one vcvtph2ps. The kernel multiplies the
/// code's scale by this factor instead (exact: a power of two). The NaN
/// codes 0x7F / 0xFF, which the encoder never writes, read as +-480.
constexpr float kE4m3ViaHalfFactor = 256.0f;

/// The fp16 bits of e4m3(code) / 2^8: bit 15 the sign, bits 13..7 the code's low 7 bits.
inline uint16_t e4m3_to_half_bits(uint8_t code) noexcept {
  return static_cast<uint16_t>(((code & 0x80u) << 8) | ((code & 0x7Fu) << 7));
}

/// One element of a cache, whatever its dtype, as float32 (codes unscaled).
inline float to_float32(float x) noexcept { return x; }
inline float to_float32(c10::Half x) noexcept { return half_to_float(x.x); }
inline float to_float32(c10::BFloat16 x) noexcept { return bfloat16_to_float(x.x); }
inline float to_float32(E4m3Code x) noexcept { return half_to_float(e4m3_to_half_bits(x.bits)); }
inline float to_float32(int8_t x) noexcept { return static_cast<float>(x); }

/// The stored row of a block (rows are kept untyped: K and V may hold
/// different element types) as the element type E the caller knows it has.
template <class E>
inline const E* row_as(const void* row) noexcept {
  return static_cast<const E*>(row);
}

}  // namespace simd
}  // namespace pagedkv
