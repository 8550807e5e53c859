// Paged attention: decode and chunked prefill (causal, GQA/MQA) that read
// keys and values straight from the pages through the page table.
//
// CPU: a hand-written kernel. Keys and values are read block by block
// (kKeyBlock tokens, converted to float32 once per block and shared by every
// query row of the item), with an online softmax (running max and sum) in
// float32. Work items are (sequence, query tile, kv heads, key split): decode
// takes every kv head of a sequence at once (contiguous reads in both
// layouts), prefill one kv head and a tile of queries; long contexts are
// split across threads (flash-decoding) and the partial results merged
// afterwards, so a batch of one still uses every core. The arithmetic runs
// with AVX2/FMA/F16C when the CPU has them (checked at run time), portable
// auto-vectorised loops otherwise.
// Other devices: a device-agnostic ATen path (gather, then a masked softmax).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "pagedkv/cache_view.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/kernels.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/paged_cache.hpp"

namespace pagedkv {
namespace attention_kernels {

/// Tokens whose keys (and values) are read and converted at once: one block
/// is shared by every query row of a work item.
constexpr int64_t kKeyBlock = 32;
/// Query rows (queries x query heads) one work item handles.
constexpr int64_t kRowsPerTile = 64;
/// A context is split across threads only into pieces of at least this many tokens.
constexpr int64_t kMinSplitTokens = 256;

// ---- conversions to float32 ----

inline float float_from_bits(uint32_t bits) noexcept {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint32_t bits_from_float(float f) noexcept {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

/// IEEE half -> float, bit-identical to c10::Half's conversion but written
/// without a branch, so the compiler vectorises loops over it (c10's select
/// is not if-converted by g++ 12 at -O3).
inline float half_to_float(uint16_t h) noexcept {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  // Normal numbers: re-bias the exponent (Inf/NaN stay Inf/NaN).
  const uint32_t normalized =
      bits_from_float(float_from_bits((two_w >> 4) + (UINT32_C(0xE0) << 23)) * float_from_bits(UINT32_C(15) << 23));
  // Zeros and subnormals: mantissa * 2^-24 via a magic bias.
  const uint32_t denormalized = bits_from_float(float_from_bits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f);
  const uint32_t is_denormal = UINT32_C(0) - static_cast<uint32_t>(two_w < (UINT32_C(1) << 27));
  return float_from_bits(sign | (denormalized & is_denormal) | (normalized & ~is_denormal));
}

inline float bfloat16_to_float(uint16_t h) noexcept { return float_from_bits(static_cast<uint32_t>(h) << 16); }

// ---- the arithmetic over head_dim, per instruction set ----
//
// Portable: plain loops that g++ -O3 auto-vectorises for the baseline ISA.
// Avx2 (x86-64 with AVX2, FMA and F16C, checked at run time): intrinsics;
// the kernel is instantiated for it inside a target("avx2,fma,f16c")
// function, so one binary runs everywhere and uses what the CPU has.

struct Portable {
  static void to_float(const float* src,      // [n]
                       float* __restrict dst,  // [n]
                       int64_t n) noexcept {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
  static void to_float(const c10::Half* src,  // [n]
                       float* __restrict dst,  // [n]
                       int64_t n) noexcept {
    for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i].x);
  }
  static void to_float(const c10::BFloat16* src,  // [n]
                       float* __restrict dst,      // [n]
                       int64_t n) noexcept {
    for (int64_t i = 0; i < n; ++i) dst[i] = bfloat16_to_float(src[i].x);
  }

  /// sum_d a[d] * b[d], with 16 partial sums so that it vectorises without
  /// -ffast-math (the order of the additions is fixed: deterministic).
  static float dot(const float* __restrict a,  // [n]
                   const float* __restrict b,  // [n]
                   int64_t n) noexcept {
    constexpr int64_t kLanes = 16;
    float part[kLanes] = {};
    int64_t d = 0;
    for (; d + kLanes <= n; d += kLanes)
      for (int64_t i = 0; i < kLanes; ++i) part[i] += a[d + i] * b[d + i];
    for (int64_t i = 0; d + i < n; ++i) part[i] += a[d + i] * b[d + i];
    float sum = 0.0f;
    for (int64_t i = 0; i < kLanes; ++i) sum += part[i];
    return sum;
  }

  /// acc += sum_j p[j] * v[j] over n keys, four keys per pass over acc.
  static void accumulate(float* __restrict acc,  // [D]
                         const float* const* v,  // n x [D]
                         const float* p,         // [n]
                         int64_t n, int64_t head_dim) noexcept {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
      const float* __restrict v0 = v[j];
      const float* __restrict v1 = v[j + 1];
      const float* __restrict v2 = v[j + 2];
      const float* __restrict v3 = v[j + 3];
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
    for (; j < n; ++j) {
      const float pj = p[j];
      const float* __restrict vj = v[j];
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * vj[d];
    }
  }

  /// out[k] = dot(q, keys[k]) for four keys.
  static void dot4(const float* q,            // [n]
                   const float* const* keys,  // 4 x [n]
                   int64_t n, float* out) noexcept {
    for (int k = 0; k < 4; ++k) out[k] = dot(q, keys[k], n);
  }

  /// scores[j] = exp(scores[j] - max); returns their sum.
  static float exp_sum(float* scores,  // [n]
                       int64_t n, float max) noexcept {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      scores[j] = std::exp(scores[j] - max);
      sum += scores[j];
    }
    return sum;
  }

  static void scale(float* __restrict row,  // [n]
                    float factor, int64_t n) noexcept {
    for (int64_t d = 0; d < n; ++d) row[d] *= factor;
  }
};

#if defined(__GNUC__) && defined(__x86_64__)
#define PAGEDKV_ATTENTION_AVX2 1
#define PAGEDKV_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

struct Avx2 {
  static void to_float(const float* src,      // [n]
                       float* __restrict dst,  // [n]
                       int64_t n) noexcept {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
  PAGEDKV_TARGET_AVX2 static void to_float(const c10::Half* src,  // [n]
                                           float* __restrict dst,  // [n]
                                           int64_t n) noexcept {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = half_to_float(src[i].x);
  }
  PAGEDKV_TARGET_AVX2 static void to_float(const c10::BFloat16* src,  // [n]
                                           float* __restrict dst,      // [n]
                                           int64_t n) noexcept {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; i < n; ++i) dst[i] = bfloat16_to_float(src[i].x);
  }

