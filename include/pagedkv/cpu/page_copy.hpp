// Whole-page copies between CPU caches (PagedCache::copy_pages /
// copy_pages_from, SequenceTable's copy-on-write and swaps): one memcpy per
// (layer, page) when both caches store pages in the same layout, a strided
// per-page relayout copy (cpu::copy_block) when they differ; parallel
// over (page, layer). The checks and the choice of path: page_copy.hpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "pagedkv/cpu/copy.hpp"

namespace pagedkv {
namespace cpu {

/// CPU pages of one cache as raw bytes.
struct CpuPages {
  char* k;
  char* v;
  int64_t layer_bytes;  ///< bytes between layers
  int64_t page_bytes;   ///< bytes between pages
  cpu::BlockStrides strides;  ///< inside a page
};

template <class Cache>
CpuPages cpu_pages(const Cache& cache) {
  const int64_t es = static_cast<int64_t>(cache.k_cache().element_size());
  const int64_t page_bytes = cache.geometry().page_elems * es;
  return {static_cast<char*>(cache.k_cache().data_ptr()), static_cast<char*>(cache.v_cache().data_ptr()),
          cache.n_pages() * page_bytes, page_bytes, cpu::page_strides(cache.geometry(), es)};
}

/// dst_pages[dst[i]] <- src_pages[src[i]], i < n, for every layer, k and
/// v. Pages must not overlap (a page both read and written).
inline void copy_cpu(const CpuPages& to, const CpuPages& from, const int64_t* src, const int64_t* dst, int64_t n,
                     int64_t n_layers, const cpu::BlockShape& shape, bool same_layout) {
  if (n == 0) return;
  const int64_t page_bytes = to.page_bytes;
  auto copy_range = [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t layer = item / n;
      const int64_t i = item % n;
      const int64_t from_off = layer * from.layer_bytes + src[i] * from.page_bytes;
      const int64_t to_off = layer * to.layer_bytes + dst[i] * to.page_bytes;
      if (same_layout) {
        std::memcpy(to.k + to_off, from.k + from_off, static_cast<size_t>(page_bytes));
        std::memcpy(to.v + to_off, from.v + from_off, static_cast<size_t>(page_bytes));
      } else {
        cpu::copy_block(to.k + to_off, to.strides, from.k + from_off, from.strides, shape);
        cpu::copy_block(to.v + to_off, to.strides, from.v + from_off, from.strides, shape);
      }
    }
  };
  const int64_t grain = cpu::grain_for(2 * page_bytes);
  if (n * n_layers <= grain) {
    copy_range(0, n * n_layers);  // one chunk: skip the thread pool (copy-on-write of one page)
  } else {
    at::parallel_for(0, n * n_layers, grain, copy_range);
  }
}

/// One of a cache's page tensors ([n_layers, n_pages, ...]) as raw bytes:
/// codes, native elements or scales of one side.
struct CpuTensorPages {
  char* data;
  int64_t layer_bytes;            ///< bytes between layers
  int64_t page_bytes;             ///< bytes between pages
  cpu::BlockStrides strides;  ///< inside a page
};

/// to[dst[i]] <- from[src[i]], i < n, every layer, for one page tensor of
/// each cache (a quantized cache copies codes and scales of each side this
/// way). Pages must not overlap.
inline void copy_cpu_tensor(const CpuTensorPages& to, const CpuTensorPages& from, const int64_t* src,
                            const int64_t* dst, int64_t n, int64_t n_layers, const cpu::BlockShape& shape,
                            bool same_layout) {
  if (n == 0) return;
  auto copy_range = [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t layer = item / n;
      const int64_t i = item % n;
      char* out = to.data + layer * to.layer_bytes + dst[i] * to.page_bytes;
      const char* in = from.data + layer * from.layer_bytes + src[i] * from.page_bytes;
      if (same_layout) {
        std::memcpy(out, in, static_cast<size_t>(to.page_bytes));
      } else {
        cpu::copy_block(out, to.strides, in, from.strides, shape);
      }
    }
  };
  const int64_t grain = cpu::grain_for(to.page_bytes);
  if (n * n_layers <= grain) {
    copy_range(0, n * n_layers);
  } else {
    at::parallel_for(0, n * n_layers, grain, copy_range);
  }
}

}  // namespace cpu
}  // namespace pagedkv
