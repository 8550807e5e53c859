// The attention kernel's arithmetic with AVX2, FMA and F16C intrinsics
// (x86-64, g++ or clang), 8 floats per instruction. Keys and values are read
// straight from the pages (float32, fp16, bf16, or fp8 / int8 codes) and
// converted as they are loaded: no float32 copy of a block is made. Each
// function is compiled for that target alone (PAGEDKV_TARGET_AVX2), so one
// binary runs everywhere; isa.hpp checks the CPU at run time. Same results as Portable
// (isa_portable.hpp) within float rounding.
#pragma once

#if defined(__GNUC__) && defined(__x86_64__)
#define PAGEDKV_ATTENTION_AVX2 1

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "pagedkv/simd/constants.hpp"
#include "pagedkv/simd/convert.hpp"

#define PAGEDKV_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace pagedkv {
namespace simd {

struct Avx2 {
  /// scores and accumulate read the pages' own elements.
  static constexpr bool kReadsPagesDirectly = true;

  /// out[r * kKeyBlock + j] = dot(q[r], keys[j]) for rows <= kRowsAtOnce:
  /// each key vector loaded (and converted) once serves every row.
  template <class E>
  PAGEDKV_TARGET_AVX2 static void scores(const float* const* q,  // rows x [D]
                                         int rows,
                                         const void* const* keys, // n x [D]
                                         int64_t n, int64_t head_dim,
                                         float* out) noexcept {  // [rows, kKeyBlock]
    switch (rows) {
      case 4: return scores_rows<4, E>(q, keys, n, head_dim, out);
      case 3: return scores_rows<3, E>(q, keys, n, head_dim, out);
      case 2: return scores_rows<2, E>(q, keys, n, head_dim, out);
      default: return scores_rows<1, E>(q, keys, n, head_dim, out);
    }
  }

  /// The largest of scores[0, n), n >= 1.
  PAGEDKV_TARGET_AVX2 static float max(const float* scores,  // [n]
                                       int64_t n) noexcept {
    __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(scores + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float best = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    for (; j < n; ++j) best = scores[j] > best ? scores[j] : best;
    return best;
  }

  /// scores[j] = exp(scores[j] - max); returns their sum.
  PAGEDKV_TARGET_AVX2 static float exp_sum(float* scores,  // [n]
                                           int64_t n, float max) noexcept {
    const __m256 m = _mm256_set1_ps(max);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp_non_positive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
      _mm256_storeu_ps(scores + j, e);
      acc = _mm256_add_ps(acc, e);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    float sum = _mm_cvtss_f32(s);
    for (; j < n; ++j) {
      scores[j] = std::exp(scores[j] - max);
      sum += scores[j];
    }
    return sum;
  }


  /// acc[r] += sum_j p[r * kKeyBlock + j] * v[j] for rows <= kRowsAtOnce:
  /// each value vector loaded (and converted) once serves every row.
  template <class E>
  PAGEDKV_TARGET_AVX2 static void accumulate(float* const* acc,  // rows x [D]
                                             int rows,
                                             const void* const* v,// n x [D]
                                             const float* p,     // [rows, kKeyBlock]
                                             int64_t n, int64_t head_dim) noexcept {
    switch (rows) {
      case 4: return accumulate_rows<4, E>(acc, v, p, n, head_dim);
      case 3: return accumulate_rows<3, E>(acc, v, p, n, head_dim);
      case 2: return accumulate_rows<2, E>(acc, v, p, n, head_dim);
      default: return accumulate_rows<1, E>(acc, v, p, n, head_dim);
    }
  }

  PAGEDKV_TARGET_AVX2 static void scale(float* row,  // [n]
                                        float factor, int64_t n) noexcept {
    const __m256 f = _mm256_set1_ps(factor);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(row + d, _mm256_mul_ps(f, _mm256_loadu_ps(row + d)));
    for (; d < n; ++d) row[d] *= factor;
  }

 public:
  // 8 elements as float32 (also the codecs' loads, cpu/quant/isa_avx2.hpp).
  PAGEDKV_TARGET_AVX2 static __m256 load8(const float* p) noexcept { return _mm256_loadu_ps(p); }
  PAGEDKV_TARGET_AVX2 static __m256 load8(const c10::Half* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  PAGEDKV_TARGET_AVX2 static __m256 load8(const c10::BFloat16* p) noexcept {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  /// 8 fp8 codes as e4m3(c) / 2^8: Avx512::load16's decode, 8 lanes.
  PAGEDKV_TARGET_AVX2 static __m256 load8(const E4m3Code* p) noexcept {
    const __m128i widened = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(widened, 7), _mm_set1_epi16(-0x4001)));
  }
  PAGEDKV_TARGET_AVX2 static __m256 load8(const int8_t* p) noexcept {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }

  /// v, kept in a register. g++ otherwise folds a load that several FMAs
  /// use into each of them as a memory operand: the score loop then loaded
  /// each query vector once per key, 10 loads per 8 FMAs, and waited on the
  /// load ports (bench/NOTES.md, "Query vectors in registers").
  PAGEDKV_TARGET_AVX2 static __m256 in_register(__m256 v) noexcept {
    __asm__("" : "+x"(v));
    return v;
  }

  /// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp; inputs below -87
  /// give ~1e-38 instead of denormals or 0).
  PAGEDKV_TARGET_AVX2 static __m256 exp_non_positive(__m256 x) noexcept {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  }

  /// [sum(s0), sum(s1), sum(s2), sum(s3)], reduced with unpacks and
  /// shuffles: beside FMAs these are nearly free, where vhaddps and
  /// vperm2f128 are not (bench/NOTES.md, "Three keys per score pass").
  PAGEDKV_TARGET_AVX2 static __m128 sum4(__m256 s0, __m256 s1, __m256 s2, __m256 s3) noexcept {
    const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(s0, s1), _mm256_unpackhi_ps(s0, s1));
    const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(s2, s3), _mm256_unpackhi_ps(s2, s3));
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  }

