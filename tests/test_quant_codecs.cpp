// The fp8 e4m3 and int8 codecs (cpu/quant/codecs.hpp): every code against the
// OCP format's definition, round trips, ties, subnormals, signed zeros,
// saturation, and every vector path bit for bit against the scalar one.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "pagedkv/cpu/quant/codecs.hpp"

namespace {

using pagedkv::KVFormat;
using pagedkv::simd::Isa;
namespace quant = pagedkv::cpu::quant;

/// The value of an e4m3 code, written from the OCP definition (E4M3FN).
double ocp_e4m3(uint8_t code) {
  const int sign = code >> 7;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                                         : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

/// Brute force: the finite code nearest to y, ties to the even code, |y| >= 448 saturating.
uint8_t nearest_e4m3(float y) {
  if (std::isnan(y)) return std::signbit(y) ? 0x80 : 0x00;
  const uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(y));
  uint8_t best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double dc = std::fabs(ocp_e4m3(static_cast<uint8_t>(c)) - a);
    const double db = std::fabs(ocp_e4m3(best) - a);
    if (dc < db || (dc == db && (c & 1) == 0)) best = static_cast<uint8_t>(c);
  }
  return static_cast<uint8_t>(sign | best);
}

/// Every fp16 bit pattern as a float (including infinities, NaNs, subnormals, -0).
std::vector<float> every_fp16() {
  std::vector<float> out;
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    out.push_back(static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits())));
  }
  return out;
}

/// Random float32 bit patterns (every exponent, NaN and infinities included)
/// mixed with random values in the ranges codes live in.
std::vector<float> random_floats(size_t n) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.0f, 200.0f);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = i % 2 == 0 ? quant::bits_float(bits(rng)) : normal(rng);
  return out;
}

