// The launch of whole-page copies between caches on one CUDA device (or
// between a cache and a staging buffer of contiguous pages): every layer of
// one page tensor (codes or native elements of a side, or its scales), in
// one kernel, relaid out through strides when the layouts differ.
#pragma once

#include <cstdint>

#include "pagedkv/cuda/launch.hpp"
#include "pagedkv/cuda/params.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "pagedkv/layouts.hpp"

namespace pagedkv {
namespace cuda {

inline KernelKey copy_pages_kernel() { return kernel("copy_pages", "CopyParams", kCopyThreads); }

/// One page tensor [n_layers, n_pages, <page>] as raw bytes, with the
/// geometry of one page (a side's scales: head_dim 1).
struct PageTensor {
  void* data;
  int64_t layer_bytes;  ///< bytes between layers
  int64_t elem_size;    ///< bytes per element
  PageGeometry g;
};

/// For every layer: page dst_ids[i] of `to` <- page src_ids[i] of `from`,
/// i < n (ids on the device; null: i, a staging buffer of n pages). The
/// lists must not overlap (a page read and written): callers stage those.
inline void copy_pages(Executor& ex, const PageTensor& to, const PageTensor& from, const int64_t* src_ids,
                       const int64_t* dst_ids, int64_t n, int64_t n_layers, bool same_layout) {
  if (n == 0 || n_layers == 0) return;
  const int64_t es = to.elem_size;
  const int64_t page_bytes = to.g.page_elems * es;
  kernel_params::CopyParams p{};
  p.src = from.data;
  p.dst = to.data;
  p.src_ids = src_ids;
  p.dst_ids = dst_ids;
  p.n = n;
  p.n_layers = n_layers;
  p.src_layer_bytes = from.layer_bytes;
  p.dst_layer_bytes = to.layer_bytes;
  p.src_page_bytes = page_bytes;
  p.dst_page_bytes = page_bytes;
  if (same_layout) {  // a page is one run
    p.tokens = 1;
    p.heads = 1;
    p.row_bytes = page_bytes;
  } else {
    p.tokens = to.g.page_size;
    p.heads = to.g.n_heads;
    p.row_bytes = to.g.head_dim * es;
    p.src_token = from.g.token_stride * es;
    p.src_head = from.g.head_stride * es;
    p.dst_token = to.g.token_stride * es;
    p.dst_head = to.g.head_stride * es;
  }
  p.row_vec = widest_move({static_cast<uint64_t>(p.row_bytes), detail::address(p.src), detail::address(p.dst),
                           static_cast<uint64_t>(page_bytes), static_cast<uint64_t>(p.src_layer_bytes),
                           static_cast<uint64_t>(p.dst_layer_bytes), static_cast<uint64_t>(p.src_token),
                           static_cast<uint64_t>(p.src_head), static_cast<uint64_t>(p.dst_token),
                           static_cast<uint64_t>(p.dst_head)});
  p.lanes = lanes_for(p.heads * p.row_bytes / p.row_vec);
  ex.launch(make_launch(copy_pages_kernel(), detail::grid_for(n_layers * n * p.tokens, p.lanes, 1), p));
}

}  // namespace cuda
}  // namespace pagedkv
