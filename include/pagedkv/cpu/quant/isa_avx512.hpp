// The codecs' AVX-512 path (F, BW, VL): the scalar functions of scalar.hpp
// spelled in intrinsics, 16 elements at a time, and fp16 <-> float32 rows
// by F16C at 512 bits. The amax of fp16 / bf16 rows inlines the AVX2 path's
// (isa_avx2.hpp), which is as fast. Each function is compiled for that
// target alone (PAGEDKV_TARGET_AVX512); cpu/quant/codecs.hpp calls them only
// where the CPU has the instructions.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "pagedkv/cpu/quant/isa_avx2.hpp"
#include "pagedkv/cpu/quant/scalar.hpp"
#include "pagedkv/simd/isa_avx512.hpp"

#ifdef PAGEDKV_ATTENTION_AVX512

namespace pagedkv {
namespace cpu {
namespace quant {

// AVX-512: the scalar functions' arithmetic spelled in intrinsics, 16
// elements at a time (g++ 12 does not vectorise the scalar loops: it gives
// up on their mixed 8/32-bit types). Same operations, same order, except
// where the encoders say otherwise: the tests check every fp16 input
// and 10^7 random floats bit for bit.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
/// encode_e4m3 of 16 values y, given as y x 2^8 (kE4m3EncodeFactor): the
/// scalar function's result, in fewer operations (the encoder is bound by
/// the two vector ports here). Checked against encode_e4m3 on all 2^32
/// floats (bench/NOTES.md, "Quantized pages (issue 11): codecs, writes,
/// gathers"); the tests check every fp16 input and 10^7 random floats.
/// - A NaN lane is zeroed at the start (the scalar function's magnitude 0).
/// - Saturation is a min at 448 x 2^8 before rounding (rounding is monotonic
///   and 448 a code; infinity too).
/// - A normal code: the magnitude rounded to four significant bits, to
///   nearest even, by Veltkamp's splitting (c = a x (2^20 + 1); a rounded is
///   c - (c - a)); the code is the low byte of its bits >> 20.
/// - A subnormal code (|y| < 2^-6): |y| x 2^8 + 2^22 rounded at 2^22's ulp,
///   2^-1 (2^-9 before the scaling: the scalar m x 512 + 1.5 x 2^23).
/// - One ternary logic op sets the sign.
/// kFiniteRow: y x 2^8 = x / (scale / 2^8) for x in a row of finite values
/// and scale the row's own, amax / 448 rounded (quantize_rows_grouped):
/// no lane is NaN, and |y| <= 448 (1 + 2^-23), which rounds to 448 at four
/// significant bits, so the first two steps go (two of the encoder's ~16
/// operations per 16 values: bench/NOTES.md, "Encoders of a row with its
/// own scale").
template <bool kFiniteRow = false>
PAGEDKV_TARGET_AVX512 inline __m128i encode_e4m3_x16(__m512 y_times_256) {
  const __m512i bits = _mm512_castps_si512(y_times_256);
  __m512 saturated;
  if constexpr (kFiniteRow) {
    saturated = _mm512_abs_ps(y_times_256);
  } else {
    const __mmask16 is_number = _mm512_cmp_ps_mask(y_times_256, y_times_256, _CMP_ORD_Q);
    const __m512 a = _mm512_castsi512_ps(_mm512_maskz_and_epi32(is_number, bits, _mm512_set1_epi32(0x7FFFFFFF)));
    saturated = _mm512_min_ps(a, _mm512_set1_ps(kFp8Max * kE4m3EncodeFactor));
  }
  const __m512 split = _mm512_fmadd_ps(saturated, _mm512_set1_ps(0x1p20f), saturated);
  const __m512 rounded = _mm512_sub_ps(split, _mm512_sub_ps(split, saturated));
  __m512i magnitude = _mm512_srli_epi32(_mm512_castps_si512(rounded), 20);
  const __mmask16 is_subnormal =
      _mm512_cmp_ps_mask(saturated, _mm512_set1_ps(0x1p-6f * kE4m3EncodeFactor), _CMP_LT_OQ);
  magnitude = _mm512_mask_sub_epi32(magnitude, is_subnormal,
                                    _mm512_castps_si512(_mm512_add_ps(saturated, _mm512_set1_ps(0x1p22f))),
                                    _mm512_set1_epi32(0x4A800000));  // the bits of 2^22
  // (sign_bits & 0x80) | magnitude; 0xEA is (A & B) | C. The byte
  // conversion keeps the low byte.
  const __m512i code =
      _mm512_ternarylogic_epi32(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), magnitude, 0xEA);
  return _mm512_cvtepi32_epi8(code);
}

/// encode_int8 of 16 values y: clamped to [-127, 127] (min / max return y
/// when it is NaN, as their operands are ordered here), converted with
/// round to nearest even; a NaN converts to 0x80000000, whose low byte,
/// the one the byte conversion keeps, is 0.
PAGEDKV_TARGET_AVX512 inline __m128i encode_int8_x16(__m512 y) {
  const __m512 clamped =
      _mm512_max_ps(_mm512_set1_ps(-kInt8Max), _mm512_min_ps(_mm512_set1_ps(kInt8Max), y));
  return _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/// decode_e4m3_times_x8 on 16 codes.
PAGEDKV_TARGET_AVX512 inline __m512 decode_e4m3_times_x16(const uint8_t* codes, __m512 scale_via_half) {
  const __m512 scaled = simd::Avx512::load16(reinterpret_cast<const simd::E4m3Code*>(codes));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(_mm512_abs_ps(scaled), _mm512_set1_ps(kE4m3NanViaHalf), _CMP_EQ_OQ);
  return _mm512_mask_mul_ps(_mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()), static_cast<__mmask16>(~is_nan),
                            scaled, scale_via_half);
}

/// encode_int8_of_row_avx2 on AVX-512: int8_lanes_of_row_x8's steps, 16
/// lanes at a time. Here the low byte of each lane is its code (a NaN's
/// 0x80000000 gives 0). The quotient by reciprocal with the clamp kept was
/// slower than the division and dropping the clamp alone gained little; the
/// two pay together (bench/NOTES.md, "Encoders of a row with its own scale").
template <class T>
PAGEDKV_TARGET_AVX512 void encode_int8_of_row_avx512(const T* x, int64_t n, float scale, int8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 r = _mm512_set1_ps(1.0f / scale);
  const int64_t full = n - n % 16;
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 v = simd::Avx512::load16(x + i);
    const __m512 y0 = _mm512_mul_ps(v, r);
    const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(y0, s, v), r, y0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
  for (int64_t i = full; i < n; ++i) out[i] = encode_int8(simd::to_float32(x[i]) / scale);
}

/// Codes of x / scale, scale > 0; x float32, fp16 or bf16, widened as it is loaded.
/// fp8 divides by scale / 2^8 (e4m3_divisor_is_exact), for encode_e4m3_x16.
/// kFiniteRow (fp8): encode_e4m3_x16's.
template <KVFormat F, class T, bool kFiniteRow = false>
PAGEDKV_TARGET_AVX512 void encode_avx512(const T* x, int64_t n, float scale, typename Codec<F>::Code* out) {
  constexpr bool kFp8 = F == KVFormat::fp8_e4m3;
  const __m512 s = _mm512_set1_ps(kFp8 ? scale / kE4m3EncodeFactor : scale);
  const int64_t full = !kFp8 || e4m3_divisor_is_exact(scale) ? n - n % 16 : 0;
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 y = _mm512_div_ps(simd::Avx512::load16(x + i), s);
    const __m128i codes = F == KVFormat::int8 ? encode_int8_x16(y) : encode_e4m3_x16<kFiniteRow>(y);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), codes);
  }
  for (int64_t i = full; i < n; ++i) out[i] = Codec<F>::encode(simd::to_float32(x[i]) / scale);
}

