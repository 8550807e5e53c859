// The codecs of quantized pages, row by row, on the instruction set the
// caller selected (the attention kernel's Isa): encode, decode, quantize
// (the amax, scale and codes of each head vector), dequantize into the
// logical dtype, and fp16 / bf16 <-> float32 rows.
//
// The codecs themselves are defined once, as scalar functions, in
// cpu/quant/scalar.hpp (also the portable path); cpu/quant/isa_avx2.hpp and
// cpu/quant/isa_avx512.hpp compute the same results 8 or 16 elements at a time.
// The functions here choose the path. Every path gives the same bits
// (tests: every fp16 input and 10^7 random floats;
// bench/tools/encoder_exhaustive: every float32). The vector paths quantize
// straight from the logical dtype (fp16 / bf16 / float32) and dequantize
// straight into it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "pagedkv/cpu/quant/isa_avx2.hpp"
#include "pagedkv/cpu/quant/isa_avx512.hpp"
#include "pagedkv/cpu/quant/scalar.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/simd/isa.hpp"

namespace pagedkv {
namespace cpu {
namespace quant {

using simd::Isa;

/// out[i] = encode(x[i] / scale) on instruction set `isa` (the caller's
/// selected_isa()); scale 0 (an all-zero vector) gives all-zero codes.
template <KVFormat F>
inline void encode_row(simd::Isa isa, const float* x,  // [n]
                       int64_t n, float scale, typename Codec<F>::Code* out) {  // out: [n]
  if (!(scale > 0.0f)) {
    std::fill(out, out + n, typename Codec<F>::Code{0});
    return;
  }
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case simd::Isa::avx512: return encode_avx512<F>(x, n, scale, out);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case simd::Isa::avx2: return encode_avx2<F>(x, n, scale, out);
#endif
    default: return encode_loop<F>(x, n, scale, out);
  }
}

/// out[i] = decode(codes[i]) * scale on instruction set `isa`.
template <KVFormat F>
inline void decode_row(simd::Isa isa, const typename Codec<F>::Code* codes,  // [n]
                       int64_t n, float scale, float* out) {            // out: [n]
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case simd::Isa::avx512: return dequantize_avx512<F>(codes, n, scale, out);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case simd::Isa::avx2: return dequantize_avx2<F>(codes, n, scale, out);
#endif
    default: return decode_loop<F>(codes, n, scale, out);
  }
}

/// Quantizes `count` head vectors of float32, fp16 or bf16 (each
/// contiguous, `x_stride` elements apart): amax, scale and codes of each,
/// codes `out_stride` apart, scales `scale_stride` apart. The vector paths
/// widen as they load, twice (amax, then the codes), which is cheaper than
/// staging floats.
template <KVFormat F, class T>
inline void quantize_rows(simd::Isa isa, const T* x,  // count x [n]
                          int64_t x_stride, int64_t count, int64_t n,
                          typename Codec<F>::Code* out,  // count x [n]
                          int64_t out_stride,
                          float* scales,  // [count]
                          int64_t scale_stride) {
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case simd::Isa::avx512: return quantize_rows_avx512<F>(x, x_stride, count, n, out, out_stride, scales, scale_stride);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case simd::Isa::avx2: return quantize_rows_avx2<F>(x, x_stride, count, n, out, out_stride, scales, scale_stride);
#endif
    default:
      for (int64_t r = 0; r < count; ++r)
        scales[r * scale_stride] = quantize_loop<F>(x + r * x_stride, n, out + r * out_stride);
  }
}

/// Quantizes one head vector (contiguous): its amax, scale and codes. Returns the scale.
template <KVFormat F, class T>
inline float quantize_vector(simd::Isa isa, const T* x,  // [n]
                             int64_t n, typename Codec<F>::Code* out) {  // out: [n]
  float scale = 0.0f;
  quantize_rows<F>(isa, x, n, 1, n, out, n, &scale, 1);
  return scale;
}

/// out[i] = float(src[i]) (exact) on instruction set `isa`, contiguous src.
template <class T>
inline void widen_row(simd::Isa isa, const T* src, int64_t n, float* out) {  // src, out: [n]
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case simd::Isa::avx512: return widen_avx512(src, n, out);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case simd::Isa::avx2: return widen_avx2(src, n, out);
#endif
    default: return widen_loop(src, n, out);
  }
}

/// out[i] = T(x[i]) (round to nearest even, as c10's conversions) on `isa`.
template <class T>
inline void narrow_row(simd::Isa isa, const float* x, int64_t n, T* out) {  // x, out: [n]
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case simd::Isa::avx512: return narrow_avx512(x, n, out);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case simd::Isa::avx2: return narrow_avx2(x, n, out);
#endif
    default: return narrow_loop(x, n, out);
  }
}

/// Whether a row of n elements at `out` is whole 64-byte lines, which
/// streaming stores can write without a partial line.
template <class T>
inline bool streams_row(const T* out, int64_t n) noexcept {
  constexpr uintptr_t kLine = 64;
  return ((reinterpret_cast<uintptr_t>(out) | static_cast<uintptr_t>(n) * sizeof(T)) & (kLine - 1)) == 0;
}

/// out[i] = T(decode(codes[i]) * scale): decode_row then narrow_row, bit
/// for bit; the vector paths do it in one pass, the portable one through
/// `buf`. `stream`: the vector paths write a row of whole 64-byte lines
/// (streams_row) with streaming stores, which the caller orders with a
/// fence (cpu::streaming_fence) before the output is read.
template <KVFormat F, class T>
inline void dequantize_row(simd::Isa isa, const typename Codec<F>::Code* codes,  // [n]
                           int64_t n, float scale,
                           T* out,      // [n]
                           float* buf,  // [n]
                           bool stream = false) {
  const bool streamed = stream && streams_row(out, n);
#ifdef PAGEDKV_ATTENTION_AVX512
  if (isa == simd::Isa::avx512) {
    return streamed ? dequantize_avx512<F, T, true>(codes, n, scale, out) : dequantize_avx512<F>(codes, n, scale, out);
  }
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
  if (isa == simd::Isa::avx2) {
    return streamed ? dequantize_avx2<F, T, true>(codes, n, scale, out) : dequantize_avx2<F>(codes, n, scale, out);
  }
#else
  (void)streamed;
#endif
  decode_row<F>(isa, codes, n, scale, buf);
  narrow_row<T>(isa, buf, n, out);
}

/// Elements of T to float32 (exact for the dtypes a cache holds), any element stride.
template <class T>
inline void to_float(simd::Isa isa, const char* src, int64_t elem_stride_bytes, int64_t n, float* out) {  // out: [n]
  if (elem_stride_bytes == static_cast<int64_t>(sizeof(T))) {
    widen_row(isa, reinterpret_cast<const T*>(src), n, out);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    T value;
    std::memcpy(&value, src + i * elem_stride_bytes, sizeof(T));
    out[i] = static_cast<float>(value);
  }
}

}  // namespace quant
}  // namespace cpu
}  // namespace pagedkv
