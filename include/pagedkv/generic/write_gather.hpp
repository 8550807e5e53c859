// The device-agnostic ATen path of write and gather (native pages): what a
// cache on a device without hand-written kernels runs, and what
// ScopedBackend(Backend::generic) forces on the CPU. Writes: index_copy_ of
// head rows; gathers: index_select of whole pages, seen token-major through
// the layout's strides, then zeros where masked. Callers validate first.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace generic {

/// Row of the [n_pages * page_size * n_heads, head_dim] view of one layer
/// that holds (page, token offset, head): the layout's strides in head rows.
inline int64_t head_row(const PageGeometry& g, int64_t page, int64_t offset, int64_t head) {
  return (page * g.page_elems + g.offset(offset, head)) / g.head_dim;
}

inline at::Tensor host_index(const std::vector<int64_t>& values, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return device.is_cpu() ? host : host.to(device);
}

/// Device-agnostic write: index_copy_ of head rows into the flattened layer.
template <class Index>
void write_generic(const PageTableRef<Index>& table, const std::vector<int64_t>& starts, int64_t n_tokens,
                   const at::Tensor& k,        // [B, S, H, D]
                   const at::Tensor& v,        // [B, S, H, D]
                   const at::Tensor& k_layer,  // [n_pages, <page>]
                   const at::Tensor& v_layer,  // [n_pages, <page>]
                   const PageGeometry& g) {
  if (n_tokens == 0 || table.rows == 0) return;
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(table.rows * n_tokens * g.n_heads));
  for (int64_t b = 0; b < table.rows; ++b) {
    for (int64_t s = 0; s < n_tokens; ++s) {
      const int64_t pos = starts[static_cast<size_t>(b)] + s;
      const int64_t page = table(b, pos / g.page_size);
      for (int64_t h = 0; h < g.n_heads; ++h) rows.push_back(head_row(g, page, pos % g.page_size, h));
    }
  }
  const at::Tensor index = host_index(rows, k_layer.device());
  k_layer.view({-1, g.head_dim}).index_copy_(0, index, k.reshape({-1, g.head_dim}));
  v_layer.view({-1, g.head_dim}).index_copy_(0, index, v.reshape({-1, g.head_dim}));
}

/// Device-agnostic gather, one index entry per (sequence, page column): the
/// layer seen as [n_pages, P, H, D] through the layout's strides (so HND
/// pages come out token-major), index_select of whole pages, then zeros where
/// a column is unmapped or past a length. Indexing head rows instead (B*T*H
/// entries built on the host and copied to the device per call) was slower
/// (bench/NOTES.md, "The generic (CUDA) gather (issue 3, change 10)").
template <class Index>
std::pair<at::Tensor, at::Tensor> gather_generic(const PageTableRef<Index>& table,
                                                 const std::vector<int64_t>& lengths,  // [B], each <= T
                                                 int64_t n_tokens,                     // T
                                                 const at::Tensor& k_layer,  // [n_pages, <page>]
                                                 const at::Tensor& v_layer,  // [n_pages, <page>]
                                                 const PageGeometry& g) {
  const int64_t batch = table.rows;
  const int64_t page_size = g.page_size;
  const int64_t cols = (n_tokens + page_size - 1) / page_size;
  if (batch == 0 || cols == 0) {
    return {at::zeros({batch, n_tokens, g.n_heads, g.head_dim}, k_layer.options()),
            at::zeros({batch, n_tokens, g.n_heads, g.head_dim}, v_layer.options())};
  }
  std::vector<int64_t> pages(static_cast<size_t>(batch * cols), 0);  // [B * cols]; 0: any page, masked
  std::vector<int64_t> valid(static_cast<size_t>(batch * cols), 0);  // [B * cols] leading tokens kept
  bool masked = false;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = std::min(lengths[static_cast<size_t>(b)], n_tokens);
    for (int64_t c = 0; c < cols; ++c) {
      const auto slot = static_cast<size_t>(b * cols + c);
      const int64_t page = c * page_size < length ? static_cast<int64_t>(table(b, c)) : kUnmappedPage;
      if (page != kUnmappedPage) {
        pages[slot] = page;
        valid[slot] = std::min(page_size, length - c * page_size);
      }
      masked |= valid[slot] < std::min(page_size, n_tokens - c * page_size);
    }
  }
  const at::Device device = k_layer.device();
  const at::Tensor page_index = host_index(pages, device);
  at::Tensor zeroed;  // [B, cols * P, 1, 1] bool: positions that read as zeros
  if (masked) {
    const at::Tensor offsets = at::arange(page_size, at::TensorOptions().dtype(at::kLong).device(device));
    zeroed = (offsets.view({1, 1, page_size}) >= host_index(valid, device).view({batch, cols, 1}))
                 .view({batch, cols * page_size, 1, 1});
  }
  const auto gather_layer = [&](const at::Tensor& layer) {
    const at::Tensor by_token = layer.as_strided({layer.size(0), page_size, g.n_heads, g.head_dim},
                                                 {g.page_elems, g.token_stride, g.head_stride, 1});
    at::Tensor out = by_token.index_select(0, page_index).reshape({batch, cols * page_size, g.n_heads, g.head_dim});
    if (masked) out.masked_fill_(zeroed, 0);
    return cols * page_size == n_tokens ? out : out.narrow(1, 0, n_tokens).contiguous();
  };
  return {gather_layer(k_layer), gather_layer(v_layer)};
}

}  // namespace generic
}  // namespace pagedkv