  PAGEDKV_TARGET_AVX2 static float dot(const float* a,  // [n]
                                       const float* b,  // [n]
                                       int64_t n) noexcept {
    __m256 acc0 = _mm256_setzero_ps();
    __m256 acc1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    for (; d + 8 <= n; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc0 = _mm256_add_ps(acc0, acc1);
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));
    float result = _mm_cvtss_f32(sum);
    for (; d < n; ++d) result += a[d] * b[d];
    return result;
  }

  /// out[k] = dot(q, keys[k]) for four keys: eight independent FMA chains
  /// (one dot alone is bound by the FMA latency).
  PAGEDKV_TARGET_AVX2 static void dot4(const float* q,            // [n]
                                       const float* const* keys,  // 4 x [n]
                                       int64_t n, float* out) noexcept {
    const float* k0 = keys[0];
    const float* k1 = keys[1];
    const float* k2 = keys[2];
    const float* k3 = keys[3];
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      const __m256 qa = _mm256_loadu_ps(q + d);
      const __m256 qb = _mm256_loadu_ps(q + d + 8);
      a0 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k1 + d), a1);
      a2 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k2 + d), a2);
      a3 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k3 + d), a3);
      b0 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k0 + d + 8), b0);
      b1 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k1 + d + 8), b1);
      b2 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k2 + d + 8), b2);
      b3 = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k3 + d + 8), b3);
    }
    for (; d + 8 <= n; d += 8) {
      const __m256 qa = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k1 + d), a1);
      a2 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k2 + d), a2);
      a3 = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k3 + d), a3);
    }
    // Horizontal sums of the four keys at once: [s0, s1, s2, s3].
    const __m256 h01 = _mm256_hadd_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
    const __m256 h23 = _mm256_hadd_ps(_mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3));
    const __m256 h = _mm256_hadd_ps(h01, h23);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (; d < n; ++d) {
      out[0] += q[d] * k0[d];
      out[1] += q[d] * k1[d];
      out[2] += q[d] * k2[d];
      out[3] += q[d] * k3[d];
    }
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

  PAGEDKV_TARGET_AVX2 static void accumulate(float* acc,             // [D]
                                             const float* const* v,  // n x [D]
                                             const float* p,         // [n]
                                             int64_t n, int64_t head_dim) noexcept {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const __m256 p0 = _mm256_set1_ps(p[j]), p1 = _mm256_set1_ps(p[j + 1]);
      const __m256 p2 = _mm256_set1_ps(p[j + 2]), p3 = _mm256_set1_ps(p[j + 3]);
      const float* v0 = v[j];
      const float* v1 = v[j + 1];
      const float* v2 = v[j + 2];
      const float* v3 = v[j + 3];
      int64_t d = 0;
      for (; d + 8 <= head_dim; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        a = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + d), a);
        a = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + d), a);
        a = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v2 + d), a);
        a = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v3 + d), a);
        _mm256_storeu_ps(acc + d, a);
      }
      for (; d < head_dim; ++d) acc[d] += p[j] * v0[d] + p[j + 1] * v1[d] + p[j + 2] * v2[d] + p[j + 3] * v3[d];
    }
    for (; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* vj = v[j];
      int64_t d = 0;
      for (; d + 8 <= head_dim; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + d), _mm256_loadu_ps(acc + d)));
      for (; d < head_dim; ++d) acc[d] += p[j] * vj[d];
    }
  }

  PAGEDKV_TARGET_AVX2 static void scale(float* row,  // [n]
                                        float factor, int64_t n) noexcept {
    const __m256 f = _mm256_set1_ps(factor);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(row + d, _mm256_mul_ps(f, _mm256_loadu_ps(row + d)));
    for (; d < n; ++d) row[d] *= factor;
  }
};

