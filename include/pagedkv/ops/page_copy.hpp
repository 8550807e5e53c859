// Whole-page copies: every layer, k and v, of many pages in one call.
// Used by PagedCache::copy_pages / copy_pages_from (copy-on-write, and
// moving pages between a device cache and a host cache) and by
// SequenceTable.
//
// Callers check the lists (checks.hpp); this header chooses the path: a side that runs the
// CUDA kernels copies with them (cuda/page_copy.hpp: one kernel per page
// tensor, host <-> device through pinned memory); CPU -> CPU copies are
// hand-written (cpu/page_copy.hpp); any other device pair (or
// Backend::generic) takes the ATen path (generic/page_copy.hpp). Only the
// pages are copied: each page is moved as one batch, never with a host
// round trip per page.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "pagedkv/cpu/page_copy.hpp"
#include "pagedkv/cuda/page_copy.hpp"
#include "pagedkv/generic/page_copy.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/ops/storage.hpp"

namespace pagedkv {
namespace ops {

/// The page tensors of `s`, each with the geometry of one of its pages:
/// [k pages, v pages, k scales, v scales] (undefined scales for a native
/// side). Scales are seen as [n_layers, n_pages, <page of head_dim 1>].
inline std::vector<std::pair<at::Tensor, PageGeometry>> page_tensors(const Storage& s) {
  const auto scales = [&](const at::Tensor& t) {
    return t.defined() ? t.view({s.n_layers(), s.n_pages(), s.k.size(2), s.k.size(3), 1}) : t;
  };
  const PageGeometry sg = scale_geometry(s.geometry);
  return {{s.k, s.geometry}, {s.v, s.geometry}, {scales(s.k_scales), sg}, {scales(s.v_scales), sg}};
}

/// Copies validated lists: to[dst[i]] <- from[src[i]], i < n, every layer,
/// k and v (codes and scales). `to` and `from` may be the same storage;
/// `overlap`: some page is both read and written. Nothing here throws for
/// valid input (but a device error).
inline void copy_pages(const Storage& to, const Storage& from, const int64_t* src, const int64_t* dst, int64_t n,
                       bool overlap) {
  if (n == 0) return;
  const bool same_layout = to.same_layout_as(from);
  const Kernels to_kernels = kernels_for(to.device()), from_kernels = kernels_for(from.device());
  const bool to_cuda = to_kernels == Kernels::cuda, from_cuda = from_kernels == Kernels::cuda;
  if ((to_cuda || from_cuda) && cuda::copy_cache_pages(page_tensors(to), page_tensors(from), to_cuda, from_cuda,
                                                       to.n_layers(), src, dst, n, same_layout, overlap)) {
    return;  // a side runs the CUDA kernels
  }
  const bool cpu = to_kernels == Kernels::cpu && from_kernels == Kernels::cpu && !overlap;
  if (cpu && !is_quantized(to.quant)) {  // k and v in one pass
    const auto es = static_cast<int64_t>(to.k.element_size());
    const int64_t page_bytes = to.geometry.page_elems * es;
    const auto pages = [&](const Storage& s) {
      return cpu::CpuPages{static_cast<char*>(s.k.data_ptr()), static_cast<char*>(s.v.data_ptr()),
                           s.n_pages() * page_bytes, page_bytes, cpu::page_strides(s.geometry, es)};
    };
    const PageGeometry& g = to.geometry;
    cpu::copy_cpu(pages(to), pages(from), src, dst, n, to.n_layers(), cpu::BlockShape{g.page_size, g.n_heads,
                  g.head_dim, es}, same_layout);
    return;
  }
  const auto to_tensors = page_tensors(to);
  const auto from_tensors = page_tensors(from);
  for (size_t i = 0; i < to_tensors.size(); ++i) {
    const at::Tensor& t = to_tensors[i].first;
    const at::Tensor& f = from_tensors[i].first;
    if (!t.defined()) continue;
    if (!cpu) {
      generic::copy_generic(t, f, src, dst, n, same_layout);
      continue;
    }
    const PageGeometry& tg = to_tensors[i].second;
    const PageGeometry& fg = from_tensors[i].second;
    const auto es = static_cast<int64_t>(t.element_size());
    const int64_t page_bytes = tg.page_elems * es;
    cpu::copy_cpu_tensor({static_cast<char*>(t.data_ptr()), to.n_pages() * page_bytes, page_bytes,
                          cpu::page_strides(tg, es)},
                         {static_cast<char*>(f.data_ptr()), from.n_pages() * page_bytes, page_bytes,
                          cpu::page_strides(fg, es)},
                         src, dst, n, to.n_layers(), cpu::BlockShape{tg.page_size, tg.n_heads, tg.head_dim, es},
                         same_layout);
  }
}

}  // namespace ops
}  // namespace pagedkv
