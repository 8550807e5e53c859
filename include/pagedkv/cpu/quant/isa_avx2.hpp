// The codecs' AVX2 path (AVX2 + FMA + F16C; x86-64 with g++ or clang): the
// scalar functions of scalar.hpp spelled in intrinsics, 8 elements at a
// time, and fp16 <-> float32 rows by F16C. Each function is compiled for
// that target alone (PAGEDKV_TARGET_AVX2); cpu/quant/codecs.hpp calls them only
// where the CPU has the instructions.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "pagedkv/cpu/quant/scalar.hpp"
#include "pagedkv/simd/isa_avx2.hpp"

#ifdef PAGEDKV_ATTENTION_AVX2

namespace pagedkv {
namespace cpu {
namespace quant {

// AVX2 + FMA + F16C: the scalar functions' arithmetic spelled in
// intrinsics, 8 elements at a time (g++ 12 does not vectorise the scalar
// loops, as for AVX-512). AVX2 has no mask registers and no 32 -> 8 bit
// narrowing: selects are blendv / and-not on all-ones compare lanes, and
// codes are narrowed with two saturating packs (exact: every lane already
// holds a byte's value). Same operations, same order as the scalar ones:
// the tests check every fp16 input and 10^7 random floats bit for bit.

/// The low byte of each of 8 int32 lanes holding values in [0, 255]
/// (`is_signed`: [-128, 127]), in order, in the low 8 bytes.
template <bool is_signed>
PAGEDKV_TARGET_AVX2 inline __m128i narrow_epi32_epi8_x8(__m256i v) {
  const __m128i lo = _mm256_castsi256_si128(v);
  const __m128i hi = _mm256_extracti128_si256(v, 1);
  if (is_signed) {
    const __m128i words = _mm_packs_epi32(lo, hi);
    return _mm_packs_epi16(words, words);
  }
  const __m128i words = _mm_packus_epi32(lo, hi);
  return _mm_packus_epi16(words, words);
}

/// The low bytes of 32 int32 lanes (a, b, c, d: 8 each, values as for
/// narrow_epi32_epi8_x8), in order: 4 shuffles where four narrow_epi32_epi8_x8
/// take 12, which made them the bottleneck of the AVX2 encoders (bench/NOTES.md,
/// "Narrowing 32 codes at a time").
template <bool is_signed>
PAGEDKV_TARGET_AVX2 inline __m256i narrow_epi32_epi8_x32(__m256i a, __m256i b, __m256i c, __m256i d) {
  // Packs work within 128-bit halves: bytes come out as a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7.
  const __m256i bytes = is_signed ? _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d))
                                  : _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/// encode_e4m3_x8 and encode_e4m3_x16 take y x 2^8: a normal code's value
/// (2^-6 .. 448) then has a float exponent field of 129 .. 143, whose low
/// four bits are the code's exponent field, so the code's magnitude is the
/// low seven bits of the float's bits >> 20 once it is rounded to four
/// significant bits.
constexpr float kE4m3EncodeFactor = 256.0f;

/// Whether the vector encoders may divide by scale / kE4m3EncodeFactor:
/// when that is a normal float, the quotient is exactly 2^8 x (x / scale)
/// rounded (a subnormal one would not be; such a row, of a scale below
/// 2^-118, from float32 or bf16 rows whose largest magnitude is below
/// ~1.3e-33, takes the scalar loop).
inline bool e4m3_divisor_is_exact(float scale) noexcept { return scale >= 0x1p-118f; }

/// encode_e4m3 of 8 values y, given as y x 2^8 (kE4m3EncodeFactor), as
/// int32 lanes in [0, 255]: encode_e4m3_x16's steps (which say why they are
/// the scalar function's) except two, for AVX2 on Zen 3, whose encoder was
/// bound by the latency of each vector's chain of operations:
/// - A NaN lane is zeroed by a max with 0 (max_ps returns its second
///   operand for a NaN): one operation instead of a compare and a mask.
/// - A normal code is rounded in the integer bits, as encode_e4m3 rounds it
///   (add 0x7FFFF and the lowest kept bit, then shift): a chain of 5 one-cycle
///   operations where Veltkamp's split (an FMA and two subtractions) takes 11.
/// This is the magnitude (the low seven bits); encode_e4m3_x8 adds the sign.
/// kFiniteRow: encode_e4m3_x16's, no NaN lane and no saturation.
template <bool kFiniteRow = false>
PAGEDKV_TARGET_AVX2 inline __m256i encode_e4m3_magnitude_x8(__m256 y_times_256) {
  const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 saturated = _mm256_and_ps(y_times_256, magnitude_bits);
  if constexpr (!kFiniteRow) {
    saturated = _mm256_min_ps(_mm256_max_ps(saturated, _mm256_setzero_ps()),
                              _mm256_set1_ps(kFp8Max * kE4m3EncodeFactor));
  }
  const __m256i saturated_bits = _mm256_castps_si256(saturated);
  const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(saturated_bits, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(saturated_bits, _mm256_set1_epi32(0x7FFFF)), lowest_kept);
  const __m256i normal = _mm256_and_si256(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(0x7F));
  const __m256i subnormal = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(saturated, _mm256_set1_ps(0x1p22f))),
                                             _mm256_set1_epi32(0x4A800000));  // the bits of 2^22
  const __m256 is_subnormal = _mm256_cmp_ps(saturated, _mm256_set1_ps(0x1p-6f * kE4m3EncodeFactor), _CMP_LT_OQ);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(subnormal), is_subnormal));
}