/// Whether this CPU runs the Avx2 path (checked once).
inline bool cpu_has_avx2() {
  // F16C through cpuid: clang (14) rejects __builtin_cpu_supports("f16c").
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  }();
  return has;
}
#else
inline bool cpu_has_avx2() { return false; }
#endif

/// Which instruction set the CPU kernel uses: the best the CPU has, or the
/// portable loops (lets tests cover both on any machine).
enum class Isa { best, portable };

inline Isa& isa_override() noexcept {
  thread_local Isa isa = Isa::best;
  return isa;
}

/// Sets the CPU kernel's instruction set for the calling thread, for one scope.
class ScopedIsa {
 public:
  explicit ScopedIsa(Isa isa) : previous_(isa_override()) { isa_override() = isa; }
  ~ScopedIsa() { isa_override() = previous_; }
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;

 private:
  Isa previous_;
};

// ---- work decomposition ----

/// Queries [s0, s1) of sequence b, kv heads [h0, h0 + nh) (and their query
/// heads), against keys [t0, t1).
struct Work {
  int64_t b;
  int64_t s0, s1;
  int64_t h0, nh;
  int64_t t0, t1;
  int64_t partial;  ///< first scratch row of its partial result; -1: writes the output
};

/// A tile whose keys were split: split i's partial rows start at
/// partial + i * rows; they are merged into the output afterwards.
struct SplitTile {
  int64_t b;
  int64_t s0, s1;
  int64_t h0, nh;
  int64_t n_splits;
  int64_t partial;
};

struct Plan {
  std::vector<Work> work;
  std::vector<SplitTile> split;  ///< tiles to merge
  int64_t partial_rows = 0;      ///< scratch rows of (max, sum, acc[D])
  int64_t max_rows = 0;          ///< query rows of the largest work item
  int64_t heads = 1;             ///< kv heads per work item
};

