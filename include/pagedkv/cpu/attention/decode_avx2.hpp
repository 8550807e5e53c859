// One step of the decode path (cpu/attention/decode.hpp) with AVX2, FMA and
// F16C: up to kDecodeKeys keys of one kv head against the R <= 4 query rows
// of its GQA group, then their softmax and their values, with the keys and
// values read straight from a page, `stride` elements apart. Scores are kept
// key-major, [key, 4 rows], so that the softmax of all R rows runs in the
// same vectors, two keys per 8 lanes; the general kernel (kernel.hpp) keeps
// them row-major and ran max, exp and sum once per row.
// bench/NOTES.md, "A decode path for AVX2", has what this gained.
#pragma once

#include "pagedkv/simd/isa_avx2.hpp"

#ifdef PAGEDKV_ATTENTION_AVX2

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "pagedkv/cpu/attention/prefetch.hpp"

namespace pagedkv {
namespace attention_kernels {

/// Keys one decode step scores at most: the softmax state of every row
/// is updated once per step.
constexpr int64_t kDecodeKeys = 16;

struct Avx2Decode {
  /// Rows of a step's score buffer: the query rows of one GQA group that
  /// share each key load.
  static constexpr int kRows = 4;

  /// The softmax state of R query rows and the vectors a step reads.
  template <class E>
  struct Operands {
    const float* q;         // [R, D]: the rows' query vectors, pre-scaled
    const E* keys;          // n x [D], `stride` elements apart
    const E* values;        // n x [D], `stride` elements apart
    int64_t stride;         // elements between consecutive tokens' vectors
    int64_t n;              // keys, 1 <= n <= kDecodeKeys
    int64_t head_dim;       // D, a multiple of 16
    float* max;             // [R]: running maximum score
    float* sum;             // [R]: running sum of exp(score - max)
    float* acc;             // [R, D]: running sum of exp(score - max) * value
    LinesAhead ahead_keys;    // read ahead while scoring (the next page's)
    LinesAhead ahead_values;  // read ahead while adding the values
  };

  /// Lines read ahead per pair of keys scored and per 16 columns of values
  /// added (the rest after the last): a page of 16 fp16 tokens x 128 is 64
  /// lines per side and head, 8 pairs and 8 column chunks.
  static constexpr int64_t kAheadLinesPerPiece = 8;

  /// Scores, softmax update and values of one step (R in 1..4).
  /// Not inlined: a call per step costs nothing measurable, and compiled
  /// into the kernel's flattened item loop the step ran 2-3 % slower
  /// (B2xT2048 NHD from L3: 1.21-1.22 ms against 1.18-1.20 ms).
  template <int R, class E>
  PAGEDKV_TARGET_AVX2 __attribute__((noinline)) static void run(const Operands<E>& st) noexcept {
    alignas(32) float scores[kDecodeKeys * kRows];  // [key, row]
    score<R>(st, scores);
    softmax<R>(st, scores);
    accumulate<R>(st, scores);
  }

