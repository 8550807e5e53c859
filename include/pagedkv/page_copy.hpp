// Whole-page copies: every layer, k and v, of many pages in one call.
// Used by PagedCache::copy_pages / copy_pages_from (copy-on-write, and
// moving pages between a device cache and a host cache) and by
// SequenceTable.
//
// This header checks the lists and chooses the path: a side that runs the
// CUDA kernels copies with them (cuda/page_copy.hpp: one kernel per page
// tensor, host <-> device through pinned memory); CPU -> CPU copies are
// hand-written (cpu/page_copy.hpp); any other device pair (or
// Backend::generic) takes the ATen path (generic/page_copy.hpp). Only the
// pages are copied: each page is moved as one batch, never with a host
// round trip per page.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/cpu/page_copy.hpp"
#include "pagedkv/cuda/page_copy.hpp"
#include "pagedkv/generic/page_copy.hpp"
#include "pagedkv/kernels.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_pool.hpp"

namespace pagedkv {

template <class Layout>
class PagedCache;

namespace page_copy {

/// A 1-D int32/int64 list of page ids on the cpu or one of `devices`,
/// copied to the host (values not yet range-checked).
inline std::vector<int64_t> page_list(const checks::Caller& caller, const char* arg, const at::Tensor& t,
                                      const at::Device& device_a, const at::Device& device_b) {
  TORCH_CHECK(t.defined(), caller, ": argument '", arg, "' expected a tensor, got an undefined one");
  TORCH_CHECK(t.dim() == 1, caller, ": argument '", arg, "' expected 1-D [n_pages_to_copy], got ", t.dim(),
              "-D with shape ", t.sizes());
  TORCH_CHECK(checks::is_index_type(t.scalar_type()), caller, ": argument '", arg,
              "' expected dtype int32 or int64, got ", t.scalar_type());
  if (device_a == device_b) {
    checks::host_or_cache_device(caller, arg, t, device_a);
  } else {
    TORCH_CHECK(t.device().is_cpu() || t.device() == device_a || t.device() == device_b, caller, ": argument '", arg,
                "' expected on cpu, ", device_a, " or ", device_b, ", got ", t.device());
  }
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + host.numel());
}

/// Every id of `pages` is in range and allocated in `pool`.
inline void allocated_pages(const checks::Caller& caller, const char* arg, const std::vector<int64_t>& pages,
                            const PagePool& pool) {
  for (size_t i = 0; i < pages.size(); ++i) {
    const int64_t page = pages[i];
    TORCH_CHECK_INDEX(page >= 0 && page < pool.n_pages(), caller, ": argument '", arg, "' expected page ids in [0, ",
                      pool.n_pages(), "), got ", arg, "[", i, "] = ", page, page == kUnmappedPage ? " (unmapped)" : "");
    TORCH_CHECK(pool.is_allocated(page), caller, ": argument '", arg, "' expected allocated pages, got ", arg, "[", i,
                "] = ", page, " which is free (use after free)");
  }
}

/// The checks every page copy makes: equal lengths, src allocated in the
/// source pool, dst allocated, distinct and not shared in the destination
/// pool. Returns whether some page is both read and written (only possible
/// within one cache).
inline bool copy_lists(const checks::Caller& caller, const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                       const PagePool& src_pool, const PagePool& dst_pool) {
  TORCH_CHECK(src.size() == dst.size(), caller, ": arguments 'src' and 'dst' expected the same length, got ",
              src.size(), " and ", dst.size());
  allocated_pages(caller, "src", src, src_pool);
  allocated_pages(caller, "dst", dst, dst_pool);
  for (size_t i = 0; i < dst.size(); ++i) {
    const int64_t refs = dst_pool.ref_count(dst[i]);
    TORCH_CHECK(refs == 1, caller, ": argument 'dst' expected pages with ref_count 1, got dst[", i, "] = ", dst[i],
                " with ref_count ", refs, " (a copy onto a shared page; copy it to a fresh page first)");
  }
  std::vector<int64_t> sorted(dst);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_CHECK(dup == sorted.end(), caller, ": argument 'dst' expected distinct pages, got page ",
              dup == sorted.end() ? int64_t{0} : *dup, " more than once");
  if (&src_pool != &dst_pool) return false;
  return std::any_of(src.begin(), src.end(),
                     [&](int64_t page) { return std::binary_search(sorted.begin(), sorted.end(), page); });
}

/// The page tensors of a cache with a quantized side, each with the
/// geometry of one of its pages: [k pages, v pages, k scales, v scales]
/// (undefined scales for a native side). Scales are seen as
/// [n_layers, n_pages, <page of head_dim 1>].
template <class Layout>
std::vector<std::pair<at::Tensor, PageGeometry>> page_tensors(const PagedCache<Layout>& cache) {
  const PageGeometry& g = cache.geometry();
  const auto page = Layout::page_shape(g.page_size, g.n_heads, 1);
  const auto scales = [&](const at::Tensor& t) {
    return t.defined() ? t.view({cache.n_layers(), cache.n_pages(), page[0], page[1], 1}) : t;
  };
  const PageGeometry sg = quant_kernels::scale_geometry(g);
  return {{cache.k_cache(), g}, {cache.v_cache(), g}, {scales(cache.k_scales()), sg}, {scales(cache.v_scales()), sg}};
}

/// Copies validated lists: to[dst[i]] <- from[src[i]], i < n. Nothing here
/// throws for valid input (but a device error). `to` and `from` may be the
/// same cache; `overlap`: some page is both read and written.
template <class ToLayout, class FromLayout>
void copy_unchecked(const PagedCache<ToLayout>& to, const PagedCache<FromLayout>& from, const int64_t* src,
                    const int64_t* dst, int64_t n, bool overlap) {
  if (n == 0) return;
  constexpr bool same_layout = std::is_same<ToLayout, FromLayout>::value;
  const bool to_cuda = kernels::use_cuda_kernels(to.device()), from_cuda = kernels::use_cuda_kernels(from.device());
  if ((to_cuda || from_cuda) && cuda::copy_cache_pages(page_tensors(to), page_tensors(from), to_cuda, from_cuda,
                                                       to.n_layers(), src, dst, n, same_layout, overlap)) {
    return;  // a side runs the CUDA kernels
  }
  const bool cpu = kernels::use_cpu_kernels(to.device()) && kernels::use_cpu_kernels(from.device());
  if (is_quantized(to.quant())) {  // same_geometry: from has the same formats
    const auto to_tensors = page_tensors(to);
    const auto from_tensors = page_tensors(from);
    for (size_t i = 0; i < to_tensors.size(); ++i) {
      const at::Tensor& t = to_tensors[i].first;
      const at::Tensor& f = from_tensors[i].first;
      if (!t.defined()) continue;
      if (!cpu || overlap) {
        copy_generic(t, f, src, dst, n, same_layout);
        continue;
      }
      const PageGeometry& tg = to_tensors[i].second;
      const PageGeometry& fg = from_tensors[i].second;
      const auto es = static_cast<int64_t>(t.element_size());
      const int64_t page_bytes = tg.page_elems * es;
      copy_cpu_tensor({static_cast<char*>(t.data_ptr()), to.n_pages() * page_bytes, page_bytes,
                       kernels::page_strides(tg, es)},
                      {static_cast<char*>(f.data_ptr()), from.n_pages() * page_bytes, page_bytes,
                       kernels::page_strides(fg, es)},
                      src, dst, n, to.n_layers(), kernels::BlockShape{tg.page_size, tg.n_heads, tg.head_dim, es},
                      same_layout);
    }
    return;
  }
  if (cpu && !overlap) {
    const PageGeometry& g = to.geometry();
    const kernels::BlockShape shape{g.page_size, g.n_heads, g.head_dim,
                                    static_cast<int64_t>(to.k_cache().element_size())};
    copy_cpu(cpu_pages(to), cpu_pages(from), src, dst, n, to.n_layers(), shape, same_layout);
    return;
  }
  copy_generic(to.k_cache(), from.k_cache(), src, dst, n, same_layout);
  copy_generic(to.v_cache(), from.v_cache(), src, dst, n, same_layout);
}

template <class ToLayout, class FromLayout>
void copy_unchecked(const PagedCache<ToLayout>& to, const PagedCache<FromLayout>& from,
                    const std::vector<int64_t>& src, const std::vector<int64_t>& dst, bool overlap) {
  copy_unchecked(to, from, src.data(), dst.data(), static_cast<int64_t>(src.size()), overlap);
}

/// The same geometry and dtype.
template <class ToLayout, class FromLayout>
void same_geometry(const checks::Caller& caller, const PagedCache<ToLayout>& to, const PagedCache<FromLayout>& from) {
  TORCH_CHECK(to.n_layers() == from.n_layers() && to.page_size() == from.page_size() &&
                  to.n_kv_heads() == from.n_kv_heads() && to.head_dim() == from.head_dim(),
              caller, ": argument 'other' expected the same geometry (n_layers, page_size, n_kv_heads, head_dim) = (",
              to.n_layers(), ", ", to.page_size(), ", ", to.n_kv_heads(), ", ", to.head_dim(), "), got (",
              from.n_layers(), ", ", from.page_size(), ", ", from.n_kv_heads(), ", ", from.head_dim(), ")");
  TORCH_CHECK(to.dtype() == from.dtype(), caller, ": argument 'other' expected dtype ", to.dtype(),
              " (this cache's), got ", from.dtype());
  TORCH_CHECK(to.quant() == from.quant(), caller, ": argument 'other' expected formats (K ", format_name(to.quant().k),
              ", V ", format_name(to.quant().v), ") (this cache's), got (K ", format_name(from.quant().k), ", V ",
              format_name(from.quant().v), ")");
}

/// Validates and copies: to[dst[i]] <- from[src[i]].
template <class ToLayout, class FromLayout>
void copy_checked(const checks::Caller& caller, const PagedCache<ToLayout>& to, const PagedCache<FromLayout>& from,
                  const at::Tensor& src, const at::Tensor& dst) {
  same_geometry(caller, to, from);
  const std::vector<int64_t> src_pages = page_list(caller, "src", src, from.device(), to.device());
  const std::vector<int64_t> dst_pages = page_list(caller, "dst", dst, to.device(), from.device());
  const bool overlap = copy_lists(caller, src_pages, dst_pages, from.pool(), to.pool());
  copy_unchecked(to, from, src_pages, dst_pages, overlap);
}

}  // namespace page_copy
}  // namespace pagedkv