/// Tiles the queries (and kv heads) and splits each tile's keys so that the
/// work items keep `n_threads` threads busy with about equal work.
/// Decode and short chunks take every kv head in one item: the item then
/// reads whole tokens (NHD) or whole pages (HND), contiguous memory.
inline Plan plan(const std::vector<int64_t>& lengths,  // [B], each >= n_queries >= 1
                 int64_t n_queries, int64_t group, int64_t n_kv_heads, int64_t n_threads) {
  Plan p;
  int64_t tile = n_queries;
  if (n_queries * group * n_kv_heads <= kRowsPerTile) {
    p.heads = n_kv_heads;
  } else {
    p.heads = 1;
    tile = std::min(n_queries, std::max<int64_t>(1, kRowsPerTile / group));
  }
  p.max_rows = tile * group * p.heads;
  // Keys read x kv heads, over every tile: the total work.
  int64_t total = 0;
  for (const int64_t length : lengths)
    for (int64_t s0 = 0; s0 < n_queries; s0 += tile) total += length - n_queries + std::min(s0 + tile, n_queries);
  total *= n_kv_heads;
  const int64_t target_items = n_threads <= 1 ? 1 : 4 * n_threads;
  int64_t chunk = std::max(kMinSplitTokens, (total + target_items - 1) / target_items / p.heads);
  chunk = (chunk + kKeyBlock - 1) / kKeyBlock * kKeyBlock;

  for (int64_t b = 0; b < static_cast<int64_t>(lengths.size()); ++b) {
    const int64_t first_pos = lengths[static_cast<size_t>(b)] - n_queries;  // position of query 0
    for (int64_t s0 = 0; s0 < n_queries; s0 += tile) {
      const int64_t s1 = std::min(s0 + tile, n_queries);
      const int64_t keys = first_pos + s1;  // the tile's last query sees [0, keys)
      const int64_t n_splits = (keys + chunk - 1) / chunk;
      const int64_t rows = (s1 - s0) * group * p.heads;
      for (int64_t h0 = 0; h0 < n_kv_heads; h0 += p.heads) {
        const int64_t partial = n_splits > 1 ? p.partial_rows : -1;
        if (n_splits > 1) {
          p.split.push_back({b, s0, s1, h0, p.heads, n_splits, partial});
          p.partial_rows += n_splits * rows;
        }
        for (int64_t i = 0; i < n_splits; ++i) {
          p.work.push_back({b, s0, s1, h0, p.heads, i * chunk, std::min((i + 1) * chunk, keys),
                            n_splits > 1 ? partial + i * rows : -1});
        }
      }
    }
  }
  return p;
}

/// Raw operands of one call.
template <class T, class Index>
struct Problem {
  PageTableRef<Index> table;  // [B, max_pages]
  const int64_t* lengths;     // [B]
  const float* q;             // [B, Sq, n_heads, D], contiguous, pre-scaled
  T* out;                     // [B, Sq, n_heads, D], contiguous
  const T* k_pages;           // [n_pages, <page>], one layer
  const T* v_pages;           // [n_pages, <page>], one layer
  float* partials;            // [partial_rows, 2 + D]: (max, sum, acc)
  PageGeometry g;
  int64_t n_queries;  // Sq
  int64_t n_heads;    // query heads
  int64_t group;      // n_heads / n_kv_heads
};

/// Per-thread buffers, kept between calls (at::parallel_for's threads
/// persist), so that a decode step allocates nothing per thread.
struct Scratch {
  std::vector<float> k;              // [heads * kKeyBlock, D] converted keys
  std::vector<float> v;              // [heads * kKeyBlock, D] converted values
  std::vector<const float*> k_rows;  // [heads, kKeyBlock]: the float32 key of (head, token)
  std::vector<const float*> v_rows;  // [heads, kKeyBlock]
  std::vector<float> acc;            // [rows, D]
  std::vector<float> max;            // [rows]
  std::vector<float> sum;            // [rows]
  float scores[kKeyBlock] = {};

  /// The calling thread's buffers, large enough for the plan.
  static Scratch& local(int64_t max_rows, int64_t heads, int64_t head_dim) {
    thread_local Scratch scratch;
    const auto grow = [](auto& buffer, int64_t size) {
      if (buffer.size() < static_cast<size_t>(size)) buffer.resize(static_cast<size_t>(size));
    };
    grow(scratch.k, heads * kKeyBlock * head_dim);
    grow(scratch.v, heads * kKeyBlock * head_dim);
    grow(scratch.k_rows, heads * kKeyBlock);
    grow(scratch.v_rows, heads * kKeyBlock);
    grow(scratch.acc, max_rows * head_dim);
    grow(scratch.max, max_rows);
    grow(scratch.sum, max_rows);
    return scratch;
  }
};

