// The attention kernel's arithmetic with AVX-512F intrinsics, 16 floats per
// instruction. Like Avx2 it reads keys and values straight from the pages
// (float32, fp16, bf16, or fp8 / int8 codes), converting as it loads. Compiled for that target
// alone (PAGEDKV_TARGET_AVX512) and chosen at run time by isa.hpp on CPUs
// that have it. Same results as Portable within float rounding.
#pragma once

#include "pagedkv/simd/isa_avx2.hpp"

#ifdef PAGEDKV_ATTENTION_AVX2  // x86-64 with g++ or clang: AVX-512 intrinsics exist too
#define PAGEDKV_ATTENTION_AVX512 1

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "pagedkv/simd/constants.hpp"
#include "pagedkv/simd/convert.hpp"

#define PAGEDKV_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
/// AVX-512 BF16 dot products on 256-bit vectors, and everything the AVX2
/// path uses (cpu_has_avx512_bf16 says whether the CPU runs it).
#define PAGEDKV_TARGET_AVX512_BF16 __attribute__((target("avx512bf16,avx512vl,avx512f,avx2,fma,f16c")))

// g++ 12 reports "'__Y' may be used uninitialized" inside its own
// avx512fintrin.h wherever an intrinsic built on _mm512_undefined_*() is
// inlined (GCC bug 105593, fixed in g++ 13): a false positive that -Werror
// builds of engines would fail on.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define PAGEDKV_AVX512_DIAGNOSTICS_PUSHED 1
#endif

namespace pagedkv {
namespace simd {

struct Avx512 {
  /// scores and accumulate read the pages' own elements.
  static constexpr bool kReadsPagesDirectly = true;

  /// out[r * kKeyBlock + j] = dot(q[r], keys[j]) for rows <= kRowsAtOnce:
  /// each key vector loaded (and converted) once serves every row.
  template <class E>
  PAGEDKV_TARGET_AVX512 static void scores(const float* const* q,  // rows x [D]
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
  PAGEDKV_TARGET_AVX512 static float max(const float* scores,  // [n]
                                         int64_t n) noexcept {
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(scores + j));
    if (j < n) m = _mm512_mask_max_ps(m, first_lanes(n - j), m, _mm512_maskz_loadu_ps(first_lanes(n - j), scores + j));
    return _mm512_reduce_max_ps(m);
  }