/// encode_row_avx2 on AVX-512.
template <KVFormat F, class T>
PAGEDKV_TARGET_AVX512 void encode_row_avx512(const T* x, int64_t n, float scale, bool all_finite,
                                             typename Codec<F>::Code* out) {
  if constexpr (F == KVFormat::int8) {
    if (int8_quotient_by_reciprocal_is_exact(scale)) return encode_int8_of_row_avx512(x, n, scale, out);
  } else {
    if (all_finite) return encode_avx512<F, T, true>(x, n, scale, out);
  }
  encode_avx512<F, T>(x, n, scale, out);
}

/// amax_loop on AVX-512, widening every element (two accumulators: half
/// the dependency chain).
template <class T>
PAGEDKV_TARGET_AVX512 float amax_widened_avx512(const T* x, int64_t n) {  // x: [n]
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 m0 = _mm512_setzero_ps();
  __m512 m1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    // max returns its second operand for a NaN: ignored, as in amax_loop.
    m0 = _mm512_max_ps(
        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(simd::Avx512::load16(x + i)), abs_mask)),
        m0);
    m1 = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(
                           _mm512_castps_si512(simd::Avx512::load16(x + i + 16)), abs_mask)),
                       m1);
  }
  for (; i + 16 <= n; i += 16) {
    m0 = _mm512_max_ps(
        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(simd::Avx512::load16(x + i)), abs_mask)),
        m0);
  }
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));  // max is exact in any order
  for (; i < n; ++i) {
    const float a = std::fabs(simd::to_float32(x[i]));
    amax = a > amax ? a : amax;
  }
  return amax;
}

