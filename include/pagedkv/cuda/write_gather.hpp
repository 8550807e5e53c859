// The launches of write and gather on a CUDA cache (native and quantized
// sides): which kernel, its grid and its parameters, from tensors' shapes,
// strides and addresses only. Callers validate everything first; nothing
// here reads device memory, so it runs the same for the GPU's tensors and
// for the emulator's CPU tensors.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "pagedkv/cuda/launch.hpp"
#include "pagedkv/cuda/params.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"

namespace pagedkv {
namespace cuda {

/// Threads per block of the copying kernels.
constexpr int kCopyThreads = 256;

/// The logical dtype as a kernel template argument (sources/common.hpp).
inline int dtype_id(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, "pagedkv::cuda: no kernel for dtype ", t, " (float32, float16, bfloat16)");
  }
}

inline KernelKey write_native_kernel() { return kernel("write_native", "WriteParams", kCopyThreads); }
inline KernelKey gather_native_kernel() { return kernel("gather_native", "GatherParams", kCopyThreads); }
inline KernelKey write_quantized_kernel(int dtype, KVFormat f) {
  return kernel("write_quantized", "WriteParams", kCopyThreads, {dtype, static_cast<int>(f)});
}
inline KernelKey gather_quantized_kernel(int dtype, KVFormat f) {
  return kernel("gather_quantized", "GatherParams", kCopyThreads, {dtype, static_cast<int>(f)});
}

/// A page table [rows, cols] (int32 or int64, any strides) as the kernels read it.
inline params::TableRef table_ref(const at::Tensor& t) {
  return {t.data_ptr(), t.size(0), t.size(1), t.stride(0), t.stride(1), t.scalar_type() == at::kInt ? 1 : 0};
}

/// A [B, S or T, H, D] tensor with byte strides.
inline params::TokensRef tokens_ref(const at::Tensor& t) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  return {t.data_ptr(), t.stride(0) * es, t.stride(1) * es, t.stride(2) * es, t.stride(3) * es};
}

/// Layer `layer` of one side of a cache: its pages [n_layers, n_pages,
/// <page>] and, quantized, its scales [n_layers, n_pages, P * H] (undefined
/// for a native side).
inline params::PagesRef pages_ref(const at::Tensor& pages, const at::Tensor& scales, int64_t layer,
                                         const PageGeometry& g) {
  const int64_t es = static_cast<int64_t>(pages.element_size());
  params::PagesRef r{};
  r.data = static_cast<char*>(pages.data_ptr()) + layer * pages.stride(0) * es;
  r.page_bytes = g.page_elems * es;
  r.token_bytes = g.token_stride * es;
  r.head_bytes = g.head_stride * es;
  if (scales.defined()) {
    r.scales = scales.data_ptr<float>() + layer * scales.stride(0);
    r.scale_page = g.page_size * g.n_heads;
    r.scale_token = g.token_stride / g.head_dim;
    r.scale_head = g.head_stride / g.head_dim;
  }
  return r;
}

/// One side (K or V) of a cache layer.
struct Side {
  params::PagesRef pages;
  KVFormat format;
};

/// Where write puts token 0 of each sequence: starts[b] (per_row, on the
/// device), else lengths[b] - S (tail_lengths, on the device), else `scalar`.
struct Starts {
  const int64_t* per_row = nullptr;       // [B]
  const int64_t* tail_lengths = nullptr;  // [B]
  int64_t scalar = 0;
};