/// Points rows[h * kKeyBlock + j] at the float32 vector of kv head h0 + h,
/// token t0 + j. Converts (or copies) into `buffer`, laid out [head, token,
/// D] so that one head's keys are adjacent: NHD rows a token apart would
/// alias in the L1 cache (a 4 KiB stride for 8 heads x 128 x fp32). A
/// float32 cache whose head's tokens are contiguous (HND) is read in place.
template <class Ops, class T, class Index>
void load_block(const Problem<T, Index>& pr, const T* pages, int64_t b, int64_t h0, int64_t nh, int64_t t0, int64_t n,
                float* buffer,  // [nh, kKeyBlock, D]
                const float** rows) {
  const PageGeometry& g = pr.g;
  const int64_t D = g.head_dim;
  for (int64_t t = t0; t < t0 + n;) {
    const int64_t in_page = t % g.page_size;
    const int64_t run = std::min(t0 + n - t, g.page_size - in_page);  // tokens of this page in the block
    const T* page = pages + pr.table(b, t / g.page_size) * g.page_elems;
    const int64_t j0 = t - t0;
    if (g.token_stride == D) {  // a head's tokens are contiguous: one run per head
      for (int64_t h = 0; h < nh; ++h) {
        const T* src = page + g.offset(in_page, h0 + h);
        if constexpr (std::is_same<T, float>::value) {
          for (int64_t j = 0; j < run; ++j) rows[h * kKeyBlock + j0 + j] = src + j * D;
        } else {
          float* dst = buffer + (h * kKeyBlock + j0) * D;
          Ops::to_float(src, dst, run * D);
          for (int64_t j = 0; j < run; ++j) rows[h * kKeyBlock + j0 + j] = dst + j * D;
        }
      }
    } else {  // a token's heads are contiguous (NHD): read token by token
      for (int64_t j = 0; j < run; ++j) {
        for (int64_t h = 0; h < nh; ++h) {
          float* dst = buffer + (h * kKeyBlock + j0 + j) * D;
          Ops::to_float(page + g.offset(in_page + j, h0 + h), dst, D);
          rows[h * kKeyBlock + j0 + j] = dst;
        }
      }
    }
    t += run;
  }
}