/// amax_loop on AVX-512. fp16 / bf16 rows take amax_bits16_avx2, inlined
/// here: its 16-bit max handles 16 elements per 256-bit operation without
/// widening them, where widening every element to 16 float32 lanes took
/// twice the operations (bench/NOTES.md, "amax on the bits on AVX-512").
template <class T>
PAGEDKV_TARGET_AVX512 RowAmax amax_avx512(const T* x, int64_t n) {  // x: [n]
  if constexpr (sizeof(T) == 2) {
    return amax_bits16_avx2(x, n);
  } else {
    return {amax_widened_avx512(x, n), false};
  }
}

template <KVFormat F, class T>
PAGEDKV_TARGET_AVX512 __attribute__((flatten)) void quantize_rows_avx512(const T* x, int64_t x_stride, int64_t count,
                                                                         int64_t n, typename Codec<F>::Code* out,
                                                                         int64_t out_stride, float* scales,
                                                                         int64_t scale_stride) {
  quantize_rows_grouped<F, T, amax_avx512<T>, encode_row_avx512<F, T>>(x, x_stride, count, n, out, out_stride, scales,
                                                                     scale_stride);
}

/// Stores 16 floats as T, rounded as narrow_loop rounds them.
PAGEDKV_TARGET_AVX512 inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
PAGEDKV_TARGET_AVX512 inline void store16(c10::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/// float_to_bf16 on 16 lanes: their bits.
PAGEDKV_TARGET_AVX512 inline __m256i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                   _mm512_set1_epi32(0x7F800000));
  rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}
PAGEDKV_TARGET_AVX512 inline void store16(c10::BFloat16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16_bits16(v));
}

/// store16 with a streaming (non-temporal) store; `out` aligned to the 16 elements' bytes.
PAGEDKV_TARGET_AVX512 inline void stream16(float* out, __m512 v) { _mm512_stream_ps(out, v); }
PAGEDKV_TARGET_AVX512 inline void stream16(c10::Half* out, __m512 v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
PAGEDKV_TARGET_AVX512 inline void stream16(c10::BFloat16* out, __m512 v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(out), bf16_bits16(v));
}

/// out[i] = T(decode(codes[i]) * scale) in one pass (T = float: decode_row).
/// kStream: streaming stores, for an `out` of whole 64-byte lines (streams_row).
template <KVFormat F, class T, bool kStream = false>
PAGEDKV_TARGET_AVX512 void dequantize_avx512(const typename Codec<F>::Code* codes, int64_t n, float scale, T* out) {
  const float vector_scale = F == KVFormat::fp8_e4m3 ? scale * simd::kE4m3ViaHalfFactor : scale;
  const int64_t full = vector_scale_is_exact(scale, vector_scale) ? n - n % 16 : 0;
  const __m512 s = _mm512_set1_ps(vector_scale);
  for (int64_t i = 0; i < full; i += 16) {
    __m512 v;
    if constexpr (F == KVFormat::int8) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
      v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), s);
    } else {
      v = decode_e4m3_times_x16(codes + i, s);
    }
    if constexpr (kStream) {
      stream16(out + i, v);
    } else {
      store16(out + i, v);
    }
  }
  for (int64_t i = full; i < n; ++i) out[i] = narrow_value<T>(Codec<F>::decode(codes[i]) * scale);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// GCC 12's AVX-512 conversion intrinsics pass _mm512_undefined_ps() as the
// masked-off source, which -Wmaybe-uninitialized flags (as simd/isa_avx512.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
template <class T>
PAGEDKV_TARGET_AVX512 __attribute__((flatten)) void widen_avx512(const T* src, int64_t n, float* out) {
  widen_loop(src, n, out);
}
PAGEDKV_TARGET_AVX512 inline void widen_avx512(const c10::Half* src, int64_t n, float* out) {
  const int64_t full = n - n % 16;
  for (int64_t i = 0; i < full; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
  for (int64_t i = full; i < n; ++i) out[i] = static_cast<float>(src[i]);
}
template <class T>
PAGEDKV_TARGET_AVX512 __attribute__((flatten)) void narrow_avx512(const float* x, int64_t n, T* out) {
  narrow_loop(x, n, out);
}
PAGEDKV_TARGET_AVX512 inline void narrow_avx512(const float* x, int64_t n, c10::Half* out) {
  const int64_t full = n - n % 16;
  for (int64_t i = 0; i < full; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (int64_t i = full; i < n; ++i) out[i] = static_cast<c10::Half>(x[i]);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace quant
}  // namespace cpu
}  // namespace pagedkv

#endif  // PAGEDKV_ATTENTION_AVX512
