// The decode step (cpu/attention/decode.hpp) for bf16 pages and bf16
// queries on CPUs with AVX-512 BF16 (cpu_has_avx512_bf16: Zen 4, Sapphire
// Rapids): Avx2Decode's step with its scores taken by `vdpbf16ps`, which
// multiplies 16 bf16 pairs and adds them into 8 float32 lanes, straight
// from the key's and the query's bf16 bits: half the instructions of the
// FMA score pass and no widening. A bf16 x bf16 product is exact in
// float32, so these are the same products as the FMAs', summed in another
// order; the query is taken as given and the scale applied to each score
// (the FMA pass multiplies pre-scaled queries: one rounding of q * scale per
// element). Like every AVX-512 BF16 instruction, `vdpbf16ps` treats
// subnormal inputs as zero, which no model's K/V or queries are near.
// The softmax and the values are Avx2Decode's. bench/NOTES.md, "bf16 scores
// by dot products", has what it gained.
#pragma once

#include "pagedkv/cpu/attention/decode_avx2.hpp"
#include "pagedkv/simd/isa_avx512.hpp"

#if defined(PAGEDKV_ATTENTION_AVX2) && defined(PAGEDKV_ATTENTION_AVX512)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace pagedkv {
namespace cpu {
namespace attention {

struct Avx512Bf16Decode : Avx2Decode {
  /// Scores (by dot products), softmax update and values of one step (R in
  /// 1..4); bf16 pages and bf16 queries only.
  template <int R>
  PAGEDKV_TARGET_AVX512_BF16 __attribute__((noinline)) static void run(
      const Operands<c10::BFloat16>& st) noexcept {
    alignas(32) float scores[kDecodeKeys * kRows];  // [key, row]
    score<Avx512Bf16Decode, R>(st, scores);
    softmax<R>(st, scores);
    accumulate<R>(st, scores);
  }

 private:
  friend struct Avx2Decode;  // its score pass order calls score_keys

  /// Keys j .. j + K - 1 (K = 2 or 3; a pair past the last key scores key
  /// j twice): K x R chains over D, 16 elements per `vdpbf16ps`; out[k * 4
  /// + r] = scale * (q_given[r] . key j + k).
  template <int R, int K>
  PAGEDKV_TARGET_AVX512_BF16 static void score_keys(const Operands<c10::BFloat16>& st, int64_t j,
                                                    float* out) noexcept {
    static_assert(K == 2 || K == 3, "a score pass takes two or three keys");
    const int64_t D = st.head_dim;
    const c10::BFloat16* const q = st.q_given;  // [R, D]
    const c10::BFloat16* key[K];
    pass_keys(st, j, key);
    __m256 acc[K][kRows];
    for (int k = 0; k < K; ++k)
      for (int r = 0; r < kRows; ++r) acc[k][r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m256i x[K];
      for (int k = 0; k < K; ++k) x[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key[k] + d));
      for (int r = 0; r < R; ++r) {
        const __m256i q_d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * D + d));
        for (int k = 0; k < K; ++k) acc[k][r] = _mm256_dpbf16_ps(acc[k][r], (__m256bh)x[k], (__m256bh)q_d);
      }
    }
    const __m128 scale = _mm_set1_ps(st.scale);
    for (int k = 0; k < K; ++k) _mm_store_ps(out + k * kRows, _mm_mul_ps(sum_rows(acc[k]), scale));
  }
};

}  // namespace attention
}  // namespace cpu
}  // namespace pagedkv

#endif  // PAGEDKV_ATTENTION_AVX2 && PAGEDKV_ATTENTION_AVX512