TEST(Fp8E4m3, EveryCodeDecodesAsTheOcpFormatSays) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const double expected = ocp_e4m3(code);
    const float got = quant::decode_e4m3(code);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), expected) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
  }
  EXPECT_EQ(quant::decode_e4m3(0x7E), 448.0f);
  EXPECT_EQ(quant::decode_e4m3(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(quant::decode_e4m3(0x08), 0x1p-6f);  // smallest normal
  EXPECT_TRUE(std::signbit(quant::decode_e4m3(0x80)));
}

TEST(Fp8E4m3, EncodeOfDecodeIsTheCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN codes: never produced
    EXPECT_EQ(quant::encode_e4m3(quant::decode_e4m3(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(Fp8E4m3, TiesRoundToEven) {
  EXPECT_EQ(quant::encode_e4m3(1.0625f), 0x38);   // between 1 (0x38) and 1.125 (0x39)
  EXPECT_EQ(quant::encode_e4m3(1.1875f), 0x3A);   // between 1.125 (0x39) and 1.25 (0x3A)
  EXPECT_EQ(quant::encode_e4m3(-1.0625f), 0xB8);
  EXPECT_EQ(quant::encode_e4m3(15.5f), 0x58);     // between 15 (0x57) and 16 (0x58)
  EXPECT_EQ(quant::encode_e4m3(0x1p-10f), 0x00);  // half the smallest subnormal: to 0
  EXPECT_EQ(quant::encode_e4m3(3 * 0x1p-10f), 0x02);  // 1.5 subnormal steps: to 2
  EXPECT_EQ(quant::encode_e4m3(15 * 0x1p-10f), 0x08);  // 7.5 steps: to the smallest normal
  EXPECT_EQ(quant::encode_e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
}

TEST(Fp8E4m3, SaturatesAndNeverGivesNaN) {
  for (float y : {448.0f, 449.0f, 464.0f, 479.9f, 480.0f, 1e30f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::max()}) {
    EXPECT_EQ(quant::encode_e4m3(y), 0x7E) << y;
    EXPECT_EQ(quant::encode_e4m3(-y), 0xFE) << -y;
  }
  EXPECT_EQ(quant::encode_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x00);
  EXPECT_EQ(quant::encode_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0x80);
  EXPECT_EQ(quant::encode_e4m3(0.0f), 0x00);
  EXPECT_EQ(quant::encode_e4m3(-0.0f), 0x80);
  EXPECT_EQ(quant::encode_e4m3(-1e-30f), 0x80);  // underflow keeps the sign
  EXPECT_EQ(quant::encode_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8E4m3, EveryFp16InputRoundsToTheNearestCode) {
  for (const float y : every_fp16()) {
    const uint8_t code = quant::encode_e4m3(y);
    ASSERT_EQ(code, nearest_e4m3(y)) << "y = " << y;
    ASSERT_NE(code & 0x7F, 0x7F) << "NaN code for y = " << y;
  }
}

TEST(Fp8E4m3, RandomFloatsRoundToTheNearestCode) {
  for (const float y : random_floats(200000)) ASSERT_EQ(quant::encode_e4m3(y), nearest_e4m3(y)) << "y = " << y;
}

TEST(Int8, RoundsHalfToEvenAndClamps) {
  EXPECT_EQ(quant::encode_int8(0.5f), 0);
  EXPECT_EQ(quant::encode_int8(1.5f), 2);
  EXPECT_EQ(quant::encode_int8(2.5f), 2);
  EXPECT_EQ(quant::encode_int8(-2.5f), -2);
  EXPECT_EQ(quant::encode_int8(126.6f), 127);
  EXPECT_EQ(quant::encode_int8(127.5f), 127);
  EXPECT_EQ(quant::encode_int8(-200.0f), -127);
  EXPECT_EQ(quant::encode_int8(std::numeric_limits<float>::infinity()), 127);
  EXPECT_EQ(quant::encode_int8(-std::numeric_limits<float>::infinity()), -127);
  EXPECT_EQ(quant::encode_int8(std::numeric_limits<float>::quiet_NaN()), 0);
  for (int c = -127; c <= 127; ++c) {
    EXPECT_EQ(quant::encode_int8(quant::decode_int8(static_cast<int8_t>(c))), c);
  }
}

TEST(QuantizeVector, AllZeroVectorHasScaleZeroAndZeroCodes) {
  const std::vector<float> zeros(64, 0.0f);
  std::vector<uint8_t> fp8(64, 0xAA);
  std::vector<int8_t> i8(64, 5);
  for (const Isa isa : pagedkv::simd::available_isas()) {
    EXPECT_EQ(quant::quantize_vector<KVFormat::fp8_e4m3>(isa, zeros.data(), 64, fp8.data()), 0.0f);
    EXPECT_EQ(quant::quantize_vector<KVFormat::int8>(isa, zeros.data(), 64, i8.data()), 0.0f);
    for (int i = 0; i < 64; ++i) EXPECT_EQ(fp8[static_cast<size_t>(i)], 0);
    for (int i = 0; i < 64; ++i) EXPECT_EQ(i8[static_cast<size_t>(i)], 0);
  }
}

TEST(QuantizeVector, AmaxMapsOntoTheLargestCode) {
  const std::vector<float> x{0.5f, -3.0f, 1.25f, 2.0f};
  std::vector<uint8_t> fp8(4);
  std::vector<int8_t> i8(4);
  const float s8 = quant::quantize_vector<KVFormat::fp8_e4m3>(Isa::portable, x.data(), 4, fp8.data());
  EXPECT_EQ(s8, 3.0f / 448.0f);
  EXPECT_EQ(fp8[1], 0xFE);
  const float si = quant::quantize_vector<KVFormat::int8>(Isa::portable, x.data(), 4, i8.data());
  EXPECT_EQ(si, 3.0f / 127.0f);
  EXPECT_EQ(i8[1], -127);
}

/// Each of `isas` gives the scalar functions' codes and values, bit for bit.
template <KVFormat F>
void expect_paths_match_scalar(const std::vector<float>& x, float scale,
                               const std::vector<Isa>& isas = pagedkv::simd::available_isas()) {
  using Code = typename quant::Codec<F>::Code;
  const auto n = static_cast<int64_t>(x.size());
  std::vector<Code> scalar(x.size());
  for (size_t i = 0; i < x.size(); ++i) scalar[i] = quant::Codec<F>::encode(x[i] / scale);
  std::vector<float> decoded(x.size());
  for (size_t i = 0; i < x.size(); ++i) decoded[i] = quant::Codec<F>::decode(scalar[i]) * scale;
  for (const Isa isa : isas) {
    std::vector<Code> codes(x.size());
    quant::encode_row<F>(isa, x.data(), n, scale, codes.data());
    std::vector<float> values(x.size());
    quant::decode_row<F>(isa, codes.data(), n, scale, values.data());
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(codes[i], scalar[i]) << pagedkv::simd::isa_name(isa) << " x = " << x[i];
      ASSERT_EQ(quant::float_bits(values[i]), quant::float_bits(decoded[i]))
          << pagedkv::simd::isa_name(isa) << " code " << static_cast<int>(codes[i]);
    }
  }
}

TEST(VectorPaths, BitIdenticalOnEveryFp16Input) {
  std::cout << "paths:";
  for (const Isa isa : pagedkv::simd::available_isas())
    std::cout << ' ' << pagedkv::simd::isa_name(isa);
  std::cout << '\n';
  const std::vector<float> x = every_fp16();
  for (const float scale : {1.0f, 0.37f, 3e-3f}) {
    expect_paths_match_scalar<KVFormat::fp8_e4m3>(x, scale);
    expect_paths_match_scalar<KVFormat::int8>(x, scale);
  }
}

// fp8's vector encoders (AVX-512 and AVX2) divide by scale / 2^8, exact
// only for scales of 2^-118 and up (quant::e4m3_divisor_is_exact); below,
// their rows take the scalar loop. Inputs scaled down with the scales, so
// the codes still vary.
TEST(VectorPaths, BitIdenticalAtScalesNearTwoToTheMinus118) {
  std::vector<float> x = every_fp16();
  for (float& v : x) v *= 0x1p-120f;
  for (const float scale : {0.37f * 0x1p-120f, 3e-3f * 0x1p-120f, 0.999f * 0x1p-118f, 0x1p-118f, 1.37f * 0x1p-118f}) {
    expect_paths_match_scalar<KVFormat::fp8_e4m3>(x, scale);
    expect_paths_match_scalar<KVFormat::int8>(x, scale);
  }
}

TEST(VectorPaths, BitIdenticalOnTenMillionRandomFloats) {
  const std::vector<float> x = random_floats(10000000);
  expect_paths_match_scalar<KVFormat::fp8_e4m3>(x, 1.0f);
  expect_paths_match_scalar<KVFormat::int8>(x, 0.125f);
}

/// quantize_vector on each of `isas` against the scalar reference (amax in
/// order, then the scalar encode of x / scale), over vectors of awkward lengths.
template <KVFormat F>
void expect_quantize_matches_scalar(const std::vector<Isa>& isas) {
  using Code = typename quant::Codec<F>::Code;
  const std::vector<float> x = random_floats(1 << 16);
  for (const int64_t n : {1, 7, 8, 9, 15, 16, 17, 64, 128, 131}) {
    for (size_t start = 0; start + static_cast<size_t>(n) <= x.size(); start += 4099) {
      std::vector<Code> want(static_cast<size_t>(n));
      float amax = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        const float a = std::fabs(x[start + static_cast<size_t>(i)]);
        amax = a > amax ? a : amax;
      }
      const float scale = quant::scale_for(amax, F);
      for (int64_t i = 0; i < n; ++i) {
        want[static_cast<size_t>(i)] =
            scale > 0.0f ? quant::Codec<F>::encode(x[start + static_cast<size_t>(i)] / scale) : Code{0};
      }
      for (const Isa isa : isas) {
        std::vector<Code> got(static_cast<size_t>(n));
        const float s = quant::quantize_vector<F>(isa, x.data() + start, n, got.data());
        ASSERT_EQ(quant::float_bits(s), quant::float_bits(scale)) << pagedkv::simd::isa_name(isa);
        ASSERT_EQ(got, want) << pagedkv::simd::isa_name(isa) << " n " << n;
      }
    }
  }
}

TEST(VectorPaths, QuantizeVectorAgreesOnEveryPath) {
  expect_quantize_matches_scalar<KVFormat::fp8_e4m3>(pagedkv::simd::available_isas());
  expect_quantize_matches_scalar<KVFormat::int8>(pagedkv::simd::available_isas());
}

/// quantize_rows straight from T (fp16 or bf16: every bit pattern, laid out
/// as rows of n, strided, in groups of every size) on each of `isas`: the
/// scalar reference on the widened floats, codes and scales bit for bit.
template <KVFormat F, class T>
void expect_rows_from_dtype_match_scalar(const std::vector<Isa>& isas) {
  using Code = typename quant::Codec<F>::Code;
  std::vector<T> every(1 << 16);
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) every[bits] = T(static_cast<uint16_t>(bits), T::from_bits());
  for (const int64_t n : {7, 16, 24, 128, 131}) {
    for (const int64_t count : {1, 3, 4, 5, 8, 9}) {
      const int64_t x_stride = n + 5, out_stride = n + 3, scale_stride = 2;
      for (int64_t first = 0; first + count * x_stride <= static_cast<int64_t>(every.size());
           first += count * x_stride * 7 + 1) {
        const T* x = every.data() + first;
        std::vector<Code> want(static_cast<size_t>(count * out_stride), Code{1});
        std::vector<float> want_scales(static_cast<size_t>(count * scale_stride), -1.0f);
        for (int64_t r = 0; r < count; ++r) {
          std::vector<float> widened(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) widened[static_cast<size_t>(i)] = static_cast<float>(x[r * x_stride + i]);
          want_scales[static_cast<size_t>(r * scale_stride)] =
              quant::quantize_loop<F>(widened.data(), n, want.data() + r * out_stride);
        }
        for (const Isa isa : isas) {
          std::vector<Code> got(want.size(), Code{1});
          std::vector<float> got_scales(want_scales.size(), -1.0f);
          quant::quantize_rows<F>(isa, x, x_stride, count, n, got.data(), out_stride, got_scales.data(), scale_stride);
          ASSERT_EQ(got, want) << pagedkv::simd::isa_name(isa) << " n " << n << " count " << count
                               << " first " << first;
          for (size_t i = 0; i < got_scales.size(); ++i)
            ASSERT_EQ(quant::float_bits(got_scales[i]), quant::float_bits(want_scales[i]))
                << pagedkv::simd::isa_name(isa) << " n " << n << " count " << count;
        }
      }
    }
  }
}

TEST(VectorPaths, QuantizeRowsFromFp16AndBf16AgreeOnEveryPath) {
  const std::vector<Isa> isas = pagedkv::simd::available_isas();
  expect_rows_from_dtype_match_scalar<KVFormat::fp8_e4m3, c10::Half>(isas);
  expect_rows_from_dtype_match_scalar<KVFormat::int8, c10::Half>(isas);
  expect_rows_from_dtype_match_scalar<KVFormat::fp8_e4m3, c10::BFloat16>(isas);
  expect_rows_from_dtype_match_scalar<KVFormat::int8, c10::BFloat16>(isas);
}

/// decode_row on each of `isas` gives decode_e4m3 / decode_int8 of every code, bit for bit.
void expect_every_code_decodes_identically(const std::vector<Isa>& isas) {
  std::vector<uint8_t> fp8(256);
  std::vector<int8_t> i8(256);
  for (int c = 0; c < 256; ++c) {
    fp8[static_cast<size_t>(c)] = static_cast<uint8_t>(c);
    i8[static_cast<size_t>(c)] = static_cast<int8_t>(static_cast<uint8_t>(c));
  }
  for (const Isa isa : isas) {
    std::vector<float> out(256);
    quant::decode_row<KVFormat::fp8_e4m3>(isa, fp8.data(), 256, 1.0f, out.data());
    for (int c = 0; c < 256; ++c) {
      const float want = quant::decode_e4m3(static_cast<uint8_t>(c));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out[static_cast<size_t>(c)])) << pagedkv::simd::isa_name(isa);
      } else {
        EXPECT_EQ(quant::float_bits(out[static_cast<size_t>(c)]), quant::float_bits(want))
            << pagedkv::simd::isa_name(isa) << " code " << c;
      }
    }
    quant::decode_row<KVFormat::int8>(isa, i8.data(), 256, 1.0f, out.data());
    for (int c = 0; c < 256; ++c)
      EXPECT_EQ(out[static_cast<size_t>(c)], static_cast<float>(i8[static_cast<size_t>(c)]))
          << pagedkv::simd::isa_name(isa) << " code " << c;
  }
}

/// dequantize_row on each path: decode_row then narrow_row of the portable
/// path, bit for bit, for every code, into T, at scales that round, underflow and overflow.
template <KVFormat F, class T>
void expect_dequantize_matches_decode_then_narrow() {
  using Code = typename quant::Codec<F>::Code;
  std::vector<Code> codes;
  for (int rep = 0; rep < 3; ++rep)
    for (int c = 0; c < 256; ++c) codes.push_back(static_cast<Code>(static_cast<uint8_t>(c * 37 + rep)));
  for (const int64_t n : {int64_t{5}, int64_t{128}, static_cast<int64_t>(codes.size())}) {
    // 1 + 2^-8 and 1 + 3 x 2^-8: exact ties for bf16 (half-way low bits) on every power-of-two code;
    // 3e37: fp8 scale x 2^8 overflows (the vector paths fall back to the scalar loop).
    for (const float scale : {1.0f, 0.37f, 3e-3f, 1e-40f, 1e30f, 3e37f, 0.0f, 1.00390625f, 1.01171875f}) {
      std::vector<float> buf(static_cast<size_t>(n));
      quant::decode_row<F>(Isa::portable, codes.data(), n, scale, buf.data());
      std::vector<T> want(static_cast<size_t>(n));
      quant::narrow_row<T>(Isa::portable, buf.data(), n, want.data());
      for (const Isa isa : pagedkv::simd::available_isas()) {
        std::vector<T> got(static_cast<size_t>(n));
        quant::dequantize_row<F>(isa, codes.data(), n, scale, got.data(), buf.data());
        for (int64_t i = 0; i < n; ++i) {
          const float w = static_cast<float>(want[static_cast<size_t>(i)]);
          const float o = static_cast<float>(got[static_cast<size_t>(i)]);
          if (std::isnan(w)) {  // F16C keeps a NaN's payload bits, c10 does not: NaN either way
            ASSERT_TRUE(std::isnan(o)) << pagedkv::simd::isa_name(isa);
            continue;
          }
          ASSERT_EQ(quant::float_bits(o), quant::float_bits(w))
              << pagedkv::simd::isa_name(isa) << " code " << static_cast<int>(codes[static_cast<size_t>(i)])
              << " scale " << scale;
        }
      }
    }
  }
}

/// quantize_rows from fp16 / bf16 rows of random bit patterns of one kind
/// (finite, with a NaN, with an infinity, subnormal, signed zeros) on each
/// of `isas` against quantize_loop of the widened floats. The AVX2 amax
/// reads these rows' bits (amax_bits16_avx2): the largest magnitude may sit
/// anywhere, in the 32-, the 16- or the scalar tail loop, and a NaN sends a
/// row to the widening loop.
template <KVFormat F, class T>
void expect_random_rows_match_scalar(const std::vector<Isa>& isas) {
  using Code = typename quant::Codec<F>::Code;
  const uint16_t infinity = std::is_same<T, c10::Half>::value ? 0x7C00 : 0x7F80;
  std::mt19937 rng(29);
  const auto finite_bits = [&] {
    for (;;) {
      const auto b = static_cast<uint16_t>(rng());
      if ((b & 0x7FFF) < infinity) return b;
    }
  };
  for (const int64_t n : {1, 15, 16, 17, 31, 32, 33, 48, 128, 131}) {
    for (int kind = 0; kind < 5; ++kind) {
      for (int trial = 0; trial < 200; ++trial) {
        std::vector<T> x(static_cast<size_t>(n));
        for (T& v : x) {
          const uint16_t sign = rng() & 0x8000;
          const uint16_t bits = kind == 3 ? static_cast<uint16_t>(sign | (rng() & 0x7F))  // subnormal or zero
                                : kind == 4 ? sign                                       // +-0
                                            : finite_bits();
          v = T(bits, T::from_bits());
        }
        const auto at = static_cast<size_t>(rng() % static_cast<uint32_t>(n));
        const auto nan_bits = static_cast<uint16_t>((rng() & 0x8000) | (infinity + 1 + rng() % 0x7F));
        if (kind == 1) x[at] = T(nan_bits, T::from_bits());
        if (kind == 2) x[at] = T(static_cast<uint16_t>((rng() & 0x8000) | infinity), T::from_bits());
        std::vector<float> widened(x.size());
        for (size_t i = 0; i < x.size(); ++i) widened[i] = static_cast<float>(x[i]);
        std::vector<Code> want(x.size());
        const float want_scale = quant::quantize_loop<F>(widened.data(), n, want.data());
        for (const Isa isa : isas) {
          std::vector<Code> got(x.size(), Code{1});
          float got_scale = -1.0f;
          quant::quantize_rows<F>(isa, x.data(), n, 1, n, got.data(), n, &got_scale, 1);
          ASSERT_EQ(quant::float_bits(got_scale), quant::float_bits(want_scale))
              << pagedkv::simd::isa_name(isa) << " n " << n << " kind " << kind << " trial " << trial;
          ASSERT_EQ(got, want) << pagedkv::simd::isa_name(isa) << " n " << n << " kind " << kind;
        }
      }
    }
  }
}

TEST(VectorPaths, QuantizeRowsOfRandomFp16AndBf16BitsAgreeOnEveryPath) {
  const std::vector<Isa> isas = pagedkv::simd::available_isas();
  expect_random_rows_match_scalar<KVFormat::fp8_e4m3, c10::Half>(isas);
  expect_random_rows_match_scalar<KVFormat::int8, c10::Half>(isas);
  expect_random_rows_match_scalar<KVFormat::fp8_e4m3, c10::BFloat16>(isas);
  expect_random_rows_match_scalar<KVFormat::int8, c10::BFloat16>(isas);
}

// AVX-512 int8 rows whose scale lies in [2^-100, 2^100]
// (quant::int8_quotient_by_reciprocal_is_exact) divide by multiplying with
// the reciprocal and one correction (Markstein); others divide. Rows of
// every fp16 value, scaled so that their scales sit on either side of both
// bounds and far outside them (2^-140 is a subnormal scale, whose
// reciprocal overflows): codes and scales as the scalar loop's on every
// path, NaN and infinite inputs included.
TEST(VectorPaths, Int8RowsAtAndBeyondTheBoundsOfTheReciprocalPath) {
  std::vector<float> every;
  for (const float v : every_fp16())
    if (!std::isinf(v)) every.push_back(v / 65504.0f);  // |v| <= 1, NaN kept
  const auto n = static_cast<int64_t>(every.size());
  for (const float target : {0x1p-140f, 0x1p-125f, 0x1p-110f, 0.999f * 0x1p-100f, 0x1p-100f, 1.001f * 0x1p-100f, 0.37f,
                             0.999f * 0x1p100f, 0x1p100f, 1.001f * 0x1p100f, 0x1p120f}) {
    std::vector<float> x(every);
    const float amax = target * quant::kInt8Max;
    for (float& v : x) v *= amax;
    std::vector<int8_t> want(x.size());
    const float want_scale = quant::quantize_loop<KVFormat::int8>(x.data(), n, want.data());
    for (const Isa isa : pagedkv::simd::available_isas()) {
      std::vector<int8_t> got(x.size(), int8_t{1});
      float got_scale = -1.0f;
      quant::quantize_rows<KVFormat::int8>(isa, x.data(), n, 1, n, got.data(), n, &got_scale, 1);
      ASSERT_EQ(quant::float_bits(got_scale), quant::float_bits(want_scale))
          << pagedkv::simd::isa_name(isa) << " target scale " << target;
      ASSERT_EQ(got, want) << pagedkv::simd::isa_name(isa) << " target scale " << target;
    }
  }
}

TEST(VectorPaths, DequantizeRowIsDecodeThenNarrowOnEveryPath) {
  expect_dequantize_matches_decode_then_narrow<KVFormat::fp8_e4m3, c10::Half>();
  expect_dequantize_matches_decode_then_narrow<KVFormat::fp8_e4m3, c10::BFloat16>();
  expect_dequantize_matches_decode_then_narrow<KVFormat::fp8_e4m3, float>();
  expect_dequantize_matches_decode_then_narrow<KVFormat::int8, c10::Half>();
  expect_dequantize_matches_decode_then_narrow<KVFormat::int8, c10::BFloat16>();
  expect_dequantize_matches_decode_then_narrow<KVFormat::int8, float>();
}

TEST(VectorPaths, EveryCodeDecodesIdentically) {
  expect_every_code_decodes_identically(pagedkv::simd::available_isas());
}

// The AVX2 path by name: on an AVX-512 machine the best path is AVX-512, so
// without these an AVX2 regression would only show in available_isas()'s
// loop above; here a CPU without AVX2 reports a skip, not a pass.
const std::vector<Isa> kAvx2{Isa::avx2};

TEST(Avx2Path, BitIdenticalOnEveryFp16Input) {
  if (!pagedkv::simd::cpu_has_avx2()) GTEST_SKIP() << "this CPU (or build) has no AVX2/FMA/F16C";
  const std::vector<float> x = every_fp16();
  for (const float scale : {1.0f, 0.37f, 3e-3f}) {
    expect_paths_match_scalar<KVFormat::fp8_e4m3>(x, scale, kAvx2);
    expect_paths_match_scalar<KVFormat::int8>(x, scale, kAvx2);
  }
}

TEST(Avx2Path, BitIdenticalOnTenMillionRandomFloats) {
  if (!pagedkv::simd::cpu_has_avx2()) GTEST_SKIP() << "this CPU (or build) has no AVX2/FMA/F16C";
  const std::vector<float> x = random_floats(10000000);
  expect_paths_match_scalar<KVFormat::fp8_e4m3>(x, 1.0f, kAvx2);
  expect_paths_match_scalar<KVFormat::int8>(x, 0.125f, kAvx2);
}

TEST(Avx2Path, QuantizeVectorMatchesScalar) {
  if (!pagedkv::simd::cpu_has_avx2()) GTEST_SKIP() << "this CPU (or build) has no AVX2/FMA/F16C";
  expect_quantize_matches_scalar<KVFormat::fp8_e4m3>(kAvx2);
  expect_quantize_matches_scalar<KVFormat::int8>(kAvx2);
}

TEST(Avx2Path, EveryCodeDecodesIdentically) {
  if (!pagedkv::simd::cpu_has_avx2()) GTEST_SKIP() << "this CPU (or build) has no AVX2/FMA/F16C";
  expect_every_code_decodes_identically(kAvx2);
}

/// The dtype conversions of every path give c10's own, bit for bit.
template <class T>
void expect_conversions_match_c10(const std::vector<float>& x) {
  const auto n = static_cast<int64_t>(x.size());
  std::vector<T> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = static_cast<T>(x[i]);
  std::vector<float> widened_want(x.size());
  for (size_t i = 0; i < x.size(); ++i) widened_want[i] = static_cast<float>(want[i]);
  for (const Isa isa : pagedkv::simd::available_isas()) {
    std::vector<T> narrowed(x.size());
    quant::narrow_row<T>(isa, x.data(), n, narrowed.data());
    std::vector<float> widened(x.size());
    quant::widen_row<T>(isa, want.data(), n, widened.data());
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(x[i])) {  // F16C keeps a NaN's payload bits, c10 does not: NaN either way
        ASSERT_TRUE(std::isnan(static_cast<float>(narrowed[i]))) << pagedkv::simd::isa_name(isa);
        continue;
      }
      ASSERT_EQ(narrowed[i].x, want[i].x) << pagedkv::simd::isa_name(isa) << " x = " << x[i];
      ASSERT_EQ(quant::float_bits(widened[i]), quant::float_bits(widened_want[i]))
          << pagedkv::simd::isa_name(isa) << " bits " << want[i].x;
    }
  }
}

TEST(VectorPaths, DtypeConversionsMatchC10) {
  std::vector<float> x = random_floats(1000000);
  const std::vector<float> halves = every_fp16();
  x.insert(x.end(), halves.begin(), halves.end());
  for (const float h : halves) x.push_back(h * (1.0f + 0x1p-12f));  // between two fp16 values
  expect_conversions_match_c10<c10::Half>(x);
  expect_conversions_match_c10<c10::BFloat16>(x);
}

}  // namespace