/// encode_e4m3 of 8 values y, given as y x 2^8, as int32 lanes in [0, 255].
template <bool kFiniteRow = false>
PAGEDKV_TARGET_AVX2 inline __m256i encode_e4m3_x8(__m256 y_times_256) {
  const __m256i bits = _mm256_castps_si256(y_times_256);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  return _mm256_or_si256(sign, encode_e4m3_magnitude_x8<kFiniteRow>(y_times_256));
}

/// The sign bits of 32 fp16 or bf16 values, as bytes 0x80 / 0x00 in order:
/// an fp8 code's sign is its input's (x / scale, scale > 0 and finite; a
/// NaN input keeps its sign through the division), so from 16-bit inputs
/// the encoder takes it 32 at a time here, 5 operations, instead of 3 per 8
/// lanes from the quotients.
template <class T>
PAGEDKV_TARGET_AVX2 inline __m256i sign_bytes_x32(const T* x) {  // x: [32]
  const __m256i s0 = _mm256_srai_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), 15);
  const __m256i s1 = _mm256_srai_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)), 15);
  // The pack interleaves the two inputs' 128-bit halves; 0xD8 puts them back in order.
  return _mm256_and_si256(_mm256_permute4x64_epi64(_mm256_packs_epi16(s0, s1), 0xD8), _mm256_set1_epi8(-128));
}

/// encode_int8 of 8 values y, as int32 lanes in [-127, 127], except NaN
/// lanes: clamped with min / max (ordered so that a NaN passes through),
/// converted in the default rounding mode, to nearest even (that of
/// round_half_even too). A NaN converts to 0x80000000, which narrows to the
/// byte -128, a code no number gives; without_nan_codes makes it 0 once
/// per 32 narrowed codes, cheaper than zeroing the NaN lanes of every 8
/// here (the encoder is bound by its division; the rest shares its pipe).
PAGEDKV_TARGET_AVX2 inline __m256i encode_int8_x8(__m256 y) {
  const __m256 clamped = _mm256_max_ps(_mm256_set1_ps(-kInt8Max), _mm256_min_ps(_mm256_set1_ps(kInt8Max), y));
  return _mm256_cvtps_epi32(clamped);
}

/// Narrowed codes of format F with encode_int8_x8's NaN bytes (-128) made
/// 0, encode_int8's code for NaN; fp8 codes unchanged.
template <KVFormat F>
PAGEDKV_TARGET_AVX2 inline __m256i without_nan_codes(__m256i codes) {
  if constexpr (F == KVFormat::int8) {
    return _mm256_andnot_si256(_mm256_cmpeq_epi8(codes, _mm256_set1_epi8(-128)), codes);
  } else {
    return codes;
  }
}
template <KVFormat F>
PAGEDKV_TARGET_AVX2 inline __m128i without_nan_codes(__m128i codes) {
  if constexpr (F == KVFormat::int8) {
    return _mm_andnot_si128(_mm_cmpeq_epi8(codes, _mm_set1_epi8(-128)), codes);
  } else {
    return codes;
  }
}

