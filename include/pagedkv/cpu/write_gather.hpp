// The CPU write and gather of native pages: parallel over (sequence, page)
// work items, each a copy_block (cpu/copy.hpp) between the token-major
// input or output and one page. The quantized kernels (cpu/quant/write_gather.hpp)
// and the attention kernel (cpu/attention/kernel.hpp) walk the same work
// items and read layers the same way. Callers validate first; nothing here
// checks or throws, so a kernel that starts always finishes.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pagedkv/cpu/copy.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace cpu {

/// k and v of a batch in token-major order [B, S or T, H, D], as raw bytes.
template <class Byte>
struct TokenMajorKv {
  Byte* k;
  Byte* v;
  int64_t k_batch_stride;  ///< bytes between sequences of k
  int64_t v_batch_stride;  ///< bytes between sequences of v
  BlockStrides k_strides;  ///< bytes between tokens/heads/elements of k
  BlockStrides v_strides;  ///< same for v
};

template <class Byte>
TokenMajorKv<Byte> token_major(Byte* k_data, const at::Tensor& k, Byte* v_data, const at::Tensor& v) {
  const int64_t es = static_cast<int64_t>(k.element_size());
  return {k_data, v_data, k.stride(0) * es, v.stride(0) * es, token_major_strides(k), token_major_strides(v)};
}

/// Layer `layer` of a cache tensor [n_layers, ...] as raw bytes. CPU kernels
/// take this rather than select(0, layer): on libtorch 1.13 a select is a
/// dispatch and an autograd view, a large share of a 32-token decode write
/// (bench/NOTES.md, "Fixed costs of small writes").
inline char* layer_bytes(const at::Tensor& storage, int64_t layer) {
  const auto elem_size = static_cast<int64_t>(storage.element_size());
  return static_cast<char*>(storage.data_ptr()) + layer * storage.stride(0) * elem_size;
}

/// layer_bytes of a float32 tensor, as floats (a quantized side's scales).
inline float* layer_floats(const at::Tensor& storage, int64_t layer) {
  return static_cast<float*>(storage.data_ptr()) + layer * storage.stride(0);
}

/// One layer of the cache's pages as raw bytes: [n_pages, <page>] for k and v.
template <class Byte>
struct LayerPages {
  Byte* k;
  Byte* v;
  int64_t page_bytes;    ///< bytes between pages
  BlockStrides strides;  ///< inside a page
};

/// Work items per sequence of a write of `n_tokens` tokens from `starts`:
/// the pages the widest sequence's run touches (at most ceil(n/P) + 1, when
/// it starts mid-page; exactly 1 for a decode step).
inline int64_t write_items_per_row(const std::vector<int64_t>& starts, int64_t n_tokens, const PageDivisor& pages) {
  int64_t items_per_row = 1;
  for (const int64_t start : starts) {
    items_per_row = std::max(items_per_row, pages.column(start + n_tokens - 1) - pages.column(start) + 1);
  }
  return items_per_row;
}

/// What one write work item copies: `tokens` input tokens of sequence `row`
/// from input token `token` on, into `page` from slot `in_page` on.
struct WriteBlock {
  int64_t row;      ///< the sequence
  int64_t token;    ///< its first input token written (an index into S)
  int64_t tokens;   ///< how many; 0 when the item writes nothing
  int64_t page;     ///< the page written (looked up only when tokens > 0)
  int64_t in_page;  ///< the slot of the first one in the page
};

/// The block of work item `item` of a write with `items_per_row` items per
/// sequence (write_items_per_row; items run sequence-major).
template <class Index>
inline WriteBlock locate_write_block(const PageTableRef<Index>& table,    // [B, max_pages]
                                     const std::vector<int64_t>& starts,  // [B]
                                     int64_t n_tokens, const PageDivisor& pages, int64_t items_per_row,
                                     int64_t item) {
  WriteBlock b{};
  b.row = items_per_row == 1 ? item : item / items_per_row;  // a decode step divides nothing
  const int64_t start = starts[static_cast<size_t>(b.row)];
  const int64_t page_size = pages.page_size();
  const int64_t col = pages.column(start) + (item - b.row * items_per_row);
  const int64_t first = std::max(col * page_size, start);
  const int64_t last = std::min((col + 1) * page_size, start + n_tokens);
  if (first >= last) return b;
  b.token = first - start;
  b.tokens = last - first;
  b.page = table(b.row, col);
  b.in_page = first - col * page_size;
  return b;
}

