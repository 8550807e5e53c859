// The codecs of quantized pages: fp8 e4m3 (OCP "E4M3FN": bias 7, largest
// finite 448, no infinities, NaN only 0x7F / 0xFF) and symmetric int8, each
// with one float32 scale per head vector. Encoding rounds to nearest even
// and saturates, and never yields a NaN code; decoding is exact.
//
// Every routine is a branch-free scalar function; the row loops over them
// are compiled three times (portable, AVX2, AVX-512F through target
// attributes) and chosen at run time with the attention kernel's Isa, so
// the vector paths run the very same arithmetic: tests check that they are
// bit-identical to the scalar one on every fp16 input and 10^7 random floats.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "pagedkv/attention/isa.hpp"
#include "pagedkv/kv_format.hpp"

namespace pagedkv {
namespace quant {

/// Largest finite fp8 e4m3 magnitude; a head vector's amax maps onto it.
constexpr float kFp8Max = 448.0f;
/// Largest int8 code used (symmetric: -128 never occurs).
constexpr float kInt8Max = 127.0f;

inline float format_max(KVFormat f) { return f == KVFormat::int8 ? kInt8Max : kFp8Max; }

inline uint32_t float_bits(float f) noexcept {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// The scale of a head vector whose largest magnitude is `amax`: one float32
/// division, so every path (CPU kernels, ATen) computes the same scale.
inline float scale_for(float amax, KVFormat f) noexcept { return amax / format_max(f); }

/// fp8 e4m3 code of y (already divided by the scale): round to nearest
/// even, |y| >= 448 (and +-inf) saturate to +-448, NaN gives +-0 (never a NaN
/// code), the sign of zero is kept.
inline uint8_t encode_e4m3(float y) noexcept {
  const uint32_t bits = float_bits(y);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  const float a = bits_float(abs_bits);
  // Normal codes (|y| >= 2^-6): drop the float's 20 low mantissa bits with
  // round to nearest even (a carry moves into the exponent, as it should),
  // then rebias the exponent from 127 to 7.
  const uint32_t rounded = (abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u)) >> 20;
  const uint32_t normal = rounded - (120u << 3);
  // Subnormal codes (|y| < 2^-6): multiples of 2^-9; nearbyint rounds half
  // to even. Clamped first so that the int conversion is always defined.
  const float small = a < 0x1p-6f ? a : 0x1p-6f;
  const auto subnormal = static_cast<uint32_t>(static_cast<int32_t>(std::nearbyint(small * 512.0f)));
  uint32_t magnitude = a < 0x1p-6f ? subnormal : normal;
  magnitude = a >= kFp8Max ? 0x7Eu : magnitude;
  magnitude = abs_bits > 0x7F800000u ? 0u : magnitude;  // NaN
  return static_cast<uint8_t>(sign | magnitude);
}

/// The value of an fp8 e4m3 code (NaN for 0x7F and 0xFF). Placing the 7
/// magnitude bits at the top of a float32's exponent/mantissa and scaling by
/// 2^(127 - 7) is exact for normal and subnormal codes alike.
inline float decode_e4m3(uint8_t code) noexcept {
  const uint32_t c = code;
  const float value = bits_float(((c & 0x80u) << 24) | ((c & 0x7Fu) << 20)) * 0x1p120f;
  return (c & 0x7Fu) == 0x7Fu ? std::numeric_limits<float>::quiet_NaN() : value;
}

/// int8 code of y (already divided by the scale): round to nearest even,
/// clamped to [-127, 127]; NaN gives 0.
inline int8_t encode_int8(float y) noexcept {
  float r = std::nearbyint(y);
  r = r > kInt8Max ? kInt8Max : r;
  r = r < -kInt8Max ? -kInt8Max : r;
  r = r == r ? r : 0.0f;
  return static_cast<int8_t>(static_cast<int32_t>(r));
}

inline float decode_int8(int8_t code) noexcept { return static_cast<float>(code); }

/// Codes of one head vector's elements, of either format.
template <KVFormat F>
struct Codec;

template <>
struct Codec<KVFormat::fp8_e4m3> {
  using Code = uint8_t;
  static Code encode(float y) noexcept { return encode_e4m3(y); }
  static float decode(Code c) noexcept { return decode_e4m3(c); }
};

template <>
struct Codec<KVFormat::int8> {
  using Code = int8_t;
  static Code encode(float y) noexcept { return encode_int8(y); }
  static float decode(Code c) noexcept { return decode_int8(c); }
};

// ---- row loops, compiled once per instruction set ----

/// out[i] = encode(x[i] / scale), scale > 0.
template <KVFormat F>
inline void encode_loop(const float* x,  // [n]
                        int64_t n, float scale,
                        typename Codec<F>::Code* out) noexcept {  // [n]
  for (int64_t i = 0; i < n; ++i) out[i] = Codec<F>::encode(x[i] / scale);
}

/// out[i] = decode(codes[i]) * scale.
template <KVFormat F>
inline void decode_loop(const typename Codec<F>::Code* codes,  // [n]
                        int64_t n, float scale,
                        float* out) noexcept {  // [n]
  for (int64_t i = 0; i < n; ++i) out[i] = Codec<F>::decode(codes[i]) * scale;
}

/// max |x[i]| (NaN ignored); order-free, so every path agrees exactly.
inline float amax_loop(const float* x, int64_t n) noexcept {  // x: [n]
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    m = a > m ? a : m;
  }
  return m;
}

#ifdef PAGEDKV_ATTENTION_AVX2
template <KVFormat F>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void encode_avx2(const float* x, int64_t n, float scale,
                                                              typename Codec<F>::Code* out) {
  encode_loop<F>(x, n, scale, out);
}
template <KVFormat F>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void decode_avx2(const typename Codec<F>::Code* codes, int64_t n,
                                                              float scale, float* out) {
  decode_loop<F>(codes, n, scale, out);
}
#endif
#ifdef PAGEDKV_ATTENTION_AVX512
template <KVFormat F>
PAGEDKV_TARGET_AVX512 __attribute__((flatten)) void encode_avx512(const float* x, int64_t n, float scale,
                                                                  typename Codec<F>::Code* out) {
  encode_loop<F>(x, n, scale, out);
}
template <KVFormat F>
PAGEDKV_TARGET_AVX512 __attribute__((flatten)) void decode_avx512(const typename Codec<F>::Code* codes, int64_t n,
                                                                  float scale, float* out) {
  decode_loop<F>(codes, n, scale, out);
}
#endif

using attention_kernels::Isa;

/// out[i] = encode(x[i] / scale) on instruction set `isa` (the caller's
/// selected_isa()); scale 0 (an all-zero vector) gives all-zero codes.
template <KVFormat F>
inline void encode_row(Isa isa, const float* x,  // [n]
                       int64_t n, float scale, typename Codec<F>::Code* out) {  // out: [n]
  if (!(scale > 0.0f)) {
    std::fill(out, out + n, typename Codec<F>::Code{0});
    return;
  }
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case Isa::avx512: return encode_avx512<F>(x, n, scale, out);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case Isa::avx2: return encode_avx2<F>(x, n, scale, out);
#endif
    default: return encode_loop<F>(x, n, scale, out);
  }
}