/// What the NaN codes 0x7F / 0xFF read as through fp16 (Avx2::load8,
/// Avx512::load16): +-480 / 2^8.
constexpr float kE4m3NanViaHalf = 480.0f / simd::kE4m3ViaHalfFactor;

/// Whether the vector dequantizers' scale (fp8: scale * 2^8, see
/// decode_e4m3_times_x8) is exact: it is unless scale * 2^8 overflows, for
/// a scale above 2^120 that the encoder never writes; such a row takes the
/// scalar loop.
inline bool vector_scale_is_exact(float scale, float vector_scale) noexcept {
  return !(std::isinf(vector_scale) && std::isfinite(scale));
}

/// decode_e4m3(c) * scale of the 8 codes at `codes`, given
/// `scale_via_half` = scale * 2^8 (the caller checks that it is exact).
/// Read through fp16 a code is e4m3(c) / 2^8, subnormals included
/// (Avx2::load8), so the product is the same real number, rounded once.
/// The NaN codes 0x7F / 0xFF, which read as +-480 / 2^8 that way, give NaN.
PAGEDKV_TARGET_AVX2 inline __m256 decode_e4m3_times_x8(const uint8_t* codes, __m256 scale_via_half) {
  const __m256 scaled = simd::Avx2::load8(reinterpret_cast<const simd::E4m3Code*>(codes));
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), scaled);
  const __m256 is_nan = _mm256_cmp_ps(magnitude, _mm256_set1_ps(kE4m3NanViaHalf), _CMP_EQ_OQ);
  return _mm256_blendv_ps(_mm256_mul_ps(scaled, scale_via_half),
                          _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), is_nan);
}

/// The codes of x[0, 8) / divisor as int32 lanes (encode_avx2's divisor);
/// kMagnitudes (fp8 only): without their sign bits; kFiniteRow (fp8 only):
/// encode_e4m3_magnitude_x8's.
template <KVFormat F, class T, bool kMagnitudes = false, bool kFiniteRow = false>
PAGEDKV_TARGET_AVX2 inline __m256i encode_lanes_x8(const T* x, __m256 divisor) {
  const __m256 y = _mm256_div_ps(simd::Avx2::load8(x), divisor);
  if constexpr (F == KVFormat::int8) return encode_int8_x8(y);
  return kMagnitudes ? encode_e4m3_magnitude_x8<kFiniteRow>(y) : encode_e4m3_x8<kFiniteRow>(y);
}

/// The codes of x[0, 32) / divisor as bytes, narrowed together: a third of
/// the shuffles of narrowing 8 at a time. kMagnitudes, kFiniteRow: as encode_lanes_x8.
template <KVFormat F, class T, bool kMagnitudes = false, bool kFiniteRow = false>
PAGEDKV_TARGET_AVX2 inline __m256i encode_x32(const T* x, __m256 divisor) {  // x: [32]
  const __m256i codes = narrow_epi32_epi8_x32<F == KVFormat::int8>(
      encode_lanes_x8<F, T, kMagnitudes, kFiniteRow>(x, divisor),
      encode_lanes_x8<F, T, kMagnitudes, kFiniteRow>(x + 8, divisor),
      encode_lanes_x8<F, T, kMagnitudes, kFiniteRow>(x + 16, divisor),
      encode_lanes_x8<F, T, kMagnitudes, kFiniteRow>(x + 24, divisor));
  return without_nan_codes<F>(codes);
}

/// Whether encode_int8_of_row_avx2 / _avx512 may take x / scale as
/// Markstein's quotient: from 2^-100 up, every x whose quotient could round
/// to a nonzero code, |x| >= scale / 2 >= 2^-101, leaves an exact
/// remainder (below, a subnormal scale's reciprocal overflows). Up to
/// 2^100: the range checked against the division on 1.6 x 10^10 quotients
/// (bench/tools/int8_reciprocal_check). Every fp16 row qualifies (scales 2^-31 .. 516);
/// bf16 and float32 rows outside it take the division.
inline bool int8_quotient_by_reciprocal_is_exact(float scale) noexcept {
  return scale >= 0x1p-100f && scale <= 0x1p100f;
}