 private:
  /// scores[j * 4 + r] = q[r] . key j for j < n, two keys at a time: 2 x R
  /// FMA chains over D, then one vector of both keys' sums (an odd n scores
  /// its last key twice). kAheadLinesPerPiece lines of the next page are
  /// asked for per pair, so that its keys arrive spread over this step.
  template <int R, class E>
  PAGEDKV_TARGET_AVX2 static void score(const Operands<E>& st, float* scores) noexcept {
    const int64_t D = st.head_dim;
    const int64_t n = st.n;
    const int64_t stride = st.stride;
    const float* const q = st.q;
    LinesAhead ahead = st.ahead_keys;
    for (int64_t j = 0; j < n; j += 2) {
      ahead.next(kAheadLinesPerPiece);
      const E* k0 = st.keys + j * stride;
      const E* k1 = j + 1 < n ? k0 + stride : k0;
      __m256 a[kRows], b[kRows];
      for (int r = 0; r < kRows; ++r) a[r] = b[r] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        __m256 q_d[R];
        for (int r = 0; r < R; ++r) q_d[r] = Avx2::in_register(_mm256_loadu_ps(q + r * D + d));
        const __m256 x0 = Avx2::load8(k0 + d);
        const __m256 x1 = Avx2::load8(k1 + d);
        for (int r = 0; r < R; ++r) {
          a[r] = _mm256_fmadd_ps(x0, q_d[r], a[r]);
          b[r] = _mm256_fmadd_ps(x1, q_d[r], b[r]);
        }
      }
      // Lanes [r] of each 128-bit half: row r's partial sums of key 0 (x),
      // key 1 (y); the halves' sum is the score.
      const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
      _mm256_store_ps(scores + j * kRows,
                      _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31)));
    }
    ahead.rest();
  }

  /// The online softmax over the step's keys, every row at once: new
  /// maxima, the correction of each row's sum and acc, and the weights
  /// exp(score - max) in place of the scores.
  template <int R, class E>
  PAGEDKV_TARGET_AVX2 static void softmax(const Operands<E>& st, float* scores) noexcept {
    const int64_t n = st.n;
    const int64_t pairs = (n + 1) / 2;
    const bool odd = (n & 1) != 0;
    // An odd n's last vector holds its last key twice (score): harmless to
    // the maximum, and its copy's weight is zeroed below.
    __m256 m = _mm256_load_ps(scores);
    for (int64_t p = 1; p < pairs; ++p) m = _mm256_max_ps(m, _mm256_load_ps(scores + p * 8));
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));  // row r's maximum in lanes r and r + 4

    alignas(16) float state[2][kRows] = {};  // old maxima, old sums (rows >= R: unused)
    for (int r = 0; r < R; ++r) {
      state[0][r] = st.max[r];
      state[1][r] = st.sum[r];
    }
    const __m128 old_max = _mm_load_ps(state[0]);
    const __m128 new_max = _mm_max_ps(old_max, _mm256_castps256_ps128(m));
    // exp(old - new): 1 where the maximum stayed, 0-ish (1e-38) on the first
    // step, where old is -inf and sum and acc are 0.
    const __m128 correction =
        _mm256_castps256_ps128(Avx2::exp_non_positive(_mm256_set_m128(_mm_setzero_ps(), _mm_sub_ps(old_max, new_max))));
    const __m256 shift = _mm256_set_m128(new_max, new_max);
    __m256 total = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m256 e = Avx2::exp_non_positive(_mm256_sub_ps(_mm256_load_ps(scores + p * 8), shift));
      if (odd && p == pairs - 1) e = _mm256_blend_ps(e, _mm256_setzero_ps(), 0xF0);  // the copy
      _mm256_store_ps(scores + p * 8, e);
      total = _mm256_add_ps(total, e);
    }
    const __m128 step_sum = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    alignas(16) float factor[kRows];
    _mm_store_ps(factor, correction);
    _mm_store_ps(state[0], new_max);
    _mm_store_ps(state[1], _mm_fmadd_ps(_mm_load_ps(state[1]), correction, step_sum));
    for (int r = 0; r < R; ++r) {
      st.max[r] = state[0][r];
      st.sum[r] = state[1][r];
      if (factor[r] != 1.0f) Avx2::scale(st.acc + r * st.head_dim, factor[r], st.head_dim);
    }
  }

  /// acc[r] += sum_j weights[j * 4 + r] * value j, 16 of D at a time (two
  /// chains per row).
  template <int R, class E>
  PAGEDKV_TARGET_AVX2 static void accumulate(const Operands<E>& st, const float* weights) noexcept {
    const int64_t D = st.head_dim;
    const int64_t n = st.n;
    const int64_t stride = st.stride;
    float* const acc = st.acc;
    LinesAhead ahead = st.ahead_values;
    for (int64_t d = 0; d < D; d += 16) {
      ahead.next(kAheadLinesPerPiece);
      __m256 a[R], b[R];
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_loadu_ps(acc + r * D + d);
        b[r] = _mm256_loadu_ps(acc + r * D + d + 8);
      }
      const E* v = st.values + d;
      for (int64_t j = 0; j < n; ++j, v += stride) {
        const __m256 v0 = Avx2::load8(v);
        const __m256 v1 = Avx2::load8(v + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 w = _mm256_broadcast_ss(weights + j * kRows + r);
          a[r] = _mm256_fmadd_ps(w, v0, a[r]);
          b[r] = _mm256_fmadd_ps(w, v1, b[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(acc + r * D + d, a[r]);
        _mm256_storeu_ps(acc + r * D + d + 8, b[r]);
      }
    }
    ahead.rest();
  }

};

}  // namespace attention_kernels
}  // namespace pagedkv

#endif  // PAGEDKV_ATTENTION_AVX2
