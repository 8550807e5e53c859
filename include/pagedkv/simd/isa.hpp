// Which instruction set the CPU attention kernel runs: the best this CPU
// has (AVX-512, else AVX2/FMA/F16C, else portable loops), checked once at
// run time, or one chosen for the calling thread (ScopedIsa: tests compare
// every path the machine has against the portable one).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "pagedkv/simd/isa_avx2.hpp"
#include "pagedkv/simd/isa_avx512.hpp"
#include "pagedkv/simd/isa_portable.hpp"

#ifdef PAGEDKV_ATTENTION_AVX2
#include <cpuid.h>
#endif

namespace pagedkv {
namespace simd {

enum class Isa { best, portable, avx2, avx512 };

/// Whether this CPU (and its OS) runs the Avx2 path.
inline bool cpu_has_avx2() {
#ifdef PAGEDKV_ATTENTION_AVX2
  // F16C through cpuid: clang (14) rejects __builtin_cpu_supports("f16c").
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  }();
  return has;
#else
  return false;
#endif
}

/// Whether this CPU (and its OS) runs the Avx512 path.
inline bool cpu_has_avx512() {
#ifdef PAGEDKV_ATTENTION_AVX512
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

/// Whether this CPU runs AVX-512 BF16 dot products on 256-bit vectors
/// (avx512_bf16 and avx512vl: Zen 4, Sapphire Rapids, Cooper Lake): the
/// AVX-512 path's decode step scores bf16 keys with them
/// (cpu/attention/decode_avx512_bf16.hpp).
inline bool cpu_has_avx512_bf16() {
#ifdef PAGEDKV_ATTENTION_AVX512
  static const bool has = cpu_has_avx512() && [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0 || (ebx & (1u << 31)) == 0) return false;  // avx512vl
    if (eax < 1) return false;                                                                          // no subleaf 1
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && (eax & (1u << 5)) != 0;               // avx512_bf16
  }();
  return has;
#else
  return false;
#endif
}

#ifdef PAGEDKV_ATTENTION_AVX512
namespace detail {
/// Multiply-adds per timed pass of cpu_has_wide_fmas (short: once per process).
constexpr int64_t kTimedMultiplyAdds = int64_t{1} << 23;

// The timed loop's two operations per width: the same loop below serves
// both, so that the comparison is between widths and nothing else.
__attribute__((target("avx512f,avx2,fma"))) inline void splat(float x, __m256& v) { v = _mm256_set1_ps(x); }
__attribute__((target("avx512f,avx2,fma"))) inline void splat(float x, __m512& v) { v = _mm512_set1_ps(x); }
__attribute__((target("avx512f,avx2,fma"))) inline __m256 fma_step(__m256 a, __m256 b, __m256 c) {
  return _mm256_fmadd_ps(a, b, c);
}
__attribute__((target("avx512f,avx2,fma"))) inline __m512 fma_step(__m512 a, __m512 b, __m512 c) {
  return _mm512_fmadd_ps(a, b, c);
}

/// The fastest of three passes of kTimedMultiplyAdds as FMAs of Vec (__m256
/// or __m512) on 12 dependent chains (acc * c + d converges to 1: no
/// overflow, no subnormals). AVX-512 CPUs only (cpu_has_wide_fmas). The
/// chains start from different values: started equal, g++ -O3 merged them
/// into one, and the passes timed one chain's latency instead of the pipes'
/// throughput (bench/NOTES.md, "The decode step in 512 bits").
template <class Vec>
__attribute__((target("avx512f,avx2,fma"))) double best_fma_seconds() {
  constexpr int64_t kLanes = static_cast<int64_t>(sizeof(Vec) / sizeof(float));
  double best = 1e30;
  for (int pass = 0; pass < 3; ++pass) {
    Vec c, d, acc[12];
    splat(0.999f, c);
    splat(0.001f, d);
    for (int i = 0; i < 12; ++i) splat(static_cast<float>(i), acc[i]);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kTimedMultiplyAdds / (12 * kLanes); ++i) {
#pragma GCC unroll 12  // the chains in registers at -O2 too (not unrolled, they stayed in memory)
      for (Vec& a : acc) a = fma_step(a, c, d);
    }
    for (const Vec& a : acc) __asm__ volatile("" : : "v"(a));  // the chains are used
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}
}  // namespace detail
#endif

/// Whether a 512-bit FMA does about twice the work of a 256-bit one on this
/// core: 2^23 multiply-adds on 12 independent chains ran at least 1.5x as
/// fast in 512-bit vectors (best of three each, once per process, on the
/// first caller's core). Cores with two 512-bit FMA pipes (most Xeons since
/// Skylake-SP) run them twice as fast, cores that split a 512-bit FMA (Zen 4)
/// or have one 512-bit pipe no faster; the margin keeps a noisy timing from
/// changing the answer (bench/NOTES.md, "The decode step in 512 bits"). The
/// AVX-512 path's decode step follows it (cpu/attention/decode.hpp).
inline bool cpu_has_wide_fmas() {
#ifdef PAGEDKV_ATTENTION_AVX512
  static const bool wide = cpu_has_avx512() && [] {
    detail::best_fma_seconds<__m512>();  // a first 512-bit pass: cores that power up their 512-bit units on use
    return detail::best_fma_seconds<__m256>() >= 1.5 * detail::best_fma_seconds<__m512>();
  }();
  return wide;
#else
  return false;
#endif
}

/// Whether this CPU runs `isa` (best and portable run everywhere).
inline bool cpu_runs(Isa isa) {
  switch (isa) {
    case Isa::avx2: return cpu_has_avx2();
    case Isa::avx512: return cpu_has_avx512();
    default: return true;
  }
}

/// Every path this CPU runs, portable first.
inline std::vector<Isa> available_isas() {
  std::vector<Isa> isas{Isa::portable};
  for (Isa isa : {Isa::avx2, Isa::avx512})
    if (cpu_runs(isa)) isas.push_back(isa);
  return isas;
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    default: return "best";
  }
}

inline Isa& isa_override() noexcept {
  thread_local Isa isa = Isa::best;
  return isa;
}

/// The path the calling thread's kernels take: its ScopedIsa (when the CPU
/// runs it; portable otherwise), else the best the CPU has.
inline Isa selected_isa() {
  const Isa wanted = isa_override();
  if (wanted == Isa::best) return cpu_has_avx512() ? Isa::avx512 : cpu_has_avx2() ? Isa::avx2 : Isa::portable;
  return cpu_runs(wanted) ? wanted : Isa::portable;
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

}  // namespace simd
}  // namespace pagedkv