/// int8 codes of x[0, 8) / scale as int32 lanes, for a row whose scale is
/// its own amax / 127 (encode_int8_of_row_avx2), given r = 1 / scale:
/// - x / scale is Markstein's correctly rounded quotient: y0 = x * r, the
///   remainder x - y0 * scale (exact, one FMA), y = y0 + remainder * r
///   (one FMA, rounded once): the division's result bit for bit where int8
///   rounding can tell (int8_quotient_by_reciprocal_is_exact), in three
///   FMA-pipe operations instead of the divider's.
/// - No clamp to [-127, 127]: |x| <= amax and scale = amax / 127 rounded,
///   so |x / scale| <= 127 (1 + 2^-23), whose rounding is at most 127.
///   A NaN converts to 0x80000000, which narrows to -128 as in
///   encode_int8_x8.
template <class T>
PAGEDKV_TARGET_AVX2 inline __m256i int8_lanes_of_row_x8(const T* x, __m256 scale, __m256 reciprocal) {  // x: [8]
  const __m256 v = simd::Avx2::load8(x);
  const __m256 y0 = _mm256_mul_ps(v, reciprocal);
  return _mm256_cvtps_epi32(_mm256_fmadd_ps(_mm256_fnmadd_ps(y0, scale, v), reciprocal, y0));
}

/// Codes of x / scale for a row whose scale is its own (quantize_rows_grouped),
/// int8, through int8_lanes_of_row_x8 (bench/NOTES.md, "Encoders of a row
/// with its own scale"). scale: int8_quotient_by_reciprocal_is_exact.
template <class T>
PAGEDKV_TARGET_AVX2 void encode_int8_of_row_avx2(const T* x,  // [n]
                                                 int64_t n, float scale, int8_t* out) {  // out: [n]
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 r = _mm256_set1_ps(1.0f / scale);
  const int64_t full = n - n % 8;
  int64_t i = 0;
  for (; i + 32 <= full; i += 32) {
    const __m256i codes =
        narrow_epi32_epi8_x32<true>(int8_lanes_of_row_x8(x + i, s, r), int8_lanes_of_row_x8(x + i + 8, s, r),
                                    int8_lanes_of_row_x8(x + i + 16, s, r), int8_lanes_of_row_x8(x + i + 24, s, r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), without_nan_codes<KVFormat::int8>(codes));
  }
  for (; i < full; i += 8) {
    const __m128i codes = narrow_epi32_epi8_x8<true>(int8_lanes_of_row_x8(x + i, s, r));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), without_nan_codes<KVFormat::int8>(codes));
  }
  for (; i < n; ++i) out[i] = encode_int8(simd::to_float32(x[i]) / scale);
}

/// Codes of x / scale, scale > 0; x float32, fp16 or bf16, widened as it
/// is loaded. fp8 divides by scale / 2^8 (e4m3_divisor_is_exact), for encode_e4m3_x8.
/// kFiniteRow (fp8): x is a row of finite values and scale its own
/// (encode_row_avx2), so no quotient is NaN or saturates.
template <KVFormat F, class T, bool kFiniteRow = false>
PAGEDKV_TARGET_AVX2 void encode_avx2(const T* x,  // [n]
                                     int64_t n, float scale,
                                     typename Codec<F>::Code* out) {  // [n]
  constexpr bool kFp8 = F == KVFormat::fp8_e4m3;
  // fp8 from fp16 / bf16: the sign bits from the inputs (sign_bytes_x32).
  // That needs a finite scale: an infinite one makes NaNs of its own (inf /
  // inf: x86's default NaN, negative) whose sign is not the input's; such a
  // row (it holds an infinity) takes the scalar loop.
  constexpr bool kSignsFromInputs = kFp8 && sizeof(T) == 2;
  const __m256 s = _mm256_set1_ps(kFp8 ? scale / kE4m3EncodeFactor : scale);
  const bool vectors = !kFp8 || (e4m3_divisor_is_exact(scale) && (!kSignsFromInputs || std::isfinite(scale)));
  const int64_t full = vectors ? n - n % 8 : 0;
  int64_t i = 0;
  for (; i + 32 <= full; i += 32) {
    __m256i codes = encode_x32<F, T, kSignsFromInputs, kFiniteRow>(x + i, s);
    if constexpr (kSignsFromInputs) codes = _mm256_or_si256(codes, sign_bytes_x32(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), codes);
  }
  for (; i < full; i += 8) {
    const __m128i codes = narrow_epi32_epi8_x8<F == KVFormat::int8>(encode_lanes_x8<F, T, false, kFiniteRow>(x + i, s));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), without_nan_codes<F>(codes));
  }
  for (; i < n; ++i) out[i] = Codec<F>::encode(simd::to_float32(x[i]) / scale);
}

