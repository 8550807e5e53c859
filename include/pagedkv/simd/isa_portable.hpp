// The attention kernel's arithmetic over head_dim in plain loops, which g++
// -O3 auto-vectorises for the baseline ISA. The reference every vector path
// (isa_avx2.hpp, isa_avx512.hpp) is tested against.
//
// Every ISA struct offers the same static functions:
//   to_float    a key or value vector (float32, fp16, bf16, codes) into float32
//   scores      rows x n dot products of query rows with key vectors
//   max         the largest of n scores
//   exp_sum     scores[j] = exp(scores[j] - max), returning their sum
//   accumulate  acc[r] += sum_j p[r][j] * v[j] for rows x n
//   scale       row *= factor
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "pagedkv/simd/constants.hpp"
#include "pagedkv/simd/convert.hpp"

namespace pagedkv {
namespace simd {

struct Portable {
  /// scores and accumulate read float32 copies of a block (load_block converts).
  static constexpr bool kReadsPagesDirectly = false;

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

  static void to_float(const E4m3Code* src,  // [n]
                       float* __restrict dst,  // [n]
                       int64_t n) noexcept {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float32(src[i]);
  }
  static void to_float(const int8_t* src,      // [n]
                       float* __restrict dst,  // [n]
                       int64_t n) noexcept {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
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

  /// out[r * kKeyBlock + j] = dot(q[r], keys[j]) for rows <= kRowsAtOnce.
  /// Keys are float32 (E: copies, or a float32 cache's pages).
  template <class E>
  static void scores(const float* const* q,    // rows x [D]
                     int rows,
                     const void* const* keys,  // n x [D]
                     int64_t n, int64_t head_dim,
                     float* out) noexcept {    // [rows, kKeyBlock]
    static_assert(std::is_same<E, float>::value, "the portable path reads float32 rows");
    for (int r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) out[r * kKeyBlock + j] = dot(q[r], row_as<float>(keys[j]), head_dim);
  }

  /// The largest of scores[0, n), n >= 1.
  static float max(const float* scores,  // [n]
                   int64_t n) noexcept {
    return *std::max_element(scores, scores + n);
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

  /// acc[r] += sum_j p[r * kKeyBlock + j] * v[j] for rows <= kRowsAtOnce,
  /// four keys per pass over a row.
  template <class E>
  static void accumulate(float* const* acc,      // rows x [D]
                         int rows,
                         const void* const* v,   // n x [D]
                         const float* p,         // [rows, kKeyBlock]
                         int64_t n, int64_t head_dim) noexcept {
    static_assert(std::is_same<E, float>::value, "the portable path reads float32 rows");
    for (int r = 0; r < rows; ++r) accumulate_row(acc[r], v, p + r * kKeyBlock, n, head_dim);
  }

  static void scale(float* __restrict row,  // [n]
                    float factor, int64_t n) noexcept {
    for (int64_t d = 0; d < n; ++d) row[d] *= factor;
  }

 private:
  static void accumulate_row(float* __restrict acc,  // [D]
                             const void* const* v,   // n x [D], float32
                             const float* p,         // [n]
                             int64_t n, int64_t head_dim) noexcept {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
      const float* __restrict v0 = row_as<float>(v[j]);
      const float* __restrict v1 = row_as<float>(v[j + 1]);
      const float* __restrict v2 = row_as<float>(v[j + 2]);
      const float* __restrict v3 = row_as<float>(v[j + 3]);
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
    for (; j < n; ++j) {
      const float pj = p[j];
      const float* __restrict vj = row_as<float>(v[j]);
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * vj[d];
    }
  }
};

}  // namespace simd
}  // namespace pagedkv
