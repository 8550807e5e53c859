// Whole-page copies on the CUDA path: the launch of the copy kernel
// between caches on one CUDA device (or a cache and a staging buffer of
// contiguous pages): every layer of one page tensor (codes or native
// elements of a side, or its scales), in one kernel, relaid out through
// strides when the layouts differ; and the copies between a device cache
// and a host cache, staged through pinned memory.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/cuda/executor.hpp"
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
  params::CopyParams p{};
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

/// A cache's page tensors ([n_layers, n_pages, <page>]: k and v pages,
/// k and v scales, undefined where a side has none), each with the geometry
/// of one page (ops::page_tensors).
using PageTensors = std::vector<std::pair<at::Tensor, PageGeometry>>;

inline PageTensor page_tensor(const at::Tensor& t, const PageGeometry& g) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  return {t.data_ptr(), t.stride(0) * es, es, g};
}

/// ops::copy_pages's copies when a side runs the CUDA kernels
/// (`to_cuda`, `from_cuda`: ops::use_cuda_kernels of each side):
/// to[dst[i]] <- from[src[i]], i < n, every page tensor, every layer (ids
/// validated, on the host). Within one device, one kernel per page tensor
/// (through a staging buffer when the lists overlap); host -> device, the
/// pages gathered on the host into pinned memory, uploaded on the current
/// stream, scattered by a kernel; device -> host, gathered by a kernel,
/// copied back (a wait for the device: the host needs the bytes), scattered
/// on the host. Returns false, copying nothing, for other device pairs.
inline bool copy_cache_pages(const PageTensors& to, const PageTensors& from, bool to_cuda, bool from_cuda,
                             int64_t n_layers, const int64_t* src, const int64_t* dst, int64_t n, bool same_layout,
                             bool overlap) {
  const at::Device to_device = to[0].first.device(), from_device = from[0].first.device();
  const bool same_device = to_cuda && from_device == to_device;
  const bool upward = to_cuda && to_device.is_cuda() && from_device.is_cpu();
  const bool downward = from_cuda && from_device.is_cuda() && to_device.is_cpu();
  if (!same_device && !upward && !downward) return false;
  if (n == 0) return true;
  const at::Device device = downward ? from_device : to_device;
  Executor& ex = executor_for(device);
  const at::Tensor src_host = host_int64(std::vector<int64_t>(src, src + n));
  const at::Tensor dst_host = host_int64(std::vector<int64_t>(dst, dst + n));
  const at::Tensor src_ids = same_device || downward ? on_device(src_host, device) : at::Tensor();
  const at::Tensor dst_ids = same_device || upward ? on_device(dst_host, device) : at::Tensor();
  for (size_t i = 0; i < to.size(); ++i) {
    const at::Tensor& t = to[i].first;
    const at::Tensor& f = from[i].first;
    if (!t.defined()) continue;
    const PageTensor to_pages = page_tensor(t, to[i].second);
    const PageTensor from_pages = page_tensor(f, from[i].second);
    const int64_t page_bytes = to[i].second.page_elems * to_pages.elem_size;
    // A staging buffer of n pages per layer, in `g`'s layout, on `where`.
    const auto staging = [&](const at::Device& where, const PageGeometry& g) {
      at::Tensor buffer = at::empty({n_layers, n, page_bytes}, at::TensorOptions().dtype(at::kByte).device(where));
      return std::make_pair(buffer, PageTensor{buffer.data_ptr(), n * page_bytes, to_pages.elem_size, g});
    };
    if (same_device && !overlap) {
      copy_pages(ex, to_pages, from_pages, src_ids.data_ptr<int64_t>(), dst_ids.data_ptr<int64_t>(), n, n_layers,
                 same_layout);
    } else if (same_device) {  // every page read before any is written
      const auto stage = staging(device, from[i].second);
      copy_pages(ex, stage.second, from_pages, src_ids.data_ptr<int64_t>(), nullptr, n, n_layers, true);
      copy_pages(ex, to_pages, stage.second, nullptr, dst_ids.data_ptr<int64_t>(), n, n_layers, same_layout);
    } else if (upward) {
      const at::Tensor host = at::empty({n_layers, n, page_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      for (int64_t layer = 0; layer < n_layers; ++layer) {
        for (int64_t j = 0; j < n; ++j) {
          std::memcpy(host.data_ptr<uint8_t>() + (layer * n + j) * page_bytes,
                      static_cast<const char*>(from_pages.data) + layer * from_pages.layer_bytes + src[j] * page_bytes,
                      static_cast<size_t>(page_bytes));
        }
      }
      const auto stage = staging(device, from[i].second);
      stage.first.copy_(host, /*non_blocking=*/true);
      copy_pages(ex, to_pages, stage.second, nullptr, dst_ids.data_ptr<int64_t>(), n, n_layers, same_layout);
    } else {  // downward
      const auto stage = staging(device, to[i].second);
      copy_pages(ex, stage.second, from_pages, src_ids.data_ptr<int64_t>(), nullptr, n, n_layers, same_layout);
      const at::Tensor host = stage.first.cpu();
      for (int64_t layer = 0; layer < n_layers; ++layer) {
        for (int64_t j = 0; j < n; ++j) {
          std::memcpy(static_cast<char*>(to_pages.data) + layer * to_pages.layer_bytes + dst[j] * page_bytes,
                      host.data_ptr<uint8_t>() + (layer * n + j) * page_bytes, static_cast<size_t>(page_bytes));
        }
      }
    }
  }
  return true;
}

}  // namespace cuda
}  // namespace pagedkv