/// Codes of a row with its own scale (quantize_rows_grouped's EncodeRow):
/// int8 through encode_int8_of_row_avx2, fp8 of an all-finite row without
/// the NaN and saturation steps; otherwise encode_avx2.
template <KVFormat F, class T>
PAGEDKV_TARGET_AVX2 void encode_row_avx2(const T* x,  // [n]
                                         int64_t n, float scale, bool all_finite,
                                         typename Codec<F>::Code* out) {  // [n]
  if constexpr (F == KVFormat::int8) {
    if (int8_quotient_by_reciprocal_is_exact(scale)) return encode_int8_of_row_avx2(x, n, scale, out);
  } else {
    if (all_finite) return encode_avx2<F, T, true>(x, n, scale, out);
  }
  encode_avx2<F, T>(x, n, scale, out);
}

/// amax_loop on AVX2, widening every element: max is exact in any order,
/// so any lane split agrees.
template <class T>
PAGEDKV_TARGET_AVX2 float amax_widened_avx2(const T* x, int64_t n) {  // x: [n]
  __m256 m = _mm256_setzero_ps();
  const int64_t full = n - n % 8;
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(
        _mm256_castps_si256(simd::Avx2::load8(x + i)), _mm256_set1_epi32(0x7FFFFFFF)));
    m = _mm256_max_ps(a, m);  // the second operand for a NaN: ignored, as in amax_loop
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float amax = _mm_cvtss_f32(m4);
  for (int64_t i = full; i < n; ++i) {
    const float a = std::fabs(simd::to_float32(x[i]));
    amax = a > amax ? a : amax;
  }
  return amax;
}

/// The bits of +infinity in the 16-bit float T (fp16 or bf16): the
/// magnitude bits of every NaN are larger.
template <class T>
constexpr uint16_t kInfinityBits16 = std::is_same<T, c10::Half>::value ? 0x7C00 : 0x7F80;

/// The float32 value of the bits of a 16-bit float T (fp16 or bf16).
template <class T>
inline float widen_bits16(uint16_t bits) noexcept {
  return simd::to_float32(T(bits, T::from_bits()));
}

/// The magnitude bits (x & 0x7FFF) of 16 fp16 or bf16 values.
template <class T>
PAGEDKV_TARGET_AVX2 inline __m256i magnitude_bits16(const T* x) {  // x: [16]
  return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), _mm256_set1_epi16(0x7FFF));
}

/// amax_loop of fp16 or bf16 on AVX2, on the elements' bits: without NaN,
/// magnitude bits (x & 0x7FFF) order as the magnitudes do, so the largest
/// magnitude is the unsigned 16-bit max of them, widened once, where
/// widening every element made amax a quarter of an int8 quantize. A NaN's
/// magnitude bits exceed infinity's; a row with one (rare) takes the
/// widening loop, which ignores NaN as amax_loop does.
template <class T>
PAGEDKV_TARGET_AVX2 RowAmax amax_bits16_avx2(const T* x, int64_t n) {  // x: [n]
  __m256i m0 = _mm256_setzero_si256();
  __m256i m1 = _mm256_setzero_si256();  // two chains: half the latency
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_epu16(m0, magnitude_bits16(x + i));
    m1 = _mm256_max_epu16(m1, magnitude_bits16(x + i + 16));
  }
  if (i + 16 <= n) {
    m0 = _mm256_max_epu16(m0, magnitude_bits16(x + i));
    i += 16;
  }
  const __m256i m = _mm256_max_epu16(m0, m1);
  const __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  // The largest of 8 lanes: SSE4.1 finds the smallest, here of their complements.
  const __m128i all_ones = _mm_set1_epi16(-1);
  const __m128i smallest_complement = _mm_minpos_epu16(_mm_xor_si128(m8, all_ones));
  auto largest = static_cast<uint16_t>(~_mm_extract_epi16(smallest_complement, 0));
  for (; i < n; ++i) largest = std::max(largest, static_cast<uint16_t>(x[i].x & 0x7FFF));
  if (largest > kInfinityBits16<T>) return {amax_widened_avx2(x, n), false};
  return {widen_bits16<T>(largest), largest < kInfinityBits16<T>};
}

