// Checks the vector encoders (AVX-512: quant::encode_e4m3_x16,
// encode_int8_x16; AVX2: encode_e4m3_x8, encode_int8_x8 with their byte
// packing and, for int8, without_nan_codes) against the scalar ones
// (encode_e4m3, encode_int8) on every one of the 2^32 float32 bit patterns:
// a proof by exhaustion that the vector encoders compute the scalar
// functions. The fp8 encoders' finite-row variants (kFiniteRow: a row of
// finite values with its own scale, so no NaN and |y| <= 448 (1 + 2^-23))
// are checked on every float32 in that domain. The unit tests check every
// fp16 input and 10^7 random floats
// on each run; this takes ~1 min of CPU, so it runs by hand, after a change
// to either encoder. Not part of the build;
// bench/NOTES.md quotes it.
//
// Build (from the repository root):
//   g++ -std=c++17 -O2 -pthread -Iinclude -isystem /usr/include/torch/csrc/api/include
//       bench/tools/encoder_exhaustive.cpp -o /tmp/encoder_exhaustive
// Run:   /tmp/encoder_exhaustive [threads]     (default 2; exit status 1 on any mismatch)
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "pagedkv/cpu/quant/codecs.hpp"

#ifndef PAGEDKV_ATTENTION_AVX512
int main() {
  std::puts("encoder_exhaustive: this build has no AVX-512 path");
  return 0;
}
#else
namespace quant = pagedkv::cpu::quant;

