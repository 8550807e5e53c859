// Paged attention: decode and chunked prefill (causal, GQA/MQA) that read
// keys and values straight from the pages through the page table: no
// [B, T, H, D] copy of the context is made.
//
// This header holds the public function: its checks, then the operations
// layer's entry point (ops/attention.hpp), which picks the backend:
//   cpu/attention/kernel.hpp   the CPU kernel (blocks, online softmax,
//                              merge), native and quantized pages, over the
//                              instruction sets simd/isa.hpp selects
//   cuda/attention.hpp         CUDA caches (kernel text in cuda/sources/)
//   generic/attention.hpp      any other device: gather + ATen softmax
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "pagedkv/attention_options.hpp"
#include "pagedkv/cache_view.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/attention.hpp"
#include "pagedkv/ops/bind.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/paged_cache.hpp"

namespace pagedkv {

/// Causal paged attention over a view bound with per-sequence lengths that
/// already count the Sq new tokens (written before the call). Query s of
/// sequence b sits at position lengths[b] - Sq + s and attends to positions
/// <= its own (within options.window; among the new tokens as
/// options.tree_mask says); query head h reads kv head h / (n_heads /
/// n_kv_heads). Soft-cap and sinks as AttentionOptions says; a query that
/// sees no key returns zeros.
/// Returns [B, Sq, n_heads, D] in q's dtype. A view bound for the CUDA
/// kernels is checked against bind's host snapshot: no device sync.
template <class Layout>
at::Tensor paged_attention(const CacheView<Layout>& view, int64_t layer,
                           const at::Tensor& q,  // [B, Sq, n_heads, D], the cache's dtype, any strides
                           const AttentionOptions& options) {
  const checks::Caller caller{"paged_attention", Layout::name, nullptr};
  const PagedCache<Layout>& cache = view.cache();
  const ops::Storage s = cache.storage();
  const ops::Table table = ops::table_of(s, view.page_table(), view.bound_tables());
  const PageGeometry& g = cache.geometry();
  const at::ScalarType dtype = cache.dtype();
  checks::layer(caller, layer, cache.n_layers());
  checks::attention_dtype(caller, dtype);
  checks::page_table(caller, table.bound != nullptr ? table.host : view.page_table(), cache.device());
  const int64_t batch = table.rows();
  checks::attention_query(caller, q, batch, g, dtype, cache.device());
  const int64_t n_queries = q.size(1);
  checks::attention_options(caller, options, batch, n_queries, q.size(2), cache.device());
  checks::bound_with_lengths(caller, view.lengths());
  const std::vector<int64_t> lengths =
      table.bound != nullptr ? table.bound->host_lengths
                             : checks::per_sequence(caller, "lengths", view.lengths(), batch, cache.device());
  checks::attention_lengths(caller, lengths, n_queries);
  // The keys a row's queries read: from the earliest query's window start
  // (the columns before it may be -1: a windowed SequenceTable's).
  const auto first_read = [&](int64_t row) {
    return checks::first_visible(lengths[static_cast<size_t>(row)], n_queries, options.window);
  };
  visit_page_table(table.host, [&](const auto& rows) {
    if (table.bound == nullptr) {
      for (int64_t row = 0; row < rows.rows; ++row) {
        checks::mapped_range(caller, rows, row, first_read(row), lengths[static_cast<size_t>(row)], g.page_size,
                             cache.pool());
      }
      return;
    }
    for (int64_t row = 0; table.bound->leading_unmapped && row < rows.rows; ++row) {  // bind let those through
      checks::mapped_range(caller, rows, row, first_read(row), lengths[static_cast<size_t>(row)], g.page_size,
                           cache.pool());
    }
    checks::bound_view_current(caller, *table.bound, rows, cache.pool(), [&](int64_t row) {
      return std::make_pair(first_read(row) / g.page_size,
                            (lengths[static_cast<size_t>(row)] + g.page_size - 1) / g.page_size);
    });
  });
  // Validated: from here on nothing throws (but a device error).
  if (batch == 0 || n_queries == 0) return at::empty(q.sizes(), q.options());
  AttentionOptions resolved = options;
  if (resolved.scale <= 0.0) resolved.scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  return ops::attention(s, layer, table, lengths, table.bound != nullptr, q, resolved);
}

/// paged_attention with only a scale (<= 0: 1/sqrt(head_dim)).
template <class Layout>
at::Tensor paged_attention(const CacheView<Layout>& view, int64_t layer,
                           const at::Tensor& q,  // [B, Sq, n_heads, D]
                           double scale = 0.0) {
  AttentionOptions options;
  options.scale = scale;
  return paged_attention(view, layer, q, options);
}

}  // namespace pagedkv
