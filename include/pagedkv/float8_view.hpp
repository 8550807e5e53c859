// A cache's fp8 codes as torch's own float8 dtype, where torch has one.
// pagedkv stores fp8 e4m3 codes as kByte (Debian's libtorch 1.13 has no
// float8 dtype), in the OCP e4m3 format that torch 2.1 and later call
// float8_e4m3fn. Engines that hand the pages to torch's fp8 operations view
// them as that dtype: the same bytes, no copy.
#pragma once

#include <ATen/ATen.h>

#include "pagedkv/checks.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/torch_compat.hpp"  // PAGEDKV_HAS_TORCH_FLOAT8

#if PAGEDKV_HAS_TORCH_FLOAT8
namespace pagedkv {
namespace detail {

/// `codes` (one side's kByte pages, stored in `format`) viewed as float8_e4m3fn.
inline at::Tensor view_codes(const checks::Caller& caller, const char* side,
                             const at::Tensor& codes,  // [n_layers, n_pages, <page>]
                             KVFormat format) {
  checks::fp8_side(caller, side, format);
  return codes.view(at::kFloat8_e4m3fn);
}

}  // namespace detail

/// The K pages of a cache whose keys are fp8_e4m3, as float8_e4m3fn: a view
/// of k_cache() (same storage, shape and strides). Element values are the
/// codes' e4m3 values; a key element is that times its scale in k_scales().
/// Throws c10::Error, changing nothing, when the keys are not fp8_e4m3.
template <class Layout>
at::Tensor k_cache_as_float8(const PagedCache<Layout>& cache) {
  const checks::Caller caller{"k_cache_as_float8", Layout::name, nullptr};
  return detail::view_codes(caller, "keys", cache.k_cache(), cache.quant().k);
}

/// As k_cache_as_float8, for the V pages (v_cache(), v_scales()).
template <class Layout>
at::Tensor v_cache_as_float8(const PagedCache<Layout>& cache) {
  const checks::Caller caller{"v_cache_as_float8", Layout::name, nullptr};
  return detail::view_codes(caller, "values", cache.v_cache(), cache.quant().v);
}

}  // namespace pagedkv
#endif  // PAGEDKV_HAS_TORCH_FLOAT8