namespace detail {

inline uint64_t address(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

/// Groups of `lanes` per block, blocks over `items`.
inline Dim3 grid_for(int64_t items, int64_t lanes, uint32_t sides) {
  Dim3 grid;
  grid.x = blocks_for(items, kCopyThreads / lanes);
  grid.y = sides;
  return grid;
}

}  // namespace detail

/// Writes k, v [B, S, H, D] (any strides, the cache's logical dtype) into
/// one layer's sides through `table`: token s of sequence b at position
/// start(b) + s. A native side is copied by bytes; a quantized side gets
/// its codes and scales.
inline void write(Executor& ex, const params::TableRef& table, const Starts& starts, const at::Tensor& k,
                  const at::Tensor& v, const Side (&sides)[2], const PageGeometry& g, at::ScalarType dtype,
                  int64_t n_pages) {
  const int64_t batch = k.size(0), n_tokens = k.size(1);
  if (batch == 0 || n_tokens == 0) return;
  const int64_t es = static_cast<int64_t>(k.element_size());
  params::WriteParams p{};
  p.table = table;
  p.k_src = tokens_ref(k);
  p.v_src = tokens_ref(v);
  p.k_pages = sides[0].pages;
  p.v_pages = sides[1].pages;
  p.starts = starts.per_row;
  p.tail_lengths = starts.tail_lengths;
  p.start = starts.scalar;
  p.batch = batch;
  p.n_tokens = n_tokens;
  p.n_heads = g.n_heads;
  p.head_dim = g.head_dim;
  p.elem_size = es;
  p.page_size = g.page_size;
  p.page_shift = page_shift(g.page_size);
  p.n_pages = n_pages;
  const bool native[2] = {!is_quantized(sides[0].format), !is_quantized(sides[1].format)};
  if (native[0] || native[1]) {
    const int64_t row_bytes = g.head_dim * es;
    const bool contiguous_rows = (k.stride(3) == 1 || g.head_dim == 1) && (v.stride(3) == 1 || g.head_dim == 1);
    uint64_t vec = 16;
    for (int side = 0; side < 2; ++side) {
      if (!native[side]) continue;
      const params::TokensRef& src = side == 0 ? p.k_src : p.v_src;
      const params::PagesRef& dst = sides[side].pages;
      vec = static_cast<uint64_t>(widest_move({vec, static_cast<uint64_t>(row_bytes), detail::address(src.data),
                                               static_cast<uint64_t>(src.batch), static_cast<uint64_t>(src.token),
                                               static_cast<uint64_t>(src.head), detail::address(dst.data),
                                               static_cast<uint64_t>(dst.page_bytes),
                                               static_cast<uint64_t>(dst.token_bytes),
                                               static_cast<uint64_t>(dst.head_bytes)}));
    }
    p.row_vec = contiguous_rows ? static_cast<int64_t>(vec) : 0;
    p.lanes = lanes_for(contiguous_rows ? g.n_heads * row_bytes / p.row_vec : g.head_dim);
    const uint32_t n_sides = native[0] && native[1] ? 2 : 1;
    p.first_side = native[0] ? 0 : 1;
    ex.launch(make_launch(write_native_kernel(), detail::grid_for(batch * n_tokens, p.lanes, n_sides), p));
  }
  for (int side = 0; side < 2; ++side) {
    if (native[side]) continue;
    params::WriteParams q = p;
    q.first_side = side;
    q.lanes = lanes_for((g.head_dim + 3) / 4);
    q.row_vec = 0;
    ex.launch(make_launch(write_quantized_kernel(dtype_id(dtype), sides[side].format),
                          detail::grid_for(batch * n_tokens * g.n_heads, q.lanes, 1), q));
  }
}

/// Reads positions [0, length(b)) of every sequence b into k_out, v_out
/// ([B, T, H, D], contiguous, the logical dtype); length(b) = lengths[b]
/// (on the device) or `length`. The rest, and unmapped pages, are zeros.
inline void gather(Executor& ex, const params::TableRef& table, const int64_t* lengths, int64_t length,
                   const Side (&sides)[2], const at::Tensor& k_out, const at::Tensor& v_out, const PageGeometry& g,
                   at::ScalarType dtype, int64_t n_pages) {
  const int64_t batch = k_out.size(0), n_tokens = k_out.size(1);
  if (batch == 0 || n_tokens == 0) return;
  const int64_t es = static_cast<int64_t>(k_out.element_size());
  params::GatherParams p{};
  p.table = table;
  p.k_pages = sides[0].pages;
  p.v_pages = sides[1].pages;
  p.k_out = tokens_ref(k_out);
  p.v_out = tokens_ref(v_out);
  p.lengths = lengths;
  p.length = length;
  p.n_tokens = n_tokens;
  p.batch = batch;
  p.n_heads = g.n_heads;
  p.head_dim = g.head_dim;
  p.elem_size = es;
  p.page_size = g.page_size;
  p.page_shift = page_shift(g.page_size);
  p.n_pages = n_pages;
  const bool native[2] = {!is_quantized(sides[0].format), !is_quantized(sides[1].format)};
  if (native[0] || native[1]) {
    const int64_t row_bytes = g.head_dim * es;
    uint64_t vec = 16;
    for (int side = 0; side < 2; ++side) {
      if (!native[side]) continue;
      const params::TokensRef& out = side == 0 ? p.k_out : p.v_out;
      const params::PagesRef& src = sides[side].pages;
      vec = static_cast<uint64_t>(widest_move({vec, static_cast<uint64_t>(row_bytes), detail::address(out.data),
                                               static_cast<uint64_t>(out.batch), static_cast<uint64_t>(out.token),
                                               static_cast<uint64_t>(out.head), detail::address(src.data),
                                               static_cast<uint64_t>(src.page_bytes),
                                               static_cast<uint64_t>(src.token_bytes),
                                               static_cast<uint64_t>(src.head_bytes)}));
    }
    p.row_vec = static_cast<int64_t>(vec);
    p.lanes = lanes_for(g.n_heads * row_bytes / p.row_vec);
    const uint32_t n_sides = native[0] && native[1] ? 2 : 1;
    p.first_side = native[0] ? 0 : 1;
    ex.launch(make_launch(gather_native_kernel(), detail::grid_for(batch * n_tokens, p.lanes, n_sides), p));
  }
  for (int side = 0; side < 2; ++side) {
    if (native[side]) continue;
    params::GatherParams q = p;
    q.first_side = side;
    q.lanes = lanes_for((g.head_dim + 3) / 4);
    q.row_vec = 0;
    ex.launch(make_launch(gather_quantized_kernel(dtype_id(dtype), sides[side].format),
                          detail::grid_for(batch * n_tokens * g.n_heads, q.lanes, 1), q));
  }
}

}  // namespace cuda
}  // namespace pagedkv
