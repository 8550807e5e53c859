// Paged attention: decode and chunked prefill (causal, GQA/MQA) that read
// keys and values straight from the pages through the page table: no
// [B, T, H, D] copy of the context is made.
//
// This header holds the public function (checks, dispatch). The pieces:
//   cpu/attention/kernel.hpp    the CPU kernel (blocks, online softmax,
//                               merge), native and quantized pages
//   cpu/attention/plan.hpp      work items: query tiles x kv heads x key splits
//   cpu/attention/prefetch.hpp  what the kernel reads ahead
//   simd/isa.hpp                run-time choice of the instruction set, over
//     simd/isa_portable.hpp, simd/isa_avx2.hpp (AVX2/FMA/F16C),
//     simd/isa_avx512.hpp (AVX-512F)
//   generic/attention.hpp       any other device: gather + ATen softmax
//   cuda/attention.hpp          CUDA caches (views bound for the CUDA kernels)
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "pagedkv/cache_view.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/cpu/attention/kernel.hpp"
#include "pagedkv/cuda/attention.hpp"
#include "pagedkv/cuda/cache_ops.hpp"
#include "pagedkv/generic/attention.hpp"
#include "pagedkv/kernels.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/paged_cache.hpp"

namespace pagedkv {

namespace detail {

/// Whether paged_attention on `view` takes the CUDA kernels: a view bound
/// for them, of a head_dim they take.
template <class Layout>
bool attends_with_cuda(const CacheView<Layout>& view) {
  const PagedCache<Layout>& cache = view.cache();
  return view.bound_tables() != nullptr && kernels::use_cuda_kernels(cache.device()) &&
         cuda::attention_supports(cache.head_dim(), cuda::executor_for(cache.device()));
}

/// paged_attention on a view bound for the CUDA kernels: the CPU path's
/// checks, in its order, against bind's host snapshot; then the launches.
template <class Layout>
at::Tensor paged_attention_cuda(const CacheView<Layout>& view, int64_t layer, const at::Tensor& q, double scale) {
  const checks::Caller caller{"paged_attention", Layout::name, nullptr};
  const PagedCache<Layout>& cache = view.cache();
  const cuda::BoundTables& b = *view.bound_tables();
  const PageGeometry& g = cache.geometry();
  const at::ScalarType dtype = cache.dtype();
  checks::layer(caller, layer, cache.n_layers());
  checks::attention_dtype(caller, dtype);
  checks::page_table(caller, b.host_table, cache.device());
  const int64_t batch = b.host_table.size(0);
  checks::attention_query(caller, q, batch, g, dtype, cache.device());
  checks::attention_scale(caller, scale);
  checks::bound_with_lengths(caller, view.lengths());
  const int64_t n_queries = q.size(1);
  checks::attention_lengths(caller, b.host_lengths, n_queries);
  visit_page_table(b.host_table, [&](const auto& table) {
    for (int64_t row = 0; b.leading_unmapped && row < table.rows; ++row) {  // bind let those through
      checks::mapped_prefix(caller, table, row, b.host_lengths[static_cast<size_t>(row)], g.page_size, cache.pool());
    }
    checks::bound_view_current(caller, b, table, cache.pool(), [&](int64_t row) {
      return std::make_pair(int64_t{0}, (b.host_lengths[static_cast<size_t>(row)] + g.page_size - 1) / g.page_size);
    });
  });
  // Validated: from here on nothing throws (but a device error).
  if (batch == 0 || n_queries == 0) return at::empty(q.sizes(), q.options());
  const double s = scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  cuda::Side sides[2];
  cuda::cache_sides(cache, layer, sides);
  return cuda::attention(cuda::executor_for(cache.device()), cuda::table_ref(b.device_table),
                         b.device_lengths.data_ptr<int64_t>(), q, sides, g, dtype, cache.n_pages(), s);
}

}  // namespace detail

/// Causal paged attention over a view bound with per-sequence lengths that
/// already count the Sq new tokens (written before the call). Query s of
/// sequence b sits at position lengths[b] - Sq + s and attends to positions
/// <= its own; query head h reads kv head h / (n_heads / n_kv_heads).
/// scale <= 0 means 1/sqrt(D). Returns [B, Sq, n_heads, D] in q's dtype.
template <class Layout>
at::Tensor paged_attention(const CacheView<Layout>& view, int64_t layer,
                           const at::Tensor& q,  // [B, Sq, n_heads, D], the cache's dtype, any strides
                           double scale = 0.0) {
  // A view bound for the CUDA kernels: checked against bind's host snapshot, no sync.
  if (detail::attends_with_cuda(view)) return detail::paged_attention_cuda(view, layer, q, scale);
  const checks::Caller caller{"paged_attention", Layout::name, nullptr};
  const PagedCache<Layout>& cache = view.cache();
  const PageGeometry& g = cache.geometry();
  const at::ScalarType dtype = cache.dtype();
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
    if (!kernels::use_cpu_kernels(cache.device())) {
      if (is_quantized(cache.quant())) {
        return attention_kernels::attention_over_gathered(cache.gather(layer, view.page_table(), view.lengths()),
                                                          lengths, q, g, s);
      }
      return attention_kernels::paged_attention_generic(table, lengths, q, cache.k_cache().select(0, layer),
                                                        cache.v_cache().select(0, layer), g, s);
    }
    const attention_kernels::KVSide k = attention_kernels::layer_side(cache.k_cache(), cache.k_scales(),
                                                                      cache.quant().k, layer);
    const attention_kernels::KVSide v = attention_kernels::layer_side(cache.v_cache(), cache.v_scales(),
                                                                      cache.quant().v, layer);
    return attention_kernels::paged_attention_cpu(table, lengths, q, k, v, g, s);
  });
}

}  // namespace pagedkv
