// docs/quantization.md: fp8 e4m3 keys and int8 values; the error bounds the
// page states, checked on these tokens; the storage; torch's float8 view.
#include <pagedkv/pagedkv.hpp>

#include <cmath>

#include "samples.hpp"

namespace docs {
namespace {

/// Whether |x - x'| <= rel * |x| + abs_of_scale * scale per element, with x
/// [1, T, H, D] float32 and the scale of each (token, head) amax / code_max.
bool within(const at::Tensor& x, const at::Tensor& decoded, double code_max, double rel, double abs_of_scale) {
  const at::Tensor scale = std::get<0>(x.abs().max(-1, /*keepdim=*/true)) / code_max;  // [1, T, H, 1]
  const at::Tensor bound = x.abs() * rel + scale * abs_of_scale;
  return (x - decoded.to(at::kFloat)).abs().le(bound * (1 + 1e-6)).all().item<bool>();
}

}  // namespace

void quantization_sample() {
  //! [create]
  using pagedkv::KVFormat;
  // fp16 in and out; K stored as fp8 e4m3 codes, V as int8 codes, each with a float32 scale per (token, head).
  pagedkv::PagedCache<pagedkv::NHD> cache(/*n_layers=*/2, /*n_pages=*/64, /*page_size=*/16, /*n_kv_heads=*/8,
                                          /*head_dim=*/128, at::TensorOptions().dtype(at::kHalf),
                                          pagedkv::KVQuant{/*k=*/KVFormat::fp8_e4m3, /*v=*/KVFormat::int8});
  //! [create]
  at::Tensor page_table = at::tensor(cache.alloc_n(4), at::kInt).view({1, 4});
  at::Tensor lengths = at::tensor({50}, at::kLong);
  const int64_t layer = 1;
  at::Tensor k = at::randn({1, 50, 8, 128}).to(at::kHalf);
  k.select(3, 7).mul_(50);  // an outlier channel, as keys have
  const at::Tensor v = at::randn({1, 50, 8, 128}).to(at::kHalf);
  const at::Tensor q = at::randn({1, 1, 32, 128}).to(at::kHalf);

  //! [use]
  // Nothing else changes: write takes fp16, gather returns fp16, attention reads the codes in place.
  const auto view = cache.bind(page_table, lengths);
  view.write(layer, /*start_pos=*/0, k, v);                   // quantized inside the kernel
  auto [keys, values] = view.gather(layer);                    // dequantized: [1, 50, 8, 128] fp16
  at::Tensor out = pagedkv::paged_attention(view, layer, q);  // [1, 1, 32, 128]
  //! [use]
  expect(keys.scalar_type() == at::kHalf && out.sizes() == q.sizes(), "fp16 in and out");
  // The bounds of docs/quantization.md, plus the rounding of the result to fp16 (2^-11 relative, 2^-10 with margin).
  expect(within(k.to(at::kFloat), keys, 448, std::ldexp(1.0, -4) + std::ldexp(1.0, -10), std::ldexp(1.0, -10)),
         "fp8: |x - x'| <= 2^-4 |x| + 2^-10 scale");
  expect(within(v.to(at::kFloat), values, 127, std::ldexp(1.0, -10), 0.5), "int8: |x - x'| <= scale / 2");

  //! [storage]
  at::ScalarType k_codes = cache.k_cache().scalar_type();  // at::kByte: fp8 e4m3 bit patterns
  at::ScalarType v_codes = cache.v_cache().scalar_type();  // at::kChar: int8 in [-127, 127]
  at::IntArrayRef scales = cache.k_scales().sizes();       // [n_layers, n_pages, page_size * n_kv_heads] float32
  pagedkv::KVQuant how = cache.quant();                    // {fp8_e4m3, int8}
  //! [storage]
  expect(k_codes == at::kByte && v_codes == at::kChar, "one byte per element");
  expect(scales == at::IntArrayRef({2, 64, 16 * 8}) && cache.k_scales().scalar_type() == at::kFloat,
         "one float32 scale per (token, head)");
  expect(how.k == KVFormat::fp8_e4m3 && how.v == KVFormat::int8, "quant() as constructed");

#if PAGEDKV_HAS_TORCH_FLOAT8
  //! [float8]
  // torch 2.1 and later: the fp8 codes as torch's float8_e4m3fn, the same storage (no copy).
  at::Tensor k8 = pagedkv::k_cache_as_float8(cache);  // [2, 64, 16, 8, 128] at::kFloat8_e4m3fn
  // An element is its float8 value times the scale of its (token, head):
  at::Tensor page0 = k8[layer][0].to(at::kFloat) * cache.k_scales()[layer][0].view({16, 8, 1});
  //! [float8]
  expect(at::equal(page0.to(at::kHalf), keys[0].narrow(0, 0, 16)), "float8 value x scale = the gather");
#endif
}

}  // namespace docs