/// Writes one finished row: out = acc / sum.
template <class T>
void store_row(T* out,            // [D]
               const float* acc,  // [D]
               float sum, int64_t head_dim) {
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

/// One work item: online softmax over keys [t0, t1), float32 state per row.
/// Row r = ((s - s0) * nh + h) * G + i is query head (h0 + h) * G + i of query s.
template <class Ops, class T, class Index>
void run_item(const Problem<T, Index>& pr, const Work& w, Scratch& sc) {
  const int64_t D = pr.g.head_dim;
  const int64_t G = pr.group;
  const int64_t rows = (w.s1 - w.s0) * w.nh * G;
  const int64_t first_pos = pr.lengths[w.b] - pr.n_queries;
  float* acc_all = sc.acc.data();
  float* max = sc.max.data();
  float* sum = sc.sum.data();
  std::fill(max, max + rows, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rows, 0.0f);
  std::fill(acc_all, acc_all + rows * D, 0.0f);

  for (int64_t t0 = w.t0; t0 < w.t1; t0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, w.t1 - t0);
    load_block<Ops>(pr, pr.k_pages, w.b, w.h0, w.nh, t0, n, sc.k.data(), sc.k_rows.data());
    load_block<Ops>(pr, pr.v_pages, w.b, w.h0, w.nh, t0, n, sc.v.data(), sc.v_rows.data());
    for (int64_t s = w.s0; s < w.s1; ++s) {
      // Causal: query s (at position first_pos + s) sees keys <= its position.
      const int64_t visible = std::min(n, first_pos + s + 1 - t0);
      if (visible <= 0) continue;
      for (int64_t h = 0; h < w.nh; ++h) {
        const float* const* keys = sc.k_rows.data() + h * kKeyBlock;
        const float* const* values = sc.v_rows.data() + h * kKeyBlock;
        for (int64_t i = 0; i < G; ++i) {
          const int64_t r = ((s - w.s0) * w.nh + h) * G + i;
          const float* q = pr.q + ((w.b * pr.n_queries + s) * pr.n_heads + (w.h0 + h) * G + i) * D;
          int64_t j = 0;
          for (; j + 4 <= visible; j += 4) Ops::dot4(q, keys + j, D, sc.scores + j);
          for (; j < visible; ++j) sc.scores[j] = Ops::dot(q, keys[j], D);
          float block_max = sc.scores[0];
          for (j = 1; j < visible; ++j) block_max = std::max(block_max, sc.scores[j]);
          float* acc = acc_all + r * D;
          if (block_max > max[r]) {
            const float correction = std::exp(max[r] - block_max);  // 0 on the first block
            sum[r] *= correction;
            Ops::scale(acc, correction, D);
            max[r] = block_max;
          }
          sum[r] += Ops::exp_sum(sc.scores, visible, max[r]);
          Ops::accumulate(acc, values, sc.scores, visible, D);
        }
      }
    }
  }

  for (int64_t s = w.s0; s < w.s1; ++s) {
    for (int64_t h = 0; h < w.nh; ++h) {
      for (int64_t i = 0; i < G; ++i) {
        const int64_t r = ((s - w.s0) * w.nh + h) * G + i;
        const float* acc = acc_all + r * D;
        if (w.partial < 0) {
          store_row(pr.out + ((w.b * pr.n_queries + s) * pr.n_heads + (w.h0 + h) * G + i) * D, acc, sum[r], D);
        } else {
          float* dst = pr.partials + (w.partial + r) * (D + 2);
          dst[0] = max[r];
          dst[1] = sum[r];
          std::copy(acc, acc + D, dst + 2);
        }
      }
    }
  }
}

template <class Ops, class T, class Index>
void run_items(const Problem<T, Index>& pr, const Plan& p, int64_t begin, int64_t end, Scratch& sc) {
  for (int64_t i = begin; i < end; ++i) run_item<Ops>(pr, p.work[static_cast<size_t>(i)], sc);
}

#ifdef PAGEDKV_ATTENTION_AVX2
/// The Avx2 instantiation, compiled for AVX2/FMA/F16C: `flatten` inlines the
/// whole item loop here, so every helper is generated for that target.
template <class T, class Index>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void run_items_avx2(const Problem<T, Index>& pr, const Plan& p,
                                                                   int64_t begin, int64_t end, Scratch& sc) {
  run_items<Avx2>(pr, p, begin, end, sc);
}
#endif

/// Merges the splits of one tile into the output.
template <class T, class Index>
void merge_tile(const Problem<T, Index>& pr, const SplitTile& t, float* acc /* [D] */) {
  const int64_t D = pr.g.head_dim;
  const int64_t G = pr.group;
  const int64_t rows = (t.s1 - t.s0) * t.nh * G;
  const int64_t row_floats = D + 2;
  for (int64_t s = t.s0; s < t.s1; ++s) {
    for (int64_t h = 0; h < t.nh; ++h) {
      for (int64_t i = 0; i < G; ++i) {
        const int64_t r = ((s - t.s0) * t.nh + h) * G + i;
        const float* first = pr.partials + (t.partial + r) * row_floats;
        const int64_t split_stride = rows * row_floats;
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < t.n_splits; ++k) max = std::max(max, first[k * split_stride]);
        float sum = 0.0f;
        std::fill(acc, acc + D, 0.0f);
        for (int64_t k = 0; k < t.n_splits; ++k) {
          const float* part = first + k * split_stride;
          if (part[1] == 0.0f) continue;  // a split past this query's position
          const float weight = std::exp(part[0] - max);
          sum += part[1] * weight;
          const float* __restrict src = part + 2;
          for (int64_t d = 0; d < D; ++d) acc[d] += weight * src[d];
        }
        store_row(pr.out + ((t.b * pr.n_queries + s) * pr.n_heads + (t.h0 + h) * G + i) * D, acc, sum, D);
      }
    }
  }
}

