// The device-agnostic (ATen) write and gather of caches with quantized
// pages: the arithmetic of the CPU codecs in ATen ops (clamping before every
// cast, since ATen casts do not saturate), giving identical codes and
// scales. What a quantized cache on a device without hand-written kernels
// runs, and what ScopedBackend(Backend::generic) forces on the CPU. Callers
// validate first.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "pagedkv/cpu/quant/scalar.hpp"  // the codes' definition: format_max, kFp8Max, kInt8Max
#include "pagedkv/generic/write_gather.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace generic {

/// The scales of head vectors x [N, D] (float32): the same float32 division
/// as scale_for (a tensor divisor: a scalar one may become a multiply by its
/// reciprocal on some devices).
inline at::Tensor scales_of(const at::Tensor& xf, KVFormat f) {
  const at::Tensor amax = xf.abs().amax(-1, /*keepdim=*/true);  // [N, 1]
  return amax / at::full_like(amax, cpu::quant::format_max(f));
}

/// Codes of y = x / scale (float32), exactly as cpu::quant::encode_e4m3 /
/// encode_int8 compute them; rows with scale 0 get zero codes.
inline at::Tensor encode_generic(const at::Tensor& xf,     // [N, D] float32
                                 const at::Tensor& scale,  // [N, 1] float32
                                 KVFormat f) {
  const at::Tensor zero_rows = scale.le(0);  // [N, 1]
  const at::Tensor y = xf / scale;
  if (f == KVFormat::int8) {
    at::Tensor r = at::round(y).clamp_(-cpu::quant::kInt8Max, cpu::quant::kInt8Max);  // round: half to even
    r.masked_fill_(at::isnan(r), 0);
    r.masked_fill_(zero_rows, 0);
    return r.to(at::kChar);
  }
  const at::Tensor a = y.abs();
  const at::Tensor abs_bits = a.view(at::kInt);  // non-negative
  const at::Tensor rounded = (abs_bits + 0x7FFFF + abs_bits.bitwise_and(1 << 20).ne(0).to(at::kInt)).div(
      1 << 20, "floor");
  const at::Tensor normal = rounded - (120 << 3);
  const at::Tensor subnormal = at::round(a.clamp_max(0x1p-6f) * 512.0f).to(at::kInt);
  at::Tensor magnitude = at::where(a.lt(0x1p-6f), subnormal, normal);
  magnitude.masked_fill_(a.ge(cpu::quant::kFp8Max), 0x7E);
  magnitude.masked_fill_(at::isnan(a), 0);
  at::Tensor code = magnitude + at::signbit(y).to(at::kInt) * 0x80;
  code.masked_fill_(zero_rows, 0);
  return code.to(at::kByte);
}

/// decode(codes) * scales in float32, exactly as cpu::quant::decode_row.
inline at::Tensor decode_generic(const at::Tensor& codes,   // [..., D] kByte / kChar
                                 const at::Tensor& scales,  // [..., 1] float32
                                 KVFormat f) {
  if (f == KVFormat::int8) return codes.to(at::kFloat) * scales;
  const at::Tensor c = codes.to(at::kInt);
  const at::Tensor magnitude = (c.bitwise_and(0x7F) * (1 << 20)).view(at::kFloat) * 0x1p120f;
  at::Tensor value = at::where(c.bitwise_and(0x80).ne(0), -magnitude, magnitude);
  value.masked_fill_(c.bitwise_and(0x7F).eq(0x7F), std::numeric_limits<float>::quiet_NaN());
  return value * scales;
}

/// Device-agnostic write of one side: head rows indexed as in
/// generic::write_generic; a quantized side gets its codes and scales.
template <class Index>
void write_side_generic(const PageTableRef<Index>& table, const std::vector<int64_t>& starts, int64_t n_tokens,
                        const at::Tensor& x,       // [B, S, H, D], the logical dtype
                        KVFormat format,
                        const at::Tensor& layer,   // [n_pages, <page>]
                        const at::Tensor& scales,  // [n_pages, page_size * H]; undefined for native
                        const PageGeometry& g) {
  if (n_tokens == 0 || table.rows == 0) return;
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(table.rows * n_tokens * g.n_heads));
  for (int64_t b = 0; b < table.rows; ++b) {
    for (int64_t s = 0; s < n_tokens; ++s) {
      const int64_t pos = starts[static_cast<size_t>(b)] + s;
      const int64_t page = table(b, pos / g.page_size);
      for (int64_t h = 0; h < g.n_heads; ++h) rows.push_back(generic::head_row(g, page, pos % g.page_size, h));
    }
  }
  const at::Tensor index = generic::host_index(rows, layer.device());
  const at::Tensor flat = x.reshape({-1, g.head_dim});
  if (!is_quantized(format)) {
    layer.view({-1, g.head_dim}).index_copy_(0, index, flat);
    return;
  }
  const at::Tensor xf = flat.to(at::kFloat);
  const at::Tensor scale = scales_of(xf, format);
  layer.view({-1, g.head_dim}).index_copy_(0, index, encode_generic(xf, scale, format));
  scales.view({-1}).index_copy_(0, index, scale.view({-1}));
}

/// Device-agnostic gather of one side into [B, T, H, D] of `dtype`.
template <class Index>
at::Tensor gather_side_generic(const PageTableRef<Index>& table, const std::vector<int64_t>& lengths,
                               int64_t n_tokens, KVFormat format,
                               const at::Tensor& layer,   // [n_pages, <page>]
                               const at::Tensor& scales,  // [n_pages, page_size * H]; undefined for native
                               const PageGeometry& g, at::ScalarType dtype) {
  if (!is_quantized(format)) return generic::gather_generic(table, lengths, n_tokens, layer, layer, g).first;
  // Masked positions read codes 0 and scale 0: zeros.
  const at::Tensor codes = generic::gather_generic(table, lengths, n_tokens, layer, layer, g).first;  // [B, T, H, D]
  const at::Tensor s = generic::gather_generic(table, lengths, n_tokens, scales, scales, scale_geometry(g)).first;
  return decode_generic(codes, s, format).to(dtype);
}

}  // namespace generic
}  // namespace pagedkv
