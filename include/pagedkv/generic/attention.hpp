// paged_attention on any device: gather, then a causal masked softmax with
// ATen ops in float32. CUDA caches take it; ScopedBackend forces it on the
// CPU for tests.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "pagedkv/attention_options.hpp"
#include "pagedkv/generic/write_gather.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace generic {

inline at::Tensor attention_over_gathered(const std::pair<at::Tensor, at::Tensor>& kv,
                                          const std::vector<int64_t>& lengths, const at::Tensor& q,
                                          const PageGeometry& g, const AttentionOptions& options);

/// Device-agnostic path: gather [B, T, H, D], then a causal masked softmax
/// in float32 with ATen ops. Same results as the CPU kernel.
template <class Index>
at::Tensor paged_attention_generic(const PageTableRef<Index>& table,     // [B, max_pages]
                                   const std::vector<int64_t>& lengths,  // [B]
                                   const at::Tensor& q,                  // [B, Sq, n_heads, D]
                                   const at::Tensor& k_layer,            // [n_pages, <page>]
                                   const at::Tensor& v_layer,            // [n_pages, <page>]
                                   const PageGeometry& g, const AttentionOptions& options) {
  const int64_t n_tokens = *std::max_element(lengths.begin(), lengths.end());
  return attention_over_gathered(generic::gather_generic(table, lengths, n_tokens, k_layer, v_layer, g), lengths, q,
                                 g, options);
}

/// The softmax part of paged_attention_generic over k, v already gathered
/// ([B, T, H, D], T = max(lengths), zeros past a length and in unmapped
/// pages): what a cache with quantized pages gives from its own
/// (dequantizing) gather. Every option as AttentionOptions says: the
/// window, the tree mask and causality as one [B, Sq, T] mask, the soft-cap
/// on the scaled logits, the sinks as one more column of the softmax.
inline at::Tensor attention_over_gathered(const std::pair<at::Tensor, at::Tensor>& kv,
                                          const std::vector<int64_t>& lengths,  // [B]
                                          const at::Tensor& q,                  // [B, Sq, n_heads, D]
                                          const PageGeometry& g, const AttentionOptions& options) {
  const double scale = options.scale;
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2), D = q.size(3);
  const int64_t group = n_heads / g.n_heads;
  const int64_t n_tokens = kv.first.size(1);
  const at::Tensor k = kv.first.to(at::kFloat).permute({0, 2, 3, 1});                     // [B, H, D, T]
  const at::Tensor v = kv.second.to(at::kFloat).permute({0, 2, 1, 3});                    // [B, H, T, D]
  // Query rows (s, g) of each kv head h: [B, H, Sq * G, D].
  const at::Tensor qf = q.to(at::kFloat).reshape({batch, n_queries, g.n_heads, group, D}).permute({0, 2, 1, 3, 4})
                            .reshape({batch, g.n_heads, n_queries * group, D});
  at::Tensor scores = at::matmul(qf, k).mul_(scale).view({batch, g.n_heads, n_queries, group, n_tokens});
  if (options.softcap > 0.0) scores = at::tanh(scores / options.softcap) * options.softcap;
  // Query s of sequence b sits at lengths[b] - Sq + s and sees positions <= it
  // (from its window's start); the new tokens as the tree mask says.
  const at::TensorOptions index_options = q.options().dtype(at::kLong);
  const at::Tensor positions = at::arange(n_tokens, index_options).view({1, 1, n_tokens});                   // [1, 1, T]
  const at::Tensor first_new = generic::host_index(lengths, q.device()).view({batch, 1, 1}) - n_queries;     // [B, 1, 1]
  const at::Tensor query_pos = first_new + at::arange(n_queries, index_options).view({1, n_queries, 1});     // [B, Sq, 1]
  at::Tensor seen;  // [B, Sq, T] bool
  if (options.tree_mask.defined()) {
    const at::Tensor new_index = positions - first_new;                                                       // [B, 1, T]
    const at::Tensor is_new = new_index.ge(0).logical_and(new_index.lt(n_queries));
    const at::Tensor mask = options.tree_mask.to(q.device()).gather(
        2, new_index.clamp(0, n_queries - 1).expand({batch, n_queries, n_tokens}));                          // [B, Sq, T]
    seen = positions.lt(first_new).logical_or(is_new.logical_and(mask));
  } else {
    seen = positions.le(query_pos);
  }
  if (options.window > 0) seen = seen.logical_and(positions.gt(query_pos - options.window));
  const at::Tensor hidden = seen.logical_not().view({batch, 1, n_queries, 1, n_tokens});
  scores.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
  at::Tensor probs;
  if (options.sinks.defined()) {
    // One more column per query head: its sink logit, which takes weight
    // and gives no value.
    const at::Tensor sinks = options.sinks.to(q.device(), at::kFloat).view({1, g.n_heads, 1, group, 1})
                                 .expand({batch, g.n_heads, n_queries, group, 1});
    probs = at::softmax(at::cat({scores, sinks}, -1), -1).narrow(-1, 0, n_tokens);
  } else {
    probs = at::softmax(scores, -1);
  }
  // A query that sees no key: softmax over -inf only is NaN; its output is 0.
  probs = probs.masked_fill(hidden, 0.0).reshape({batch, g.n_heads, n_queries * group, n_tokens});
  const at::Tensor out = at::matmul(probs, v);  // [B, H, Sq * G, D]
  return out.view({batch, g.n_heads, n_queries, group, D})
      .permute({0, 2, 1, 3, 4})
      .reshape({batch, n_queries, n_heads, D})
      .to(q.scalar_type())
      .contiguous();
}

}  // namespace generic
}  // namespace pagedkv