/// The CPU kernel. Inputs are validated: lengths[b] >= Sq >= 1 and every
/// page holding [0, lengths[b]) is mapped and allocated.
template <class T, class Index>
void paged_attention_cpu_impl(const PageTableRef<Index>& table,     // [B, max_pages]
                              const std::vector<int64_t>& lengths,  // [B]
                              const float* q,                       // [B, Sq, n_heads, D], contiguous, pre-scaled
                              T* out,                               // [B, Sq, n_heads, D], contiguous
                              const T* k_pages,                     // [n_pages, <page>], one layer
                              const T* v_pages,                     // [n_pages, <page>], one layer
                              const PageGeometry& g, int64_t n_queries, int64_t n_heads) {
  const int64_t group = n_heads / g.n_heads;
  const Plan p = plan(lengths, n_queries, group, g.n_heads, at::get_num_threads());
  std::vector<float> partials(static_cast<size_t>(p.partial_rows * (g.head_dim + 2)));
  const Problem<T, Index> pr{table, lengths.data(), q, out, k_pages, v_pages, partials.data(),
                             g,     n_queries,      n_heads, group};
  const bool avx2 = isa_override() == Isa::best && cpu_has_avx2();  // decided on the calling thread
  at::parallel_for(0, static_cast<int64_t>(p.work.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch& sc = Scratch::local(p.max_rows, p.heads, g.head_dim);
#ifdef PAGEDKV_ATTENTION_AVX2
    if (avx2) return run_items_avx2(pr, p, begin, end, sc);
#endif
    run_items<Portable>(pr, p, begin, end, sc);
  });
  (void)avx2;
  if (p.split.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(p.split.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(g.head_dim));
    for (int64_t i = begin; i < end; ++i) merge_tile(pr, p.split[static_cast<size_t>(i)], acc.data());
  });
}

/// Device-agnostic path: gather [B, T, H, D], then a causal masked softmax
/// in float32 with ATen ops. Same results as the CPU kernel.
template <class Index>
at::Tensor paged_attention_generic(const PageTableRef<Index>& table,     // [B, max_pages]
                                   const std::vector<int64_t>& lengths,  // [B]
                                   const at::Tensor& q,                  // [B, Sq, n_heads, D]
                                   const at::Tensor& k_layer,            // [n_pages, <page>]
                                   const at::Tensor& v_layer,            // [n_pages, <page>]
                                   const PageGeometry& g, double scale) {
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2), D = q.size(3);
  const int64_t group = n_heads / g.n_heads;
  const int64_t n_tokens = *std::max_element(lengths.begin(), lengths.end());
  const auto kv = kernels::gather_generic(table, lengths, n_tokens, k_layer, v_layer, g);  // [B, T, H, D]
  const at::Tensor k = kv.first.to(at::kFloat).permute({0, 2, 3, 1});                     // [B, H, D, T]
  const at::Tensor v = kv.second.to(at::kFloat).permute({0, 2, 1, 3});                    // [B, H, T, D]
  // Query rows (s, g) of each kv head h: [B, H, Sq * G, D].
  const at::Tensor qf = q.to(at::kFloat).reshape({batch, n_queries, g.n_heads, group, D}).permute({0, 2, 1, 3, 4})
                            .reshape({batch, g.n_heads, n_queries * group, D});
  at::Tensor scores = at::matmul(qf, k).mul_(scale).view({batch, g.n_heads, n_queries, group, n_tokens});
  // Query s of sequence b sits at lengths[b] - Sq + s and sees positions <= it.
  const at::Tensor positions = at::arange(n_tokens, q.options().dtype(at::kLong));               // [T]
  const at::Tensor last = kernels::host_index(lengths, q.device()).view({batch, 1}) - n_queries +
                          at::arange(n_queries, q.options().dtype(at::kLong)).view({1, n_queries});  // [B, Sq]
  const at::Tensor hidden = positions.view({1, 1, n_tokens}).gt(last.unsqueeze(2));              // [B, Sq, T]
  scores.masked_fill_(hidden.view({batch, 1, n_queries, 1, n_tokens}), -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1).view({batch, g.n_heads, n_queries * group, n_tokens});
  const at::Tensor out = at::matmul(probs, v);  // [B, H, Sq * G, D]
  return out.view({batch, g.n_heads, n_queries, group, D})
      .permute({0, 2, 1, 3, 4})
      .reshape({batch, n_queries, n_heads, D})
      .to(q.scalar_type())
      .contiguous();
}

}  // namespace attention_kernels