/// Writes tokens [0, n_tokens) of every sequence b to logical positions
/// starts[b] + s, through the page table.
template <class Index>
void write_cpu(const PageTableRef<Index>& table,  // [B, max_pages]
               const std::vector<int64_t>& starts,  // [B]
               int64_t n_tokens, const TokenMajorKv<const char>& src, const LayerPages<char>& dst,
               const PageGeometry& g, int64_t elem_size) {
  if (n_tokens == 0 || table.rows == 0) return;
  const PageDivisor pages(g.page_size);
  const int64_t items_per_row = write_items_per_row(starts, n_tokens, pages);
  const int64_t token_bytes = g.n_heads * g.head_dim * elem_size;
  const int64_t bytes_per_item = 2 * std::min(n_tokens, g.page_size) * token_bytes;
  const bool stream = use_streaming_stores(2 * table.rows * n_tokens * token_bytes, dst.strides, g, elem_size);
  const auto run = [&](auto stream_tag, int64_t begin, int64_t end) {
    constexpr bool kStream = decltype(stream_tag)::value;
    for (int64_t item = begin; item < end; ++item) {
      const WriteBlock b = locate_write_block(table, starts, n_tokens, pages, items_per_row, item);
      if (b.tokens == 0) continue;
      const int64_t to = b.page * dst.page_bytes + b.in_page * dst.strides.token;
      const BlockShape shape{b.tokens, g.n_heads, g.head_dim, elem_size};
      copy_block<kStream>(dst.k + to, dst.strides, src.k + b.row * src.k_batch_stride + b.token * src.k_strides.token,
                          src.k_strides, shape);
      copy_block<kStream>(dst.v + to, dst.strides, src.v + b.row * src.v_batch_stride + b.token * src.v_strides.token,
                          src.v_strides, shape);
    }
  };
  parallel_copy(table.rows * items_per_row, grain_for(bytes_per_item), stream, run);
}

/// What one gather work item (sequence `row`, page column `col`) copies:
/// the block's positions [first, last) of the output; [first, valid_end)
/// are read from `page`, the rest are zeros (past the sequence's length, or
/// an unmapped page).
struct GatherBlock {
  int64_t row;        ///< the sequence
  int64_t first;      ///< first position of the block (the page column's first)
  int64_t last;       ///< one past its last: the column's end, or T
  int64_t valid_end;  ///< end of the positions read from `page`
  int64_t page;       ///< the page read; kUnmappedPage when none is
};

/// The block of work item `item` of a gather over `cols` page columns of
/// every sequence (items run sequence-major).
template <class Index>
inline GatherBlock locate_gather_block(const PageTableRef<Index>& table,    // [B, max_pages]
                                       const std::vector<int64_t>& lengths,  // [B], each <= T
                                       int64_t n_tokens,                     // T
                                       int64_t page_size, int64_t cols, int64_t item) {
  GatherBlock b{};
  b.row = item / cols;
  const int64_t col = item % cols;
  b.first = col * page_size;
  b.last = std::min(b.first + page_size, n_tokens);
  b.valid_end = std::min(std::max(lengths[static_cast<size_t>(b.row)], b.first), b.last);
  b.page = b.valid_end > b.first ? static_cast<int64_t>(table(b.row, col)) : kUnmappedPage;
  if (b.page == kUnmappedPage) b.valid_end = b.first;
  return b;
}

/// Reads positions [0, lengths[b]) of every sequence into contiguous
/// [B, T, H, D] outputs; positions past a length, and unmapped pages, are zeros.
template <class Index>
void gather_cpu(const PageTableRef<Index>& table,    // [B, max_pages]
                const std::vector<int64_t>& lengths,  // [B], each <= T
                int64_t n_tokens,                     // T
                const LayerPages<const char>& src, const TokenMajorKv<char>& dst, const PageGeometry& g,
                int64_t elem_size) {
  if (n_tokens == 0 || table.rows == 0) return;
  const int64_t page_size = g.page_size;
  const int64_t cols = (n_tokens + page_size - 1) / page_size;
  const int64_t token_bytes = g.n_heads * g.head_dim * elem_size;
  const int64_t bytes_per_item = 2 * std::min(n_tokens, page_size) * token_bytes;
  const bool stream = use_streaming_gather(2 * table.rows * n_tokens * token_bytes);
  const auto run = [&](auto stream_tag, int64_t begin, int64_t end) {
    constexpr bool kStream = decltype(stream_tag)::value;
    for (int64_t item = begin; item < end; ++item) {
      const GatherBlock b = locate_gather_block(table, lengths, n_tokens, page_size, cols, item);
      char* k_out = dst.k + b.row * dst.k_batch_stride + b.first * token_bytes;
      char* v_out = dst.v + b.row * dst.v_batch_stride + b.first * token_bytes;
      if (b.valid_end > b.first) {
        const BlockShape shape{b.valid_end - b.first, g.n_heads, g.head_dim, elem_size};
        copy_block<kStream>(k_out, dst.k_strides, src.k + b.page * src.page_bytes, src.strides, shape);
        copy_block<kStream>(v_out, dst.v_strides, src.v + b.page * src.page_bytes, src.strides, shape);
      }
      const int64_t valid_bytes = (b.valid_end - b.first) * token_bytes;
      zero_tokens(k_out + valid_bytes, b.last - b.valid_end, token_bytes);
      zero_tokens(v_out + valid_bytes, b.last - b.valid_end, token_bytes);
    }
  };
  parallel_copy(table.rows * cols, grain_for(bytes_per_item), stream, run);
}
}  // namespace cpu
}  // namespace pagedkv
