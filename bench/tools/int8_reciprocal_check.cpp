// Checks the int8 encoders that divide by multiplying with the reciprocal
// (quant::encode_int8_of_row_avx512 and encode_int8_of_row_avx2, which
// quantize_rows uses for a row's own scale in [2^-100, 2^100]) against the
// division they replace, on many scales:
// - quotients: Markstein's y0 + (x - y0 * s) * r, r = 1 / s rounded, as
//   those encoders compute it, against x / s bit for bit, for every fp16
//   value and 2^20 random float32 bit patterns, wherever |x| >= 2^-103
//   (the remainder is exact: quant::int8_quotient_by_reciprocal_is_exact)
//   and 2^-30 <= |x / s| <= 128 (below, every quotient rounds to the code 0
//   either way; above, no row's x lies: |x| <= amax = 127 s);
// - codes: each encoder's codes against the scalar encode_int8(x / s) on
//   rows of x = u * 127 s, u every fp16 value in [-1, 1] and random floats
//   of every exponent in [-1, 1], NaN included.
// Scales: random significands, all-ones and all-zeros significands, every
// exponent from 2^-100 to 2^99, and the bounds themselves. The unit tests
// check rows of every fp16 value on a few scales on each run
// (VectorPaths.*); this takes ~1 min of CPU, so it runs by hand, after a
// change to those encoders. Not part of the build; bench/NOTES.md quotes it.
//
// Build (from the repository root):
//   g++ -std=c++17 -O2 -Iinclude -isystem /usr/include/torch/csrc/api/include
//       bench/tools/int8_reciprocal_check.cpp -o /tmp/int8_reciprocal_check -lc10
// Run:   /tmp/int8_reciprocal_check [scales]    (default 100000; exit status 1 on any mismatch)
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "pagedkv/cpu/quant/codecs.hpp"

#ifndef PAGEDKV_ATTENTION_AVX512
int main() {
  std::puts("int8_reciprocal_check: this build has no AVX-512 path");
  return 0;
}
#else
namespace quant = pagedkv::cpu::quant;

namespace {

/// Quotients of x[0, n) / s that differ from the division, where |x| >= 2^-103 and 2^-30 <= |x / s| <= 128;
/// adds the number of those quotients to `compared`.
PAGEDKV_TARGET_AVX512 int64_t quotient_mismatches(const float* x,  // [n], n % 16 == 0
                                                  int64_t n, float s, int64_t& compared) {
  const __m512 divisor = _mm512_set1_ps(s);
  const __m512 reciprocal = _mm512_set1_ps(1.0f / s);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 y0 = _mm512_mul_ps(v, reciprocal);
    const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(y0, divisor, v), reciprocal, y0);
    const __m512 d = _mm512_div_ps(v, divisor);
    const __m512 magnitude = _mm512_abs_ps(d);
    const __mmask16 in_range = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(128.0f), _CMP_LE_OQ) &
                               _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(0x1p-30f), _CMP_GE_OQ) &
                               _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-103f), _CMP_GE_OQ);
    const __mmask16 differ = _mm512_cmpneq_epi32_mask(_mm512_castps_si512(y), _mm512_castps_si512(d));
    mismatches += __builtin_popcount(static_cast<unsigned>(differ & in_range));
    compared += __builtin_popcount(static_cast<unsigned>(in_range));
  }
  return mismatches;
}

/// Codes of encode_int8_of_row_avx512 / _avx2 that differ from encode_int8(x / s).
int64_t code_mismatches(const std::vector<float>& x, float s, std::vector<int8_t>& codes) {
  const auto n = static_cast<int64_t>(x.size());
  int64_t mismatches = 0;
  quant::encode_int8_of_row_avx512(x.data(), n, s, codes.data());
  for (int64_t i = 0; i < n; ++i) mismatches += codes[i] != quant::encode_int8(x[i] / s);
  quant::encode_int8_of_row_avx2(x.data(), n, s, codes.data());
  for (int64_t i = 0; i < n; ++i) mismatches += codes[i] != quant::encode_int8(x[i] / s);
  return mismatches;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::puts("usage: int8_reciprocal_check [scales]  (default 100000; exit status 1 on any mismatch)");
    return 0;
  }
  const int64_t n_scales = argc > 1 ? std::atoll(argv[1]) : 100000;
  if (!pagedkv::simd::cpu_has_avx512()) {
    std::puts("int8_reciprocal_check: this CPU has no AVX-512");
    return 0;
  }
  std::mt19937 rng(7);
  std::vector<float> quotient_inputs;  // every fp16 value, then random finite float32 bit patterns
  std::vector<float> unit;             // u in [-1, 1]: every fp16 value / 65504 and random floats of every exponent
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float v = static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
    quotient_inputs.push_back(v);
    if (!std::isinf(v)) unit.push_back(v / 65504.0f);
  }
  for (int i = 0; i < (1 << 20); ++i) {
    const float f = quant::bits_float(rng());
    if (std::isfinite(f)) quotient_inputs.push_back(f);
    const float u = quant::bits_float((rng() & 0x807FFFFFu) | ((rng() % 127u) << 23));  // |u| < 1, any exponent
    unit.push_back(u);
  }
  while (quotient_inputs.size() % 16 != 0) quotient_inputs.push_back(1.0f);
  std::vector<float> row(unit.size());
  std::vector<int8_t> codes(unit.size());
  int64_t quotient_bad = 0, code_bad = 0, quotients = 0, checked_codes = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n_scales; ++k) {
    uint32_t significand = k % 4 == 0 ? 0x7FFFFFu : k % 4 == 1 ? 0u : (rng() & 0x7FFFFFu);
    uint32_t exponent = 127u - 100u + static_cast<uint32_t>(k / 4 % 200);  // 2^-100 .. 2^99
    float s = quant::bits_float((exponent << 23) | significand);
    if (k == 0) s = 0x1p-100f;
    if (k == 1) s = 0x1p100f;
    if (!quant::int8_quotient_by_reciprocal_is_exact(s)) {
      std::fprintf(stderr, "scale %a is outside the reciprocal path\n", static_cast<double>(s));
      return 1;
    }
    quotient_bad +=
        quotient_mismatches(quotient_inputs.data(), static_cast<int64_t>(quotient_inputs.size()), s, quotients);
    if (k % 16 == 0) {  // codes: every 16th scale (a scalar loop per code)
      for (size_t i = 0; i < unit.size(); ++i) row[i] = unit[i] * (quant::kInt8Max * s);
      code_bad += code_mismatches(row, s, codes);
      checked_codes += 2 * static_cast<int64_t>(row.size());
    }
    if ((k + 1) % 10000 == 0) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "%lld / %lld scales, %.0f s\n", static_cast<long long>(k + 1),
                   static_cast<long long>(n_scales), seconds);
    }
  }
  std::printf("quotients in the checked range: %lld, of which %lld differ from the division\n",
              static_cast<long long>(quotients),
              static_cast<long long>(quotient_bad));
  std::printf("codes (avx512 and avx2): %lld checked, %lld differ from encode_int8(x / s)\n",
              static_cast<long long>(checked_codes), static_cast<long long>(code_bad));
  return quotient_bad == 0 && code_bad == 0 ? 0 : 1;
}
#endif