/// out[i] = decode(codes[i]) * scale on instruction set `isa`.
template <KVFormat F>
inline void decode_row(Isa isa, const typename Codec<F>::Code* codes,  // [n]
                       int64_t n, float scale, float* out) {            // out: [n]
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case Isa::avx512: return decode_avx512<F>(codes, n, scale, out);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case Isa::avx2: return decode_avx2<F>(codes, n, scale, out);
#endif
    default: return decode_loop<F>(codes, n, scale, out);
  }
}

/// Quantizes one head vector: its amax, scale and codes. Returns the scale.
template <KVFormat F>
inline float quantize_vector(Isa isa, const float* x,  // [n]
                             int64_t n, typename Codec<F>::Code* out) {  // out: [n]
  const float scale = scale_for(amax_loop(x, n), F);
  encode_row<F>(isa, x, n, scale, out);
  return scale;
}

/// Elements of T to float32 (exact for the dtypes a cache holds).
template <class T>
inline void to_float(const char* src, int64_t elem_stride_bytes, int64_t n, float* out) {  // out: [n]
  if (elem_stride_bytes == static_cast<int64_t>(sizeof(T))) {
    const T* s = reinterpret_cast<const T*>(src);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(s[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    T value;
    std::memcpy(&value, src + i * elem_stride_bytes, sizeof(T));
    out[i] = static_cast<float>(value);
  }
}

}  // namespace quant
}  // namespace pagedkv
