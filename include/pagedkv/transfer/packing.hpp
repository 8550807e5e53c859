// Packing a layer's pages (a head slice, in the sender's layout) into a
// message, and unpacking a staged payload into the receiver's fresh pages
// (any layout): native pages as [2, n, <page>] of the cache's dtype, caches
// with a quantized side as byte sections of codes and scales
// (transfer/wire.hpp). CPU caches copy with cpu::copy_block, other
// devices with ATen ops.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "pagedkv/cpu/copy.hpp"
#include "pagedkv/generic/write_gather.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/transfer/heads.hpp"
#include "pagedkv/transfer/wire.hpp"

namespace pagedkv {

namespace transfer {

/// Byte strides of one page of scales of `g` (a float32 per token and head,
/// in the order of the layout's head vectors).
inline cpu::BlockStrides scale_page_strides(const PageGeometry& g) {
  constexpr int64_t f = sizeof(float);
  return {g.token_stride / g.head_dim * f, g.head_stride / g.head_dim * f, f};
}

/// One side of a cache as the transfer copies it: a view of each page as
/// [page_size, heads, vector] blocks, `vector` elements of `elem_size` bytes
/// (head vectors of the pages, or a single scale).
struct SidePart {
  const at::Tensor* storage;  // [n_layers, n_pages, ...]: the pages, or the scales
  cpu::BlockStrides page; ///< byte strides of one page's block
  int64_t page_bytes;         ///< bytes between pages
  int64_t vector;             ///< elements per (token, head): head_dim, or 1 for scales
  int64_t elem_size;
  bool scales;                ///< the side's scales, not its pages
};

/// The parts of side kv (0: k, 1: v) of `cache`: its pages, then its scales
/// when it is quantized.
template <class Layout>
std::vector<SidePart> side_parts(const PagedCache<Layout>& cache, int kv) {
  const PageGeometry& g = cache.geometry();
  const at::Tensor& pages = kv == 0 ? cache.k_cache() : cache.v_cache();
  const at::Tensor& scales = kv == 0 ? cache.k_scales() : cache.v_scales();
  const auto es = static_cast<int64_t>(pages.element_size());
  const cpu::BlockStrides page = cpu::page_strides(g, es);
  std::vector<SidePart> parts{{&pages, page, g.page_elems * es, g.head_dim, es, false}};
  if (scales.defined()) {
    const cpu::BlockStrides scale = scale_page_strides(g);
    parts.push_back({&scales, scale, g.page_size * g.n_heads * static_cast<int64_t>(sizeof(float)), 1,
                     sizeof(float), true});
  }
  return parts;
}

/// Calls f(part, offset, bytes) for every part of `cache` (k pages, k
/// scales, v pages, v scales; scales of quantized sides only) with where it
/// lies in a message laid out as `sections`.
template <class Layout, class F>
void for_each_section(const PagedCache<Layout>& cache, const LayerSections& sections, F&& f) {
  for (int kv = 0; kv < 2; ++kv) {
    for (const SidePart& part : side_parts(cache, kv)) {
      if (part.scales) {
        f(part, sections.scales[kv], sections.scale_bytes[kv]);
      } else {
        f(part, sections.elements[kv], sections.element_bytes[kv]);
      }
    }
  }
}

/// Packs layer `layer`'s head slice of `pages` (k then v) into `chunk`
/// ([2, n, <sender page with width heads>], the cache's dtype and device).
template <class Layout>
void pack_layer(const PagedCache<Layout>& cache, int64_t layer, const std::vector<int64_t>& pages, HeadRange heads,
                const at::Tensor& chunk) {
  const int64_t n = static_cast<int64_t>(pages.size());
  const int64_t width = heads.end - heads.begin;
  const PageGeometry& g = cache.geometry();
  const at::Tensor caches[2] = {cache.k_cache(), cache.v_cache()};
  if (ops::use_cpu_kernels(cache.device())) {
    const int64_t es = static_cast<int64_t>(cache.k_cache().element_size());
    const int64_t page_bytes = g.page_elems * es;
    const int64_t layer_bytes = cache.n_pages() * page_bytes;
    const int64_t out_bytes = slice_bytes(g.page_size, width, g.head_dim, es);
    const cpu::BlockStrides from = cpu::page_strides(g, es);
    const cpu::BlockStrides to =
        transfer::wire::page_strides(transfer::wire::layout_code<Layout>(), g.page_size, width, g.head_dim, es);
    const cpu::BlockShape shape{g.page_size, width, g.head_dim, es};
    char* out = static_cast<char*>(chunk.data_ptr());
    // On the calling thread: the group's thread sends the previous layer
    // meanwhile, and a parallel region per layer stalls whenever a worker
    // is descheduled (bench/NOTES.md, "Transfer (issue 12)").
    for (int64_t item = 0; item < 2 * n; ++item) {
      const int64_t kv = item / n;
      const int64_t i = item % n;
      const char* src = static_cast<const char*>(caches[kv].data_ptr()) + layer * layer_bytes +
                        pages[static_cast<size_t>(i)] * page_bytes + heads.begin * g.head_stride * es;
      cpu::copy_block(out + item * out_bytes, to, src, from, shape);
    }
    return;
  }
  const at::Tensor index = generic::host_index(pages, cache.device());
  const int64_t head_axis = std::is_same<Layout, HND>::value ? 1 : 2;  // of [n, a, b, D]
  for (int kv = 0; kv < 2; ++kv) {
    chunk.select(0, kv).copy_(caches[kv].select(0, layer).index_select(0, index).narrow(head_axis, heads.begin, width));
  }
}

/// The bytes [offset, offset + bytes) of `message` (1-D kByte) as `dtype`
/// in `shape`; offset is a multiple of kSectionAlign.
inline at::Tensor section_of(const at::Tensor& message, int64_t offset, int64_t bytes, at::ScalarType dtype,
                             at::IntArrayRef shape) {
  return message.narrow(-1, offset, bytes).view(dtype).view(shape);
}

/// Packs layer `layer`'s head slice of `pages` of a cache with a quantized
/// side into `message` ([sections.bytes] kByte, on the cache's device): each
/// side's codes (or a native side's elements), then each quantized side's
/// scales, in the sender's layout, padding zeroed (transfer::wire).
template <class Layout>
void pack_layer_sections(const PagedCache<Layout>& cache, int64_t layer, const std::vector<int64_t>& pages,
                         HeadRange heads, const LayerSections& sections, const at::Tensor& message) {
  const auto n = static_cast<int64_t>(pages.size());
  const int64_t width = heads.end - heads.begin;
  const PageGeometry& g = cache.geometry();
  const int64_t code = transfer::wire::layout_code<Layout>();
  const bool cpu = ops::use_cpu_kernels(cache.device());
  const at::Tensor index = cpu ? at::Tensor() : generic::host_index(pages, cache.device());
  for_each_section(cache, sections, [&](const SidePart& part, int64_t offset, int64_t bytes) {
    message.narrow(0, offset + bytes, transfer::wire::padded(bytes) - bytes).zero_();
    if (cpu) {
      const cpu::BlockShape shape{g.page_size, width, part.vector, part.elem_size};
      const cpu::BlockStrides to =
          transfer::wire::page_strides(code, g.page_size, width, part.vector, part.elem_size);
      const int64_t out_bytes = slice_bytes(g.page_size, width, part.vector, part.elem_size);
      const char* layer_base =
          static_cast<const char*>(part.storage->data_ptr()) + layer * cache.n_pages() * part.page_bytes;
      char* out = static_cast<char*>(message.data_ptr()) + offset;
      for (int64_t i = 0; i < n; ++i) {  // on the calling thread, as pack_layer
        cpu::copy_block(out + i * out_bytes, to,
                            layer_base + pages[static_cast<size_t>(i)] * part.page_bytes +
                                heads.begin * part.page.head,
                            part.page, shape);
      }
      return;
    }
    const auto mine = Layout::page_shape(g.page_size, g.n_heads, part.vector);
    const auto sent = Layout::page_shape(g.page_size, width, part.vector);
    const int64_t head_axis = std::is_same<Layout, HND>::value ? 1 : 2;  // of [n, a, b, vector]
    section_of(message, offset, bytes, part.storage->scalar_type(), {n, sent[0], sent[1], sent[2]})
        .copy_(part.storage->select(0, layer)
                   .view({cache.n_pages(), mine[0], mine[1], mine[2]})
                   .index_select(0, index)
                   .narrow(head_axis, heads.begin, width));
  });
}

/// Copies the staged payload ([n_layers, 2, n, <page in layout `code`>])
/// into `pages` of `cache` (every layer, k and v; all of the cache's heads).
template <class Layout>
void unpack(PagedCache<Layout>& cache, const at::Tensor& staging, int64_t code, const std::vector<int64_t>& pages) {
  const int64_t n = static_cast<int64_t>(pages.size());
  if (n == 0) return;
  const PageGeometry& g = cache.geometry();
  const at::Tensor caches[2] = {cache.k_cache(), cache.v_cache()};
  const bool same_layout = code == transfer::wire::layout_code<Layout>();
  if (ops::use_cpu_kernels(cache.device()) && staging.device().is_cpu()) {
    const int64_t es = static_cast<int64_t>(cache.k_cache().element_size());
    const int64_t page_bytes = g.page_elems * es;
    const int64_t layer_bytes = cache.n_pages() * page_bytes;
    const cpu::BlockStrides from = transfer::wire::page_strides(code, g.page_size, g.n_heads, g.head_dim, es);
    const cpu::BlockStrides to = cpu::page_strides(g, es);
    const cpu::BlockShape shape{g.page_size, g.n_heads, g.head_dim, es};
    const char* in = static_cast<const char*>(staging.data_ptr());
    const int64_t items = cache.n_layers() * 2 * n;
    // The fresh pages are not read before the call returns: streaming
    // stores skip the read for ownership, as the cache writes do.
    const bool stream = cpu::use_streaming_stores(items * page_bytes, to, g, es);
    const auto run = [&](auto streaming, int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t layer = item / (2 * n);
        const int64_t kv = (item / n) % 2;
        const int64_t i = item % n;
        char* dst = static_cast<char*>(caches[kv].data_ptr()) + layer * layer_bytes +
                    pages[static_cast<size_t>(i)] * page_bytes;
        cpu::copy_block<decltype(streaming)::value>(dst, to, in + item * page_bytes, from, shape);
      }
    };
    cpu::parallel_copy(items, cpu::grain_for(page_bytes), stream, run);
    return;
  }
  const at::Tensor index = generic::host_index(pages, cache.device());
  for (int kv = 0; kv < 2; ++kv) {
    at::Tensor src = staging.select(1, kv);  // [L, n, a, b, D]
    if (!same_layout) src = src.transpose(2, 3);
    caches[kv].index_copy_(1, index, src.to(cache.device()));
  }
}

/// Copies the staged messages ([n_layers, sections.bytes] kByte, sent in
/// the layout `code`) of a cache with a quantized side into `pages` of
/// `cache` (every layer, k and v, codes and scales; all of its heads).
template <class Layout>
void unpack_sections(PagedCache<Layout>& cache, const at::Tensor& staging, int64_t code,
                     const LayerSections& sections, const std::vector<int64_t>& pages) {
  const auto n = static_cast<int64_t>(pages.size());
  if (n == 0) return;
  const PageGeometry& g = cache.geometry();
  const int64_t n_layers = cache.n_layers();
  const bool cpu = ops::use_cpu_kernels(cache.device()) && staging.device().is_cpu();
  const at::Tensor index = cpu ? at::Tensor() : generic::host_index(pages, cache.device());
  for_each_section(cache, sections, [&](const SidePart& part, int64_t offset, int64_t bytes) {
    if (cpu) {
      const cpu::BlockShape shape{g.page_size, g.n_heads, part.vector, part.elem_size};
      const cpu::BlockStrides from =
          transfer::wire::page_strides(code, g.page_size, g.n_heads, part.vector, part.elem_size);
      const int64_t in_bytes = slice_bytes(g.page_size, g.n_heads, part.vector, part.elem_size);
      const char* in = static_cast<const char*>(staging.data_ptr()) + offset;
      char* base = static_cast<char*>(part.storage->data_ptr());
      const auto run = [&](auto streaming, int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t layer = item / n;
          const int64_t i = item % n;
          char* dst = base + (layer * cache.n_pages() + pages[static_cast<size_t>(i)]) * part.page_bytes;
          cpu::copy_block<decltype(streaming)::value>(dst, part.page, in + layer * sections.bytes + i * in_bytes,
                                                          from, shape);
        }
      };
      // The fresh pages are not read before the call returns: their codes
      // stream where the native scatter's would (unpack).
      const bool stream =
          !part.scales && cpu::use_streaming_stores(n_layers * n * in_bytes, part.page, g, part.elem_size);
      cpu::parallel_copy(n_layers * n, cpu::grain_for(in_bytes), stream, run);
      return;
    }
    const auto sent = code == 1 ? HND::page_shape(g.page_size, g.n_heads, part.vector)
                                : NHD::page_shape(g.page_size, g.n_heads, part.vector);
    const auto mine = Layout::page_shape(g.page_size, g.n_heads, part.vector);
    at::Tensor src =
        section_of(staging, offset, bytes, part.storage->scalar_type(), {n_layers, n, sent[0], sent[1], sent[2]});
    if (code != transfer::wire::layout_code<Layout>()) src = src.transpose(2, 3);
    part.storage->view({n_layers, cache.n_pages(), mine[0], mine[1], mine[2]})
        .index_copy_(1, index, src.to(cache.device()));
  });
}

}  // namespace transfer

}  // namespace pagedkv