/// amax_loop on AVX2 (float32 rows: finiteness not known).
template <class T>
PAGEDKV_TARGET_AVX2 RowAmax amax_avx2(const T* x, int64_t n) {  // x: [n]
  if constexpr (sizeof(T) == 2) {
    return amax_bits16_avx2(x, n);
  } else {
    return {amax_widened_avx2(x, n), false};
  }
}

template <KVFormat F, class T>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void quantize_rows_avx2(const T* x, int64_t x_stride, int64_t count,
                                                                     int64_t n, typename Codec<F>::Code* out,
                                                                     int64_t out_stride, float* scales,
                                                                     int64_t scale_stride) {
  quantize_rows_grouped<F, T, amax_avx2<T>, encode_row_avx2<F, T>>(x, x_stride, count, n, out, out_stride, scales,
                                                                 scale_stride);
}

/// Stores 8 floats as T, rounded as narrow_loop rounds them.
PAGEDKV_TARGET_AVX2 inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
PAGEDKV_TARGET_AVX2 inline void store8(c10::Half* out, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/// float_to_bf16 on 8 lanes: their bits in the low 128 bits.
PAGEDKV_TARGET_AVX2 inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
  // Every lane holds 0..0xFFFF: the unsigned pack is exact; it packs within
  // 128-bit halves, so the two halves' low quadwords are brought together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  return _mm256_castsi256_si128(packed);
}
PAGEDKV_TARGET_AVX2 inline void store8(c10::BFloat16* out, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bf16_bits8(v));
}

/// store8 with a streaming (non-temporal) store; `out` aligned to the 8 elements' bytes.
PAGEDKV_TARGET_AVX2 inline void stream8(float* out, __m256 v) { _mm256_stream_ps(out, v); }
PAGEDKV_TARGET_AVX2 inline void stream8(c10::Half* out, __m256 v) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
PAGEDKV_TARGET_AVX2 inline void stream8(c10::BFloat16* out, __m256 v) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(out), bf16_bits8(v));
}

/// out[i] = T(decode(codes[i]) * scale) in one pass (T = float: decode_row).
/// kStream: streaming stores, for an `out` of whole 64-byte lines (streams_row).
template <KVFormat F, class T, bool kStream = false>
PAGEDKV_TARGET_AVX2 void dequantize_avx2(const typename Codec<F>::Code* codes, int64_t n, float scale, T* out) {
  const float vector_scale = F == KVFormat::fp8_e4m3 ? scale * simd::kE4m3ViaHalfFactor : scale;
  const int64_t full = vector_scale_is_exact(scale, vector_scale) ? n - n % 8 : 0;
  const __m256 s = _mm256_set1_ps(vector_scale);
  for (int64_t i = 0; i < full; i += 8) {
    __m256 v;
    if constexpr (F == KVFormat::int8) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
      v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), s);
    } else {
      v = decode_e4m3_times_x8(codes + i, s);
    }
    if constexpr (kStream) {
      stream8(out + i, v);
    } else {
      store8(out + i, v);
    }
  }
  for (int64_t i = full; i < n; ++i) out[i] = narrow_value<T>(Codec<F>::decode(codes[i]) * scale);
}

template <class T>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void widen_avx2(const T* src, int64_t n, float* out) {
  widen_loop(src, n, out);
}
PAGEDKV_TARGET_AVX2 inline void widen_avx2(const c10::Half* src, int64_t n, float* out) {
  const int64_t full = n - n % 8;
  for (int64_t i = 0; i < full; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (int64_t i = full; i < n; ++i) out[i] = static_cast<float>(src[i]);
}
template <class T>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void narrow_avx2(const float* x, int64_t n, T* out) {
  narrow_loop(x, n, out);
}
PAGEDKV_TARGET_AVX2 inline void narrow_avx2(const float* x, int64_t n, c10::Half* out) {
  const int64_t full = n - n % 8;
  for (int64_t i = 0; i < full; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (int64_t i = full; i < n; ++i) out[i] = static_cast<c10::Half>(x[i]);
}

}  // namespace quant
}  // namespace cpu
}  // namespace pagedkv

#endif  // PAGEDKV_ATTENTION_AVX2
