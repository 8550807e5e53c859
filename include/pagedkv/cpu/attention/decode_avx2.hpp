// One step of the decode path (cpu/attention/decode.hpp) with AVX2, FMA and
// F16C: up to kDecodeKeys keys of one kv head against the R <= 4 query rows
// of its GQA group, then their softmax and their values, with the keys and
// values read straight from a page, `stride` elements apart. Scores are kept
// key-major, [key, 4 rows], so that the softmax of all R rows runs in the
// same vectors, two keys per 8 lanes; the general kernel (kernel.hpp) keeps
// them row-major and ran max, exp and sum once per row.
// bench/NOTES.md, "A decode path for AVX2" and "Three keys per score
// pass", has what this gained.
#pragma once

#include "pagedkv/simd/isa_avx2.hpp"

#ifdef PAGEDKV_ATTENTION_AVX2

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "pagedkv/cpu/attention/prefetch.hpp"

namespace pagedkv {
namespace cpu {
namespace attention {

/// Keys one decode step scores at most: the softmax state of every row
/// is updated once per step.
constexpr int64_t kDecodeKeys = 16;

/// fp8 e4m3 codes widened to the fp16 bits they decode through (Avx2::
/// load8's decode: e4m3(c) / 2^8), as a step on fp8 pages first stores its
/// keys and its values (Avx2Decode::widen_e4m3).
struct E4m3AsHalf {
  // Read through pointers to the struct (decode_load8's 16-byte loads),
  // never by name.
  // cppcheck-suppress unusedStructMember
  uint16_t bits;
};

/// Whether E is a quantized page's code (fp8 e4m3, int8, or fp8 widened):
/// each vector of codes then has a float32 scale, and decodes to
/// code_unit(format) x scale x code (kernel.hpp).
template <class E>
constexpr bool kIsCode =
    std::is_same<E, simd::E4m3Code>::value || std::is_same<E, E4m3AsHalf>::value || std::is_same<E, int8_t>::value;

/// What a code's scale is multiplied by (kernel.hpp's code_unit, per type):
/// fp8 codes load as e4m3(c) / 2^8.
template <class E>
constexpr float kCodeUnit =
    std::is_same<E, simd::E4m3Code>::value || std::is_same<E, E4m3AsHalf>::value ? simd::kE4m3ViaHalfFactor : 1.0f;

/// 8 elements as float32: Avx2::load8, and widened fp8 codes as fp16.
template <class E>
PAGEDKV_TARGET_AVX2 inline __m256 decode_load8(const E* p) noexcept {
  return simd::Avx2::load8(p);
}
PAGEDKV_TARGET_AVX2 inline __m256 decode_load8(const E4m3AsHalf* p) noexcept {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

/// How a decode step loads elements [d, d + 16) of a value vector: as two
/// 8-lane halves, in order (fp32, fp16, codes: half H holds d + 8H .. d + 8H + 7).
template <class E>
struct ValueLanes {
  /// Whether the halves hold the 16 elements out of order, so that the
  /// accumulators are kept in that order too (restore).
  static constexpr bool kPermuted = false;

  template <int H>
  PAGEDKV_TARGET_AVX2 static __m256 half(const E* p) noexcept {
    return decode_load8(p + 8 * H);
  }
};

/// bf16: one 32-byte load, each half's elements moved into the high 16
/// bits of its lanes by an unpack with zero: one instruction per 8 floats
/// against two for the in-order widening (vpmovzxwd, vpslld), which made
/// the values of a bf16 step slower than fp16 ones (bench/NOTES.md, "Three
/// keys per score pass"). Unpacks stay within
/// 128-bit halves, so half 0 holds elements 0-3 and 8-11 of the 16, half 1
/// elements 4-7 and 12-15. (Scores keep the in-order load: a zero vector's
/// register is one more than a three-key pass has.)
template <>
struct ValueLanes<c10::BFloat16> {
  static constexpr bool kPermuted = true;

  template <int H>
  PAGEDKV_TARGET_AVX2 static __m256 half(const c10::BFloat16* p) noexcept {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    return _mm256_castsi256_ps(H == 0 ? _mm256_unpacklo_epi16(zero, bits) : _mm256_unpackhi_epi16(zero, bits));
  }

  /// The accumulators `acc` (n floats, a multiple of 16) from half()'s
  /// order back in order: elements 4-7 and 8-11 of every 16 swapped.
  PAGEDKV_TARGET_AVX2 static void restore(float* acc, int64_t n) noexcept {
    for (int64_t i = 0; i < n; i += 16) {
      const __m256 a = _mm256_loadu_ps(acc + i);
      const __m256 b = _mm256_loadu_ps(acc + i + 8);
      _mm256_storeu_ps(acc + i, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(acc + i + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
  }
};

struct Avx2Decode {
  /// The step's instruction set, as isa_name() spells it.
  static constexpr const char* kIsaName = "avx2";

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
    float* acc;             // [R, D]: running sum of exp(score - max) * value, in E's lane order
    LinesAhead ahead_keys;    // read ahead while scoring (the next page's)
    LinesAhead ahead_values;  // read ahead while adding the values
    // Codes (kIsCode<E>): key j's scale is k_scales[j * scale_stride], value
    // j's v_scales[j * scale_stride]; unread on native pages.
    const float* k_scales;
    const float* v_scales;
    int64_t scale_stride;
    // Read by the bf16 dot-product step (decode_avx512_bf16.hpp), which
    // cppcheck, checking this header alone, does not see.
    // cppcheck-suppress unusedStructMember
    const E* q_given;         // [R, D]: the rows' query vectors as given, not scaled (bf16 dot products)
    // cppcheck-suppress unusedStructMember
    float scale;              // q = q_given * scale
    float softcap;            // > 0: scores become softcap * tanh(score / softcap) before the softmax
  };

  /// Lines read ahead per key scored and per 16 columns of values added
  /// (the rest after the last): a page of 16 fp16 tokens x 128 is 64 lines
  /// per side and head, 16 keys and 8 column chunks.
  static constexpr int64_t kAheadLinesPerKey = 4;
  static constexpr int64_t kAheadLinesPerColumns = 8;

  /// Whether steps on E's pages keep the accumulators in ValueLanes<E>'s
  /// permuted order; the item loop then restores their order after its
  /// last step (restore_accumulators).
  template <class E>
  static constexpr bool kPermutesAccumulators = ValueLanes<E>::kPermuted;

  /// The item's accumulators (n floats) from E's lane order back in order.
  template <class E>
  PAGEDKV_TARGET_AVX2 static void restore_accumulators(float* acc, int64_t n) noexcept {
    ValueLanes<E>::restore(acc, n);
  }

  /// Scores, softmax update and values of one step (R in 1..4).
  /// Not inlined: a call per step costs nothing measurable, and compiled
  /// into the kernel's flattened item loop the step ran slower
  /// (bench/NOTES.md, "Tried and not kept (decode attention)").
  template <int R, class E>
  PAGEDKV_TARGET_AVX2 __attribute__((noinline)) static void run(const Operands<E>& st) noexcept {
    if constexpr (std::is_same<E, simd::E4m3Code>::value) {
      if (st.head_dim <= kMaxWidenedDim) return run_widened<Avx2Decode, R>(st);
    }
    alignas(32) float scores[kDecodeKeys * kRows];  // [key, row]
    score<Avx2Decode, R>(st, scores);
    softmax<R>(st, scores);
    accumulate<R>(st, scores);
  }

  /// The largest head_dim whose fp8 steps widen their codes first (two
  /// buffers of kDecodeKeys x D fp16 on the stack).
  static constexpr int64_t kMaxWidenedDim = 256;

  /// The steps of all `rows` query rows of one kv head on fp8 pages, more
  /// than kRows of them (a GQA group of 8): as run_widened, but the head's
  /// codes are widened once for all its rows, not once per kRows (with a
  /// group of 8, a step per 4 rows widened each code twice: bench/NOTES.md,
  /// "Fp8 codes widened once per kv head"). st's q, max, sum and acc point
  /// at the first row; the rows follow each other. head_dim <= kMaxWidenedDim.
  PAGEDKV_TARGET_AVX2 __attribute__((noinline)) static void run_widened_head(const Operands<simd::E4m3Code>& st,
                                                                              int64_t rows) noexcept {
    widened_head<Avx2Decode>(st, rows);
  }

 protected:
  /// run_widened_head with Step's passes (this step's, or Avx512Decode's).
  template <class Step>
  PAGEDKV_TARGET_AVX2 __attribute__((always_inline)) static inline void widened_head(const Operands<simd::E4m3Code>& st,
                                                                                     int64_t rows) noexcept {
    alignas(32) E4m3AsHalf keys[kDecodeKeys * kMaxWidenedDim];    // [n, D]
    alignas(32) E4m3AsHalf values[kDecodeKeys * kMaxWidenedDim];  // [n, D]
    widen_e4m3(st.keys, st.stride, st.n, st.head_dim, keys);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const bool first = r0 == 0;  // the first rows read ahead for all of them and widen the values
      const Operands<E4m3AsHalf> wide = widened(st, r0, keys, values, first);
      E4m3AsHalf* const widen_into = first ? values : nullptr;
      switch (std::min<int64_t>(kRows, rows - r0)) {
        case 4: widened_passes<Step, 4>(wide, st, widen_into); break;
        case 3: widened_passes<Step, 3>(wide, st, widen_into); break;
        case 2: widened_passes<Step, 2>(wide, st, widen_into); break;
        default: widened_passes<Step, 1>(wide, st, widen_into); break;
      }
    }
  }

  /// A step on fp8 pages: its keys, then its values, widened to fp16 bits
  /// 16 codes per instruction (widen_e4m3), then the fp16 passes over them
  /// with the codes' scales. Widening 8 codes where the passes load them
  /// took 4 operations (Avx2::load8), 2.5 this way, inside a step that is
  /// bound by its arithmetic (bench/NOTES.md, "Quantized pages take the
  /// decode step"). Step: whose passes (this step's, Avx512Decode's).
  template <class Step, int R>
  PAGEDKV_TARGET_AVX2 __attribute__((always_inline)) static inline void run_widened(
      const Operands<simd::E4m3Code>& st) noexcept {
    alignas(32) E4m3AsHalf keys[kDecodeKeys * kMaxWidenedDim];    // [n, D]
    alignas(32) E4m3AsHalf values[kDecodeKeys * kMaxWidenedDim];  // [n, D]
    widen_e4m3(st.keys, st.stride, st.n, st.head_dim, keys);
    widened_passes<Step, R>(widened(st, 0, keys, values, true), st, values);
  }

  /// The operands of st's rows r0.. over widened keys and values (a
  /// stride of D), with st's scales; `first`: with st's read-ahead.
  PAGEDKV_TARGET_AVX2 static Operands<E4m3AsHalf> widened(const Operands<simd::E4m3Code>& st, int64_t r0,
                                                          const E4m3AsHalf* keys, const E4m3AsHalf* values,
                                                          bool first) noexcept {
    const int64_t D = st.head_dim;
    return {st.q + r0 * D,
            keys,
            values,
            D,  // stride
            st.n,
            D,
            st.max + r0,
            st.sum + r0,
            st.acc + r0 * D,
            first ? st.ahead_keys : LinesAhead(),
            first ? st.ahead_values : LinesAhead(),
            st.k_scales,
            st.v_scales,
            st.scale_stride,
            nullptr,  // q_given: bf16 steps only
            st.scale,
            st.softcap};
  }

  /// Step's passes of R rows over widened keys; after the softmax, the
  /// values of `codes` are widened into `values` (wide.values) unless it is
  /// nullptr (widened by an earlier group of rows).
  template <class Step, int R>
  PAGEDKV_TARGET_AVX2 __attribute__((always_inline)) static inline void widened_passes(
      const Operands<E4m3AsHalf>& wide, const Operands<simd::E4m3Code>& codes,
      E4m3AsHalf* values) noexcept {  // [n, D] or nullptr
    alignas(32) float scores[kDecodeKeys * kRows];  // [key, row]
    score<Step, R>(wide, scores);
    softmax<R>(wide, scores);
    if (values != nullptr) widen_e4m3(codes.values, codes.stride, codes.n, codes.head_dim, values);
    Step::template accumulate<R>(wide, scores);
  }

  /// out[j * D + d] = the fp16 bits of in[j * stride + d] for j < n, d < D
  /// (a multiple of 16): Avx2::load8's decode over 16 lanes.
  PAGEDKV_TARGET_AVX2 static void widen_e4m3(const simd::E4m3Code* in, int64_t stride, int64_t n, int64_t D,
                                              E4m3AsHalf* out) noexcept {
    const __m256i keep = _mm256_set1_epi16(-0x4001);  // all but bit 14, the sign's second copy
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; d += 16) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j * stride + d));
        const __m256i bits = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7), keep);
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + j * D + d), bits);
      }
    }
  }

  /// scores[j * 4 + r] = q[r] . key j for j < n, by Step::score_keys
  /// (this step's FMAs, or Avx512Bf16Decode's dot products). Three keys at
  /// a time where it can: 3 x R FMA chains (12 at R = 4, with the three
  /// keys and one query vector: all 16 registers) keep both FMA pipes busy,
  /// while the 2 x R chains of a pair just cover the FMA latency and stall on
  /// any late operand (bench/NOTES.md, "Three keys per score pass"). The rest of
  /// n goes in pairs: none, one, or two (n = 3t + 4), and n = 1 scores its
  /// key twice. An odd n's slot n gets a copy of the last key's scores: the
  /// softmax reads the keys in pairs and zeroes that copy's weight. Lines
  /// of the next page are asked for as the keys are scored,
  /// kAheadLinesPerKey per key, so that its keys arrive spread over this
  /// step. Always inlined into the step's run: Step::score_keys carries
  /// its own instruction set, which only the run's matches, and a call per
  /// pass would cost the hottest loop of the step.
  template <class Step, int R, class E>
  PAGEDKV_TARGET_AVX2 __attribute__((always_inline)) static inline void score(const Operands<E>& st,
                                                                              float* scores) noexcept {
    const int64_t n = st.n;
    const int64_t pairs = n == 1 ? 1 : (2 * n) % 3;  // n % 3 == 0, 2, 1 -> 0, 1, 2 pairs
    const int64_t threes_end = std::max<int64_t>(0, n - 2 * pairs);
    LinesAhead ahead = st.ahead_keys;
    int64_t j = 0;
    for (; j < threes_end; j += 3) {
      ahead.next(3 * kAheadLinesPerKey);
      Step::template score_keys<R, 3>(st, j, scores + j * kRows);
    }
    for (; j < n; j += 2) {
      ahead.next(2 * kAheadLinesPerKey);
      Step::template score_keys<R, 2>(st, j, scores + j * kRows);
    }
    ahead.rest();
    if ((n & 1) != 0) _mm_store_ps(scores + n * kRows, _mm_load_ps(scores + (n - 1) * kRows));
  }

  /// Keys j .. j + K - 1 (K = 2 or 3): K x R FMA chains over D; out[k * 4
  /// + r] = score of key j + k against row r. A pair past the last key
  /// (j + 1 == n) scores key j twice. Three keys fold each query load into
  /// its three FMAs (all 16 registers in use); two keys load the R query
  /// vectors into registers first.
  template <int R, int K, class E>
  PAGEDKV_TARGET_AVX2 static void score_keys(const Operands<E>& st, int64_t j, float* out) noexcept {
    static_assert(K == 2 || K == 3, "a score pass takes two or three keys");
    const int64_t D = st.head_dim;
    const float* const q = st.q;
    const E* key[K];
    pass_keys(st, j, key);
    __m256 acc[K][kRows];
    for (int k = 0; k < K; ++k)
      for (int r = 0; r < kRows; ++r) acc[k][r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 x[K];
      for (int k = 0; k < K; ++k) x[k] = decode_load8(key[k] + d);
      for (int r = 0; r < R; ++r) {
        __m256 q_d = _mm256_loadu_ps(q + r * D + d);
        if constexpr (K == 2) q_d = simd::Avx2::in_register(q_d);
        for (int k = 0; k < K; ++k) acc[k][r] = _mm256_fmadd_ps(x[k], q_d, acc[k][r]);
      }
    }
    for (int k = 0; k < K; ++k) store_scores(st, j, k, sum_rows(acc[k]), out);
  }

  /// The K keys of a score pass from key j on, `stride` apart; a pair past
  /// the last key (j + 1 == n) reads key j twice. Every step's score_keys.
  template <int K, class E>
  PAGEDKV_TARGET_AVX2 __attribute__((always_inline)) static inline void pass_keys(const Operands<E>& st, int64_t j,
                                                                                  const E* (&key)[K]) noexcept {
    key[0] = st.keys + j * st.stride;
    for (int k = 1; k < K; ++k) key[k] = j + k < st.n ? key[k - 1] + st.stride : key[k - 1];
  }

  /// out[k * 4 + r] = the score of key j + k against row r, from `sums`,
  /// the four rows' dot products with its elements: on codes times the
  /// key's scale (q . key = scale x unit x (q . codes)), where a pair past
  /// the last key (a copy of key j) takes key j's scale, not one past the
  /// run's. Every FMA step's score_keys.
  template <class E>
  PAGEDKV_TARGET_AVX2 __attribute__((always_inline)) static inline void store_scores(const Operands<E>& st, int64_t j,
                                                                                     int k, __m128 sums,
                                                                                     float* out) noexcept {
    if constexpr (kIsCode<E>) {
      const int64_t jk = std::min(j + k, st.n - 1);
      sums = _mm_mul_ps(sums, _mm_set1_ps(st.k_scales[jk * st.scale_stride] * kCodeUnit<E>));
    }
    _mm_store_ps(out + k * kRows, sums);
  }

  /// [sum of v[0], ..., sum of v[3]]: the four rows' dot products of one key.
  PAGEDKV_TARGET_AVX2 static __m128 sum_rows(const __m256 (&v)[kRows]) noexcept {
    return simd::Avx2::sum4(v[0], v[1], v[2], v[3]);
  }

  /// The online softmax over the step's keys, every row at once: new
  /// maxima, the correction of each row's sum and acc, and the weights
  /// exp(score - max) in place of the scores (on codes, times each value's
  /// scale x unit: the weight its codes need).
  template <int R, class E>
  PAGEDKV_TARGET_AVX2 static void softmax(const Operands<E>& st, float* scores) noexcept {
    const int64_t n = st.n;
    const int64_t pairs = (n + 1) / 2;
    const bool odd = (n & 1) != 0;
    if (st.softcap > 0.0f) soft_cap(scores, pairs * 2 * kRows, st.softcap);
    // Scores are read as score() stored them, 4 floats (one key) at a time:
    // an 8-float load across two such stores is not forwarded from them and
    // waits for both to reach the cache.
    __m128 m = _mm_load_ps(scores);
    for (int64_t j = 1; j < n; ++j) m = _mm_max_ps(m, _mm_load_ps(scores + j * kRows));

    alignas(16) float state[2][kRows] = {};  // old maxima, old sums (rows >= R: unused)
    for (int r = 0; r < R; ++r) {
      state[0][r] = st.max[r];
      state[1][r] = st.sum[r];
    }
    const __m128 old_max = _mm_load_ps(state[0]);
    const __m128 new_max = _mm_max_ps(old_max, m);
    // exp(old - new): 1 where the maximum stayed, 0-ish (1e-38) on the first
    // step, where old is -inf and sum and acc are 0.
    const __m128 correction =
        _mm256_castps256_ps128(simd::Avx2::exp_non_positive(_mm256_set_m128(_mm_setzero_ps(), _mm_sub_ps(old_max, new_max))));
    const __m256 shift = _mm256_set_m128(new_max, new_max);
    __m256 total = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m256 two_keys =
          _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(scores + p * 8)), _mm_load_ps(scores + p * 8 + 4), 1);
      __m256 e = simd::Avx2::exp_non_positive(_mm256_sub_ps(two_keys, shift));
      if (odd && p == pairs - 1) e = _mm256_blend_ps(e, _mm256_setzero_ps(), 0xF0);  // an odd n's copy of its last key
      total = _mm256_add_ps(total, e);
      if constexpr (kIsCode<E>) {
        const float* v_scale = st.v_scales + 2 * p * st.scale_stride;
        const float second = 2 * p + 1 < n ? v_scale[st.scale_stride] : 0.0f;
        const __m256 weight_scales = _mm256_set_m128(_mm_set1_ps(second), _mm_set1_ps(v_scale[0]));
        e = _mm256_mul_ps(e, _mm256_mul_ps(weight_scales, _mm256_set1_ps(kCodeUnit<E>)));
      }
      _mm256_store_ps(scores + p * 8, e);
    }
    const __m128 step_sum = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    alignas(16) float factor[kRows];
    _mm_store_ps(factor, correction);
    _mm_store_ps(state[0], new_max);
    _mm_store_ps(state[1], _mm_fmadd_ps(_mm_load_ps(state[1]), correction, step_sum));
    for (int r = 0; r < R; ++r) {
      st.max[r] = state[0][r];
      st.sum[r] = state[1][r];
      if (factor[r] != 1.0f) simd::Avx2::scale(st.acc + r * st.head_dim, factor[r], st.head_dim);
    }
  }

  /// x[j] = cap * tanh(x[j] / cap) for j < n (a multiple of 8), with
  /// tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|) <= 1: Gemma 2's
  /// soft-cap at the cost of an exponent per score, which the step already
  /// pays once (bench/NOTES.md, "Soft-cap, sinks and windows in the decode
  /// step").
  PAGEDKV_TARGET_AVX2 static void soft_cap(float* x, int64_t n, float cap) noexcept {
    const __m256 inverse = _mm256_set1_ps(1.0f / cap);
    const __m256 capv = _mm256_set1_ps(cap);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t j = 0; j < n; j += 8) {
      const __m256 y = _mm256_mul_ps(_mm256_load_ps(x + j), inverse);
      const __m256 magnitude = _mm256_andnot_ps(sign_bit, y);
      const __m256 e = simd::Avx2::exp_non_positive(_mm256_mul_ps(magnitude, _mm256_set1_ps(-2.0f)));
      const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
      const __m256 signed_t = _mm256_or_ps(t, _mm256_and_ps(sign_bit, y));
      _mm256_store_ps(x + j, _mm256_mul_ps(signed_t, capv));
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
      ahead.next(kAheadLinesPerColumns);
      __m256 a[R], b[R];
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_loadu_ps(acc + r * D + d);
        b[r] = _mm256_loadu_ps(acc + r * D + d + 8);
      }
      const E* v = st.values + d;
      for (int64_t j = 0; j < n; ++j, v += stride) {
        const __m256 v0 = ValueLanes<E>::template half<0>(v);
        const __m256 v1 = ValueLanes<E>::template half<1>(v);
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

}  // namespace attention
}  // namespace cpu
}  // namespace pagedkv

#endif  // PAGEDKV_ATTENTION_AVX2