/// Causal paged attention over a view bound with per-sequence lengths that
/// already count the Sq new tokens (written before the call). Query s of
/// sequence b sits at position lengths[b] - Sq + s and attends to positions
/// <= its own; query head h reads kv head h / (n_heads / n_kv_heads).
/// scale <= 0 means 1/sqrt(D). Returns [B, Sq, n_heads, D] in q's dtype.
template <class Layout>
at::Tensor paged_attention(const CacheView<Layout>& view, int64_t layer,
                           const at::Tensor& q,  // [B, Sq, n_heads, D], the cache's dtype, any strides
                           double scale = 0.0) {
  const checks::Caller caller{"paged_attention", Layout::name, nullptr};
  const PagedCache<Layout>& cache = view.cache();
  const PageGeometry& g = cache.geometry();
  const at::ScalarType dtype = cache.k_cache().scalar_type();
  checks::layer(caller, layer, cache.n_layers());
  checks::attention_dtype(caller, dtype);
  checks::page_table(caller, view.page_table(), cache.device());
  const int64_t batch = view.page_table().size(0);
  checks::attention_query(caller, q, batch, g, dtype, cache.device());
  checks::attention_scale(caller, scale);
  checks::bound_with_lengths(caller, view.lengths());
  const int64_t n_queries = q.size(1);
  const std::vector<int64_t> lengths = checks::per_sequence(caller, "lengths", view.lengths(), batch, cache.device());
  checks::attention_lengths(caller, lengths, n_queries);
  const at::Tensor host_table = view.page_table().device().is_cpu() ? view.page_table() : view.page_table().cpu();
  return visit_page_table(host_table, [&](const auto& table) {
    for (int64_t row = 0; row < table.rows; ++row) {
      checks::mapped_prefix(caller, table, row, lengths[static_cast<size_t>(row)], g.page_size, cache.pool());
    }
    // Validated: from here on nothing throws.
    if (batch == 0 || n_queries == 0) return at::empty(q.sizes(), q.options());
    const double s = scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(g.head_dim));
    const at::Tensor k_layer = cache.k_cache().select(0, layer);
    const at::Tensor v_layer = cache.v_cache().select(0, layer);
    if (!kernels::use_cpu_kernels(cache.device())) {
      return attention_kernels::paged_attention_generic(table, lengths, q, k_layer, v_layer, g, s);
    }
    const at::Tensor qf = q.to(at::kFloat).mul(s).contiguous();  // [B, Sq, n_heads, D]
    at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
    const int64_t n_heads = q.size(2);
    switch (dtype) {
      case at::kHalf:
        attention_kernels::paged_attention_cpu_impl(table, lengths, qf.data_ptr<float>(), out.data_ptr<c10::Half>(),
                                                    k_layer.data_ptr<c10::Half>(), v_layer.data_ptr<c10::Half>(), g,
                                                    n_queries, n_heads);
        break;
      case at::kBFloat16:
        attention_kernels::paged_attention_cpu_impl(
            table, lengths, qf.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), k_layer.data_ptr<c10::BFloat16>(),
            v_layer.data_ptr<c10::BFloat16>(), g, n_queries, n_heads);
        break;
      default:
        attention_kernels::paged_attention_cpu_impl(table, lengths, qf.data_ptr<float>(), out.data_ptr<float>(),
                                                    k_layer.data_ptr<float>(), v_layer.data_ptr<float>(), g,
                                                    n_queries, n_heads);
        break;
    }
    return out;
  });
}

}  // namespace pagedkv