  /// scores[j] = exp(scores[j] - max); returns their sum.
  PAGEDKV_TARGET_AVX512 static float exp_sum(float* scores,  // [n]
                                             int64_t n, float max) noexcept {
    const __m512 m = _mm512_set1_ps(max);
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp_non_positive(_mm512_sub_ps(_mm512_loadu_ps(scores + j), m));
      _mm512_storeu_ps(scores + j, e);
      acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
      const __mmask16 lanes = first_lanes(n - j);
      const __m512 e = exp_non_positive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + j), m));
      _mm512_mask_storeu_ps(scores + j, lanes, e);
      acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(lanes, e));
    }
    return horizontal_sum(acc);
  }

  /// acc[r] += sum_j p[r * kKeyBlock + j] * v[j] for rows <= kRowsAtOnce:
  /// each value vector loaded (and converted) once serves every row.
  template <class E>
  PAGEDKV_TARGET_AVX512 static void accumulate(float* const* acc,  // rows x [D]
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

  PAGEDKV_TARGET_AVX512 static void scale(float* row,  // [n]
                                          float factor, int64_t n) noexcept {
    const __m512 f = _mm512_set1_ps(factor);
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) _mm512_storeu_ps(row + d, _mm512_mul_ps(f, _mm512_loadu_ps(row + d)));
    if (d < n) {
      const __mmask16 lanes = first_lanes(n - d);
      _mm512_mask_storeu_ps(row + d, lanes, _mm512_mul_ps(f, _mm512_maskz_loadu_ps(lanes, row + d)));
    }
  }

 private:
  /// The first `count` (1..16) lanes.
  static __mmask16 first_lanes(int64_t count) noexcept {
    return static_cast<__mmask16>((1u << static_cast<unsigned>(count)) - 1u);
  }

 public:
  // 16 elements as float32 (also the codecs' loads, cpu/quant/isa_avx512.hpp).
  PAGEDKV_TARGET_AVX512 static __m512 load16(const float* p) noexcept { return _mm512_loadu_ps(p); }
  PAGEDKV_TARGET_AVX512 static __m512 load16(const c10::Half* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  PAGEDKV_TARGET_AVX512 static __m512 load16(const c10::BFloat16* p) noexcept {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  /// 16 fp8 codes as e4m3(c) / 2^8 (convert.hpp, kE4m3ViaHalfFactor): the
  /// sign-extended byte shifted left by 7 is the fp16 once bit 14 (a copy
  /// of the sign) is cleared.
  PAGEDKV_TARGET_AVX512 static __m512 load16(const E4m3Code* p) noexcept {
    const __m256i widened = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i half_bits = _mm256_and_si256(_mm256_slli_epi16(widened, 7), _mm256_set1_epi16(-0x4001));
    return _mm512_cvtph_ps(half_bits);
  }
  PAGEDKV_TARGET_AVX512 static __m512 load16(const int8_t* p) noexcept {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }

  /// [sum(s0), sum(s1), sum(s2), sum(s3)]: each folded to 256 bits, then
  /// Avx2::sum4.
  PAGEDKV_TARGET_AVX512 static __m128 sum4(__m512 s0, __m512 s1, __m512 s2, __m512 s3) noexcept {
    return Avx2::sum4(fold(s0), fold(s1), fold(s2), fold(s3));
  }

 private:
  /// `count` (< 16) elements as float32, zeros after (the tail of an odd head_dim).
  template <class E>
  PAGEDKV_TARGET_AVX512 static __m512 load_first(const E* p, int64_t count) noexcept {
    alignas(64) float buffer[16] = {};
    for (int64_t i = 0; i < count; ++i) buffer[i] = to_float32(p[i]);
    return _mm512_load_ps(buffer);
  }

  PAGEDKV_TARGET_AVX512 static __m256 fold(__m512 x) noexcept {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }

  PAGEDKV_TARGET_AVX512 static float horizontal_sum(__m512 x) noexcept {
    const __m256 y = fold(x);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }


  /// The sums of 16 registers x[i] (i = 4k + r: key k, row r) in one,
  /// lane 4r + k: a transpose-and-add tree, 30 shuffles and 15 adds where
  /// four sum4 take 44 and 32.
  PAGEDKV_TARGET_AVX512 static __m512 sum16(const __m512 (&x)[16]) noexcept {
    __m512 halves[8];  // halves[m]: lanes 0-7 partial sums of x[2m], lanes 8-15 of x[2m + 1]
    for (int m = 0; m < 8; ++m) {
      halves[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0x44),
                                _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0xEE));
    }
    __m512 quarters[4];  // quarters[n]: block j holds 4 partial sums of x[4n + j]
    for (int n = 0; n < 4; ++n) {
      quarters[n] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * n], halves[2 * n + 1], 0x88),
                                  _mm512_shuffle_f32x4(halves[2 * n], halves[2 * n + 1], 0xDD));
    }
    __m512 pairs[2];  // pairs[p]: block j holds 2 partial sums of x[8p + j], then 2 of x[8p + 4 + j]
    for (int p = 0; p < 2; ++p) {
      const __m512d a = _mm512_castps_pd(quarters[2 * p]), b = _mm512_castps_pd(quarters[2 * p + 1]);
      pairs[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // block j: the sums of x[j], x[4 + j], x[8 + j], x[12 + j]
    return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  }

  /// exp(x) for x <= 0: Avx2::exp_non_positive's polynomial, 16 lanes.
  PAGEDKV_TARGET_AVX512 static __m512 exp_non_positive(__m512 x) noexcept {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
  }

  /// Scores of R rows against K keys starting at keys[0]: R x K independent
  /// FMA chains over head_dim, then out[r * kKeyBlock + k]. kTail: head_dim
  /// is not a multiple of 16. Without it the accumulators stay in registers
  /// up to the sums; the tail's loads made g++ keep them on the stack.
  template <int R, int K, class E, bool kTail>
  PAGEDKV_TARGET_AVX512 static void score_keys(const float* const* q,  // R x [D]
                                               const void* const* keys, // K x [D]
                                               int64_t head_dim, float* out) noexcept {
    __m512 acc[K][4];
    for (int k = 0; k < K; ++k)
      for (int r = 0; r < 4; ++r) acc[k][r] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= head_dim; d += 16) {
      for (int k = 0; k < K; ++k) {
        const __m512 key = load16(row_as<E>(keys[k]) + d);
        for (int r = 0; r < R; ++r) acc[k][r] = _mm512_fmadd_ps(key, _mm512_loadu_ps(q[r] + d), acc[k][r]);
      }
    }
    if (kTail && d < head_dim) {
      const __mmask16 lanes = first_lanes(head_dim - d);
      for (int k = 0; k < K; ++k) {
        const __m512 key = load_first(row_as<E>(keys[k]) + d, head_dim - d);
        for (int r = 0; r < R; ++r)
          acc[k][r] = _mm512_fmadd_ps(key, _mm512_maskz_loadu_ps(lanes, q[r] + d), acc[k][r]);
      }
    }
    alignas(16) float sums[4];
    if constexpr (R == 4 && K == 4) {  // 16 scores at once; block r of sum16's result is row r
      const __m512 all = sum16({acc[0][0], acc[0][1], acc[0][2], acc[0][3],  //
                                acc[1][0], acc[1][1], acc[1][2], acc[1][3],  //
                                acc[2][0], acc[2][1], acc[2][2], acc[2][3],  //
                                acc[3][0], acc[3][1], acc[3][2], acc[3][3]});
      _mm_storeu_ps(out, _mm512_castps512_ps128(all));
      _mm_storeu_ps(out + kKeyBlock, _mm512_extractf32x4_ps(all, 1));
      _mm_storeu_ps(out + 2 * kKeyBlock, _mm512_extractf32x4_ps(all, 2));
      _mm_storeu_ps(out + 3 * kKeyBlock, _mm512_extractf32x4_ps(all, 3));
    } else if constexpr (R == 1 && K == 4) {  // four keys of one row at once
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
  PAGEDKV_TARGET_AVX512 static void scores_rows(const float* const* q,  // R x [D]
                                                const void* const* keys, // n x [D]
                                                int64_t n, int64_t head_dim,
                                                float* out) noexcept {  // [R, kKeyBlock]
    if (head_dim % 16 == 0) return scores_rows_of<R, E, false>(q, keys, n, head_dim, out);
    return scores_rows_of<R, E, true>(q, keys, n, head_dim, out);
  }

  template <int R, class E, bool kTail>
  PAGEDKV_TARGET_AVX512 static void scores_rows_of(const float* const* q,  // R x [D]
                                                   const void* const* keys, // n x [D]
                                                   int64_t n, int64_t head_dim,
                                                   float* out) noexcept {  // [R, kKeyBlock]
    constexpr int kKeys = R == 1 || R == 4 ? 4 : 2;  // keys per pass: enough independent chains
    int64_t j = 0;
    for (; j + kKeys <= n; j += kKeys) score_keys<R, kKeys, E, kTail>(q, keys + j, head_dim, out + j);
    for (; j < n; ++j) score_keys<R, 1, E, kTail>(q, keys + j, head_dim, out + j);
  }

  template <int R, class E>
  PAGEDKV_TARGET_AVX512 static void accumulate_rows(float* const* acc,  // R x [D]
                                                    const void* const* v,// n x [D]
                                                    const float* p,     // [R, kKeyBlock]
                                                    int64_t n, int64_t head_dim) noexcept {
    int64_t d = 0;
    for (; d + 32 <= head_dim; d += 32) {  // two chains per row
      __m512 a[R], b[R];
      for (int r = 0; r < R; ++r) {
        a[r] = _mm512_loadu_ps(acc[r] + d);
        b[r] = _mm512_loadu_ps(acc[r] + d + 16);
      }
      for (int64_t j = 0; j < n; ++j) {
        const __m512 v0 = load16(row_as<E>(v[j]) + d);
        const __m512 v1 = load16(row_as<E>(v[j]) + d + 16);
        for (int r = 0; r < R; ++r) {
          const __m512 pj = _mm512_set1_ps(p[r * kKeyBlock + j]);
          a[r] = _mm512_fmadd_ps(pj, v0, a[r]);
          b[r] = _mm512_fmadd_ps(pj, v1, b[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(acc[r] + d, a[r]);
        _mm512_storeu_ps(acc[r] + d + 16, b[r]);
      }
    }
    for (; d < head_dim; d += 16) {  // 16 lanes, or fewer at the end
      const int64_t count = head_dim - d < 16 ? head_dim - d : 16;
      const __mmask16 lanes = first_lanes(count);
      __m512 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_maskz_loadu_ps(lanes, acc[r] + d);
      for (int64_t j = 0; j < n; ++j) {
        // A false positive: cppcheck takes count < 16 for granted, but 16 <= head_dim - d < 32 after the loop above.
        // cppcheck-suppress knownConditionTrueFalse
        const __m512 v0 = count == 16 ? load16(row_as<E>(v[j]) + d) : load_first(row_as<E>(v[j]) + d, count);
        for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kKeyBlock + j]), v0, a[r]);
      }
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(acc[r] + d, lanes, a[r]);
    }
  }
};

}  // namespace simd
}  // namespace pagedkv

#ifdef PAGEDKV_AVX512_DIAGNOSTICS_PUSHED
#pragma GCC diagnostic pop
#undef PAGEDKV_AVX512_DIAGNOSTICS_PUSHED
#endif

#endif  // PAGEDKV_ATTENTION_AVX2
