// The decode step (cpu/attention/decode.hpp) in 512-bit vectors, for
// cores where a 512-bit FMA does twice the work of a 256-bit one: two
// 512-bit FMA pipes (cpu_has_wide_fmas: most Xeons since Skylake-SP).
// Avx2Decode's step with its score pass 16 elements of D per FMA and its
// value pass 32 columns per row and key: half the FMAs and half the loads
// of the 256-bit step; the softmax, the pass order and the read-ahead are
// Avx2Decode's. On Zen 4, which splits a 512-bit FMA in two, this step
// was slower than the 256-bit one (bench/NOTES.md, "The decode step in 512
// bits"), so cores there keep the 256-bit step.
// Not measured on a core with two 512-bit pipes: no such machine was lent
// since it was written.
#pragma once

#include "pagedkv/cpu/attention/decode_avx2.hpp"
#include "pagedkv/simd/isa_avx512.hpp"

#if defined(PAGEDKV_ATTENTION_AVX2) && defined(PAGEDKV_ATTENTION_AVX512)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

// g++ 12's false "(may be) used uninitialized" inside avx512fintrin.h
// (GCC bug 105593), as in simd/isa_avx512.hpp; the unity build of
// docs/examples reports it as "is used uninitialized".
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define PAGEDKV_DECODE_AVX512_DIAGNOSTICS_PUSHED 1
#endif

namespace pagedkv {
namespace cpu {
namespace attention {

struct Avx512Decode : Avx2Decode {
  /// The step's instruction set, as isa_name() spells it (hides Avx2Decode's,
  /// as run and accumulate do: decode.hpp names the step it takes).
  // cppcheck-suppress duplInheritedMember
  static constexpr const char* kIsaName = "avx512";

  /// Values are loaded in order: no accumulators to restore.
  template <class E>
  static constexpr bool kPermutesAccumulators = false;

  /// Scores, softmax update and values of one step (R in 1..4).
  template <int R, class E>
  PAGEDKV_TARGET_AVX512 __attribute__((noinline)) static void run(const Operands<E>& st) noexcept {
    if constexpr (std::is_same<E, simd::E4m3Code>::value) {
      if (st.head_dim <= kMaxWidenedDim) return run_widened<Avx512Decode, R>(st);
    }
    alignas(32) float scores[kDecodeKeys * kRows];  // [key, row]
    score<Avx512Decode, R>(st, scores);
    softmax<R>(st, scores);
    accumulate<R>(st, scores);
  }

  /// Avx2Decode::run_widened_head with this step's passes.
  PAGEDKV_TARGET_AVX512 __attribute__((noinline)) static void run_widened_head(const Operands<simd::E4m3Code>& st,
                                                                                int64_t rows) noexcept {
    widened_head<Avx512Decode>(st, rows);
  }

 private:
  friend struct Avx2Decode;  // its pass order and fp8 steps call score_keys and accumulate

  /// 16 elements as float32: Avx512::load16, and widened fp8 codes as fp16.
  template <class E>
  PAGEDKV_TARGET_AVX512 static __m512 load16(const E* p) noexcept {
    return simd::Avx512::load16(p);
  }
  PAGEDKV_TARGET_AVX512 static __m512 load16(const E4m3AsHalf* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  /// v, kept in a register (Avx2::in_register's reason; "v": any of the 32).
  PAGEDKV_TARGET_AVX512 static __m512 in_register(__m512 v) noexcept {
    __asm__("" : "+v"(v));
    return v;
  }

  /// Keys j .. j + K - 1 (K = 2 or 3; a pair past the last key scores key
  /// j twice): K x R FMA chains over D, 16 elements per FMA; out[k * 4 + r]
  /// = score of key j + k against row r (Avx2Decode::score_keys).
  template <int R, int K, class E>
  PAGEDKV_TARGET_AVX512 static void score_keys(const Operands<E>& st, int64_t j, float* out) noexcept {
    static_assert(K == 2 || K == 3, "a score pass takes two or three keys");
    const int64_t D = st.head_dim;
    const float* const q = st.q;
    const E* key[K];
    pass_keys(st, j, key);
    __m512 acc[K][kRows];
    for (int k = 0; k < K; ++k)
      for (int r = 0; r < kRows; ++r) acc[k][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 x[K];
      for (int k = 0; k < K; ++k) x[k] = load16(key[k] + d);
      for (int r = 0; r < R; ++r) {
        const __m512 q_d = in_register(_mm512_loadu_ps(q + r * D + d));
        for (int k = 0; k < K; ++k) acc[k][r] = _mm512_fmadd_ps(x[k], q_d, acc[k][r]);
      }
    }
    for (int k = 0; k < K; ++k) store_scores(st, j, k, simd::Avx512::sum4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]), out);
  }

  /// acc[r] += sum_j weights[j * 4 + r] * value j: 32 of D at a time (two
  /// chains per row), then the last 16 where D is an odd multiple of 16.
  template <int R, class E>
  PAGEDKV_TARGET_AVX512 static void accumulate(const Operands<E>& st, const float* weights) noexcept {
    const int64_t D = st.head_dim;
    const int64_t n = st.n;
    const int64_t stride = st.stride;
    float* const acc = st.acc;
    LinesAhead ahead = st.ahead_values;
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
      ahead.next(2 * kAheadLinesPerColumns);
      __m512 a[R], b[R];
      for (int r = 0; r < R; ++r) {
        a[r] = _mm512_loadu_ps(acc + r * D + d);
        b[r] = _mm512_loadu_ps(acc + r * D + d + 16);
      }
      const E* v = st.values + d;
      for (int64_t j = 0; j < n; ++j, v += stride) {
        const __m512 v0 = load16(v);
        const __m512 v1 = load16(v + 16);
        for (int r = 0; r < R; ++r) {
          const __m512 w = _mm512_set1_ps(weights[j * kRows + r]);
          a[r] = _mm512_fmadd_ps(w, v0, a[r]);
          b[r] = _mm512_fmadd_ps(w, v1, b[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(acc + r * D + d, a[r]);
        _mm512_storeu_ps(acc + r * D + d + 16, b[r]);
      }
    }
    if (d < D) {
      ahead.next(kAheadLinesPerColumns);
      __m512 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(acc + r * D + d);
      const E* v = st.values + d;
      for (int64_t j = 0; j < n; ++j, v += stride) {
        const __m512 v0 = load16(v);
        for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(weights[j * kRows + r]), v0, a[r]);
      }
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * D + d, a[r]);
    }
    ahead.rest();
  }
};

}  // namespace attention
}  // namespace cpu
}  // namespace pagedkv

#ifdef PAGEDKV_DECODE_AVX512_DIAGNOSTICS_PUSHED
#pragma GCC diagnostic pop
#undef PAGEDKV_DECODE_AVX512_DIAGNOSTICS_PUSHED
#endif

#endif  // PAGEDKV_ATTENTION_AVX2 && PAGEDKV_ATTENTION_AVX512