 private:
  /// `count` (< 8) elements as float32, zeros after (the tail of an odd head_dim).
  template <class E>
  PAGEDKV_TARGET_AVX2 static __m256 load_first(const E* p, int64_t count) noexcept {
    alignas(32) float buffer[8] = {};
    for (int64_t i = 0; i < count; ++i) buffer[i] = to_float32(p[i]);
    return _mm256_load_ps(buffer);
  }

  /// Scores of R rows against K keys starting at keys[0]: R x K independent
  /// FMA chains over head_dim, then out[r * kKeyBlock + k].
  template <int R, int K, class E>
  PAGEDKV_TARGET_AVX2 static void score_keys(const float* const* q,  // R x [D]
                                             const void* const* keys, // K x [D]
                                             int64_t head_dim, float* out) noexcept {
    __m256 acc[K][4];
    for (int k = 0; k < K; ++k)
      for (int r = 0; r < 4; ++r) acc[k][r] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) {
      __m256 q_d[R];
      for (int r = 0; r < R; ++r) q_d[r] = in_register(_mm256_loadu_ps(q[r] + d));
      for (int k = 0; k < K; ++k) {
        const __m256 key = load8(row_as<E>(keys[k]) + d);
        for (int r = 0; r < R; ++r) acc[k][r] = _mm256_fmadd_ps(key, q_d[r], acc[k][r]);
      }
    }
    if (d < head_dim) {
      for (int k = 0; k < K; ++k) {
        const __m256 key = load_first(row_as<E>(keys[k]) + d, head_dim - d);
        for (int r = 0; r < R; ++r)
          acc[k][r] = _mm256_fmadd_ps(key, load_first(q[r] + d, head_dim - d), acc[k][r]);
      }
    }
    alignas(16) float sums[4];
    if constexpr (R == 1 && K == 4) {  // four keys of one row at once
      _mm_store_ps(sums, sum4(acc[0][0], acc[1][0], acc[2][0], acc[3][0]));
      for (int k = 0; k < K; ++k) out[k] = sums[k];
    } else {
      for (int k = 0; k < K; ++k) {
        _mm_store_ps(sums, sum4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]));
        for (int r = 0; r < R; ++r) out[r * kKeyBlock + k] = sums[r];
      }
    }
  }

  template <int R, class E>
  PAGEDKV_TARGET_AVX2 static void scores_rows(const float* const* q,  // R x [D]
                                              const void* const* keys, // n x [D]
                                              int64_t n, int64_t head_dim,
                                              float* out) noexcept {  // [R, kKeyBlock]
    constexpr int kKeys = R == 1 ? 4 : 2;  // keys per pass: enough independent chains
    int64_t j = 0;
    for (; j + kKeys <= n; j += kKeys) score_keys<R, kKeys, E>(q, keys + j, head_dim, out + j);
    for (; j < n; ++j) score_keys<R, 1, E>(q, keys + j, head_dim, out + j);
  }

  template <int R, class E>
  PAGEDKV_TARGET_AVX2 static void accumulate_rows(float* const* acc,  // R x [D]
                                                  const void* const* v,// n x [D]
                                                  const float* p,     // [R, kKeyBlock]
                                                  int64_t n, int64_t head_dim) noexcept {
    int64_t d = 0;
    for (; d + 16 <= head_dim; d += 16) {  // two chains per row
      __m256 a[R], b[R];
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_loadu_ps(acc[r] + d);
        b[r] = _mm256_loadu_ps(acc[r] + d + 8);
      }
      for (int64_t j = 0; j < n; ++j) {
        const __m256 v0 = load8(row_as<E>(v[j]) + d);
        const __m256 v1 = load8(row_as<E>(v[j]) + d + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 pj = _mm256_broadcast_ss(p + r * kKeyBlock + j);
          a[r] = _mm256_fmadd_ps(pj, v0, a[r]);
          b[r] = _mm256_fmadd_ps(pj, v1, b[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(acc[r] + d, a[r]);
        _mm256_storeu_ps(acc[r] + d + 8, b[r]);
      }
    }
    for (; d + 8 <= head_dim; d += 8) {
      __m256 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc[r] + d);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 v0 = load8(row_as<E>(v[j]) + d);
        for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * kKeyBlock + j), v0, a[r]);
      }
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc[r] + d, a[r]);
    }
    for (; d < head_dim; ++d)  // the tail of an odd head_dim
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < n; ++j) acc[r][d] += p[r * kKeyBlock + j] * to_float32(row_as<E>(v[j])[d]);
  }
};

}  // namespace simd
}  // namespace pagedkv

#endif  // __GNUC__ && __x86_64__
