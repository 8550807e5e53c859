// The codecs of quantized pages, defined once as scalar functions: fp8 e4m3
// (OCP "E4M3FN": bias 7, largest finite 448, no infinities, NaN only 0x7F /
// 0xFF) and symmetric int8, each with one float32 scale per head vector.
// Encoding rounds to nearest even and saturates, and never yields a NaN
// code; decoding is exact.
//
// Every routine is a branch-free scalar function, and the row loops over
// them are the portable path. The AVX2 (isa_avx2.hpp) and AVX-512
// (isa_avx512.hpp) paths compute the same results in intrinsics (g++ 12
// does not vectorise the scalar loops); cpu/quant/codecs.hpp chooses between
// them at run time with the attention kernel's Isa. Tests check that every
// path is bit-identical to these functions on every fp16 input and 10^7
// random floats.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "pagedkv/kv_format.hpp"
#include "pagedkv/simd/convert.hpp"

namespace pagedkv {
namespace cpu {
namespace quant {

/// Largest finite fp8 e4m3 magnitude; a head vector's amax maps onto it.
constexpr float kFp8Max = 448.0f;
/// Largest int8 code used (symmetric: -128 never occurs).
constexpr float kInt8Max = 127.0f;

inline float format_max(KVFormat f) { return f == KVFormat::int8 ? kInt8Max : kFp8Max; }

// __builtin_bit_cast (g++ >= 11, clang >= 9), not memcpy: g++ 12 does not
// vectorise a loop whose bit casts are memcpys ("no vectype for stmt"), and
// every codec loop is made of them.
inline uint32_t float_bits(float f) noexcept { return __builtin_bit_cast(uint32_t, f); }
inline float bits_float(uint32_t u) noexcept { return __builtin_bit_cast(float, u); }

/// The scale of a head vector whose largest magnitude is `amax`: one float32
/// division, so every path (CPU kernels, ATen) computes the same scale.
inline float scale_for(float amax, KVFormat f) noexcept { return amax / format_max(f); }

/// Head vectors the vector paths quantize together (quantize_rows_*).
constexpr int64_t kQuantizeGroup = 4;

/// Round to nearest even for |v| <= 2^22 (NaN stays NaN): adding and
/// subtracting 1.5 x 2^23 leaves no fraction bits, in the default rounding
/// mode. Unlike std::nearbyint, loops over it vectorise without -ffast-math.
inline float round_half_even(float v) noexcept {
  constexpr float kMagic = 12582912.0f;  // 1.5 x 2^23
  return (v + kMagic) - kMagic;
}

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
  const auto subnormal = static_cast<uint32_t>(static_cast<int32_t>(round_half_even(small * 512.0f)));
  uint32_t magnitude = a < 0x1p-6f ? subnormal : normal;
  magnitude = a >= kFp8Max ? 0x7Eu : magnitude;
  magnitude = abs_bits > 0x7F800000u ? 0u : magnitude;  // NaN
  return static_cast<uint8_t>(sign | magnitude);
}

/// The value of an fp8 e4m3 code (NaN for 0x7F and 0xFF), exact, with no
/// float32 subnormal on the way: normal codes rebias their exponent in the
/// integer bits (7 -> 127); subnormal codes are m x 2^-9, an int conversion
/// and a power-of-two product. (Placing the bits in a float32 and scaling by
/// 2^120 is also exact, but a subnormal operand costs a microcode assist on
/// x86: bench/NOTES.md, "The codecs, vectorised (Xeon, 2026-12-01)".) Selects
/// are on integer bits, so the loops over it vectorise.
inline float decode_e4m3(uint8_t code) noexcept {
  const uint32_t c = code;
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t normal = sign | (((c & 0x7Fu) << 20) + (120u << 23));
  const uint32_t subnormal = sign | float_bits(static_cast<float>(static_cast<int32_t>(c & 7u)) * 0x1p-9f);
  uint32_t bits = (c & 0x78u) == 0u ? subnormal : normal;
  bits = (c & 0x7Fu) == 0x7Fu ? 0x7FC00000u : bits;
  return bits_float(bits);
}

/// int8 code of y (already divided by the scale): round to nearest even,
/// clamped to [-127, 127]; NaN gives 0.
inline int8_t encode_int8(float y) noexcept {
  // Clamped first (rounding is monotonic and +-127 are integers: the same
  // codes), so that round_half_even's range holds.
  float r = y > kInt8Max ? kInt8Max : y;
  r = r < -kInt8Max ? -kInt8Max : r;
  r = round_half_even(r);
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

/// out[i] = encode(x[i] / scale), scale > 0; x float32, fp16 or bf16.
template <KVFormat F, class T>
inline void encode_loop(const T* x,  // [n]
                        int64_t n, float scale,
                        typename Codec<F>::Code* out) noexcept {  // [n]
  for (int64_t i = 0; i < n; ++i) out[i] = Codec<F>::encode(simd::to_float32(x[i]) / scale);
}

/// out[i] = decode(codes[i]) * scale.
template <KVFormat F>
inline void decode_loop(const typename Codec<F>::Code* codes,  // [n]
                        int64_t n, float scale,
                        float* out) noexcept {  // [n]
  for (int64_t i = 0; i < n; ++i) out[i] = Codec<F>::decode(codes[i]) * scale;
}

/// max |x[i]| (NaN ignored); exact in any order, so every path agrees.
/// 16 lanes folded as a tree: `a > m ? a : m` is exactly a vector max, so
/// the compiler vectorises it without -ffast-math.
template <class T>
inline float amax_loop(const T* x, int64_t n) noexcept {  // x: [n]
  float m[16] = {};
  const int64_t full = n - n % 16;
  for (int64_t i = 0; i < full; i += 16) {
    for (int l = 0; l < 16; ++l) {
      const float a = std::fabs(simd::to_float32(x[i + l]));
      m[l] = a > m[l] ? a : m[l];
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float a = std::fabs(simd::to_float32(x[i]));
    m[0] = a > m[0] ? a : m[0];
  }
  for (int l = 0; l < 8; ++l) m[l] = m[l + 8] > m[l] ? m[l + 8] : m[l];
  for (int l = 0; l < 4; ++l) m[l] = m[l + 4] > m[l] ? m[l + 4] : m[l];
  for (int l = 0; l < 2; ++l) m[l] = m[l + 2] > m[l] ? m[l + 2] : m[l];
  return m[1] > m[0] ? m[1] : m[0];
}

/// The scale of x and its codes (all zero for scale 0); returns the scale.
template <KVFormat F, class T>
inline float quantize_loop(const T* x,  // [n]
                           int64_t n, typename Codec<F>::Code* out) noexcept {  // out: [n]
  const float scale = scale_for(amax_loop(x, n), F);
  if (!(scale > 0.0f)) {
    std::fill(out, out + n, typename Codec<F>::Code{0});
    return scale;
  }
  encode_loop<F>(x, n, scale, out);
  return scale;
}

/// A head vector's amax (NaN ignored, as in amax_loop) and whether every
/// element is finite, where an instruction set's amax learns it for free
/// (fp16 / bf16 rows: amax_bits16_avx2); false where it does not know.
/// A row of finite values quantized with its own scale has no NaN
/// quotient and none beyond format_max, rounded: the fp8 encoders then
/// skip their NaN and saturation steps (encode_e4m3_x16).
struct RowAmax {
  float amax;
  bool all_finite;
};

/// The vector paths' quantize_rows: `count` head vectors in groups of
/// kQuantizeGroup, all the amaxes of a group first, then its scales and
/// codes. One vector's amax -> scale -> codes is one long chain of latency;
/// independent vectors in flight overlap it. Amax and EncodeRow are one
/// instruction set's functions; each path's wrapper inlines them (flatten)
/// into its own target. EncodeRow is given each row's own scale (its amax /
/// format_max), so every |x / scale| is at most format_max, rounded
/// (int8_lanes_of_row_x8 and encode_e4m3_x16 rely on it), and whether the row
/// is all finite.
template <KVFormat F, class T, RowAmax (*Amax)(const T*, int64_t),
          void (*EncodeRow)(const T*, int64_t, float, bool, typename Codec<F>::Code*)>
inline void quantize_rows_grouped(const T* x, int64_t x_stride, int64_t count, int64_t n,
                                  typename Codec<F>::Code* out, int64_t out_stride, float* scales,
                                  int64_t scale_stride) {
  for (int64_t first = 0; first < count; first += kQuantizeGroup) {
    const int64_t rows = std::min(kQuantizeGroup, count - first);
    float group_scales[kQuantizeGroup];
    bool all_finite[kQuantizeGroup];
    for (int64_t r = 0; r < rows; ++r) {
      // The scale's division right after its amax: in the codes loop it delayed
      // every row's codes (bench/NOTES.md, "Encoders of a row with its own scale").
      const RowAmax amax = Amax(x + (first + r) * x_stride, n);
      group_scales[r] = scale_for(amax.amax, F);
      all_finite[r] = amax.all_finite;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = group_scales[r];
      scales[(first + r) * scale_stride] = scale;
      typename Codec<F>::Code* codes = out + (first + r) * out_stride;
      if (scale > 0.0f) {
        EncodeRow(x + (first + r) * x_stride, n, scale, all_finite[r], codes);
      } else {
        std::fill(codes, codes + n, typename Codec<F>::Code{0});
      }
    }
  }
}

// ---- the logical dtype's rounding, shared by every path ----

inline float bf16_to_float(c10::BFloat16 b) noexcept { return simd::bfloat16_to_float(b.x); }

/// c10::BFloat16(float)'s rounding (round to nearest even; NaN -> 0x7FC0), branch-free.
inline c10::BFloat16 float_to_bf16(float f) noexcept {
  const uint32_t u = float_bits(f);
  const auto rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16((u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : rounded, c10::BFloat16::from_bits());
}

/// T(x) as narrow_loop rounds it (round to nearest even; c10's for fp16).
template <class T>
inline T narrow_value(float x) noexcept {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 narrow_value<c10::BFloat16>(float x) noexcept {
  return float_to_bf16(x);
}

// ---- the logical dtype <-> float32, per instruction set ----
// c10::Half's own conversions are scalar bit manipulation, many times a copy of
// the codes (bench/NOTES.md, "The codecs, vectorised (Xeon, 2026-12-01)"); F16C
// converts 8 or 16 at once, rounding alike. bf16 is a shift (widening) and c10's
// integer round to nearest even (narrowing), which the compiler vectorises.

/// out[i] = float(src[i]), contiguous src.
template <class T>
inline void widen_loop(const T* src, int64_t n, float* out) noexcept {  // src, out: [n]
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
}
inline void widen_loop(const c10::BFloat16* src, int64_t n, float* out) noexcept {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(src[i]);
}

/// out[i] = T(x[i]) with round to nearest even.
template <class T>
inline void narrow_loop(const float* x, int64_t n, T* out) noexcept {  // x, out: [n]
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(x[i]);
}
inline void narrow_loop(const float* x, int64_t n, c10::BFloat16* out) noexcept {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(x[i]);
}

}  // namespace quant
}  // namespace cpu
}  // namespace pagedkv