namespace {

std::atomic<int64_t> fp8_mismatches{0};
std::atomic<int64_t> int8_mismatches{0};
std::atomic<int64_t> avx2_fp8_mismatches{0};
std::atomic<int64_t> avx2_int8_mismatches{0};
std::atomic<int64_t> finite_row_fp8_mismatches{0};
std::atomic<int64_t> avx2_finite_row_fp8_mismatches{0};
std::atomic<int64_t> finite_row_lanes{0};
std::atomic<int64_t> done{0};

/// Counts (and prints the first few of) the lanes where `got` is not `want`.
template <class Code>
void compare(const char* what, const float* y, const Code* got, Code (*want)(float), int64_t& mismatches) {
  for (int l = 0; l < 16; ++l) {
    if (got[l] != want(y[l]) && mismatches++ < 4) {
      std::printf("%s mismatch: y = %a, vector %d, scalar %d\n", what, static_cast<double>(y[l]),
                  static_cast<int>(got[l]), static_cast<int>(want(y[l])));
    }
  }
}

/// Whether y is in the kFiniteRow encoders' domain: finite, |y| <= 448 (1 + 2^-23).
bool in_finite_row_domain(float y) {
  return std::fabs(y) <= std::nextafter(quant::kFp8Max, std::numeric_limits<float>::infinity());
}

/// compare() on the lanes in_finite_row_domain.
void compare_finite_row(const char* what, const float* y, const uint8_t* got, int64_t& mismatches) {
  for (int l = 0; l < 16; ++l) {
    if (!in_finite_row_domain(y[l])) continue;
    if (got[l] != quant::encode_e4m3(y[l]) && mismatches++ < 4) {
      std::printf("%s mismatch: y = %a, vector %d, scalar %d\n", what, static_cast<double>(y[l]),
                  static_cast<int>(got[l]), static_cast<int>(quant::encode_e4m3(y[l])));
    }
  }
}

/// Checks the bit patterns [first, last), 16 at a time. The fp8 encoders
/// take y x 2^8 (quant::kE4m3EncodeFactor), as encode_avx512 / encode_avx2 hand it over.
PAGEDKV_TARGET_AVX512 void check_range(uint64_t first, uint64_t last) {
  alignas(64) float y[16];
  alignas(16) uint8_t fp8[16];
  alignas(16) int8_t int8[16];
  int64_t fp8_bad = 0, int8_bad = 0, avx2_fp8_bad = 0, avx2_int8_bad = 0;
  int64_t finite_row_bad = 0, avx2_finite_row_bad = 0, finite_row_seen = 0;
  for (uint64_t base = first; base < last; base += 16) {
    for (int l = 0; l < 16; ++l) {
      const auto bits = static_cast<uint32_t>(base + static_cast<uint64_t>(l));
      std::memcpy(&y[l], &bits, sizeof(bits));
    }
    const __m512 v = _mm512_load_ps(y);
    _mm_store_si128(reinterpret_cast<__m128i*>(fp8),
                    quant::encode_e4m3_x16(_mm512_mul_ps(v, _mm512_set1_ps(quant::kE4m3EncodeFactor))));
    _mm_store_si128(reinterpret_cast<__m128i*>(int8), quant::encode_int8_x16(v));
    compare<uint8_t>("avx512 fp8", y, fp8, quant::encode_e4m3, fp8_bad);
    compare<int8_t>("avx512 int8", y, int8, quant::encode_int8, int8_bad);
    for (int half = 0; half < 2; ++half) {
      const __m256 v8 = _mm256_load_ps(y + 8 * half);
      const __m256 scaled = _mm256_mul_ps(v8, _mm256_set1_ps(quant::kE4m3EncodeFactor));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(fp8 + 8 * half),
                       quant::narrow_epi32_epi8_x8<false>(quant::encode_e4m3_x8(scaled)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(int8 + 8 * half),
                       quant::without_nan_codes<pagedkv::KVFormat::int8>(
                           quant::narrow_epi32_epi8_x8<true>(quant::encode_int8_x8(v8))));
    }
    compare<uint8_t>("avx2 fp8", y, fp8, quant::encode_e4m3, avx2_fp8_bad);
    compare<int8_t>("avx2 int8", y, int8, quant::encode_int8, avx2_int8_bad);
    _mm_store_si128(reinterpret_cast<__m128i*>(fp8),
                    quant::encode_e4m3_x16<true>(_mm512_mul_ps(v, _mm512_set1_ps(quant::kE4m3EncodeFactor))));
    for (int l = 0; l < 16; ++l) finite_row_seen += in_finite_row_domain(y[l]) ? 1 : 0;
    compare_finite_row("avx512 finite-row fp8", y, fp8, finite_row_bad);
    for (int half = 0; half < 2; ++half) {
      const __m256 scaled = _mm256_mul_ps(_mm256_load_ps(y + 8 * half), _mm256_set1_ps(quant::kE4m3EncodeFactor));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(fp8 + 8 * half),
                       quant::narrow_epi32_epi8_x8<false>(quant::encode_e4m3_x8<true>(scaled)));
    }
    compare_finite_row("avx2 finite-row fp8", y, fp8, avx2_finite_row_bad);
    if ((base & 0xFFFFFFu) == 0) done += 1 << 24;
  }
  fp8_mismatches += fp8_bad;
  int8_mismatches += int8_bad;
  avx2_fp8_mismatches += avx2_fp8_bad;
  avx2_int8_mismatches += avx2_int8_bad;
  finite_row_fp8_mismatches += finite_row_bad;
  avx2_finite_row_fp8_mismatches += avx2_finite_row_bad;
  finite_row_lanes += finite_row_seen;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::puts("usage: encoder_exhaustive [threads]\nChecks the AVX-512 and AVX2 fp8 and int8 encoders against the"
              " scalar ones on all 2^32 float32 values (the fp8 finite-row variants on those they take).");
    return 0;
  }
  if (!pagedkv::simd::cpu_has_avx512()) {
    std::puts("encoder_exhaustive: this CPU has no AVX-512F; nothing to check");
    return 0;
  }
  const int threads = argc > 1 ? std::max(1, std::atoi(argv[1])) : 2;
  const uint64_t total = uint64_t{1} << 32;
  const uint64_t per_thread = total / static_cast<uint64_t>(threads) / 16 * 16;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const uint64_t first = per_thread * static_cast<uint64_t>(t);
    pool.emplace_back(check_range, first, t + 1 == threads ? total : first + per_thread);
  }
  for (int64_t seen = 0; seen < static_cast<int64_t>(total);) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    seen = done.load();
    std::printf("encoder_exhaustive: %3.0f%% of the bit patterns\n", 100.0 * static_cast<double>(seen) / 4294967296.0);
    std::fflush(stdout);
  }
  for (auto& t : pool) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("encoder_exhaustive: all 2^32 floats in %.1f s: mismatches AVX-512 fp8 %lld, int8 %lld; AVX2 fp8 %lld,"
              " int8 %lld\n",
              seconds, static_cast<long long>(fp8_mismatches.load()), static_cast<long long>(int8_mismatches.load()),
              static_cast<long long>(avx2_fp8_mismatches.load()), static_cast<long long>(avx2_int8_mismatches.load()));
  std::printf("encoder_exhaustive: fp8 finite-row encoders on the %lld floats of their domain:"
              " mismatches AVX-512 %lld, AVX2 %lld\n",
              static_cast<long long>(finite_row_lanes.load()),
              static_cast<long long>(finite_row_fp8_mismatches.load()),
              static_cast<long long>(avx2_finite_row_fp8_mismatches.load()));
  return fp8_mismatches.load() + int8_mismatches.load() + avx2_fp8_mismatches.load() + avx2_int8_mismatches.load() +
                     finite_row_fp8_mismatches.load() + avx2_finite_row_fp8_mismatches.load() ==
                 0
             ? 0
             : 1;
}
#endif
