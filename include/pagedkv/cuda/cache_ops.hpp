// What PagedCache does on a cache that runs the CUDA kernels (or, in
// tests, a CPU cache under a ScopedExecutor), below its checks: the device
// copies bind makes, and the launches of a layer's write and gather (the
// launch planners of write_gather.hpp, given a cache's tensors). Callers
// validate first (paged_cache.hpp, attention.hpp); nothing here reads
// device memory on the host or waits for the device.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "pagedkv/cuda/attention.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/cuda/executor.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace cuda {

/// Layer `layer`'s K and V sides of `cache`.
template <class Cache>
void cache_sides(const Cache& cache, int64_t layer, Side (&sides)[2]) {
  sides[0] = {pages_ref(cache.k_cache(), cache.k_scales(), layer, cache.geometry()), cache.quant().k};
  sides[1] = {pages_ref(cache.v_cache(), cache.v_scales(), layer, cache.geometry()), cache.quant().v};
}

/// The kernels a cache of `dtype`, `quant` and `head_dim` launches from its
/// views' per-layer calls (bind loads them, so that none is compiled then).
inline std::vector<KernelKey> view_kernels(at::ScalarType dtype, const KVQuant& quant, int64_t head_dim) {
  std::vector<KernelKey> out;
  const bool native = !is_quantized(quant.k) || !is_quantized(quant.v);
  if (native) {
    out.push_back(write_native_kernel());
    out.push_back(gather_native_kernel());
  }
  const int dt = dtype_id(dtype);
  for (const KVFormat f : {quant.k, quant.v}) {
    if (!is_quantized(f)) continue;
    out.push_back(write_quantized_kernel(dt, f));
    out.push_back(gather_quantized_kernel(dt, f));
  }
  if (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) {
    if (quant.k == quant.v && head_dim <= kMaxHeadDim) {
      for (const int tile : {1, 2, 4, 8}) {
        out.push_back(attention_decode_kernel(dt, quant.k, static_cast<int>(head_dim), tile));
      }
    }
    out.push_back(attention_prefill_kernel());
    out.push_back(attention_merge_kernel());
  }
  std::sort(out.begin(), out.end(), [](const KernelKey& a, const KernelKey& b) { return a.name() < b.name(); });
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

/// Launches the write of k, v [B, S, H, D] into layer `layer` (validated).
template <class Cache>
void write_layer(const Cache& cache, int64_t layer, const kernel_params::TableRef& table, const Starts& starts,
                 const at::Tensor& k, const at::Tensor& v) {
  Side sides[2];
  cache_sides(cache, layer, sides);
  write(executor_for(cache.device()), table, starts, k, v, sides, cache.geometry(), cache.dtype(), cache.n_pages());
}

/// Launches the gather of layer `layer` into new [B, n_tokens, H, D]
/// tensors: positions [0, lengths[b]) (on the device) or [0, length).
template <class Cache>
std::pair<at::Tensor, at::Tensor> gather_layer(const Cache& cache, int64_t layer,
                                               const kernel_params::TableRef& table, const int64_t* lengths,
                                               int64_t length, int64_t n_tokens) {
  const at::TensorOptions options = cache.k_cache().options().dtype(cache.dtype());
  at::Tensor k = at::empty({table.rows, n_tokens, cache.n_kv_heads(), cache.head_dim()}, options);
  at::Tensor v = at::empty({table.rows, n_tokens, cache.n_kv_heads(), cache.head_dim()}, options);
  Side sides[2];
  cache_sides(cache, layer, sides);
  gather(executor_for(cache.device()), table, lengths, length, sides, k, v, cache.geometry(), cache.dtype(),
         cache.n_pages());
  return {k, v};
}

/// bind on a cache with CUDA kernels (validated, outside a capture): a
/// snapshot of the table (`host_table`, on the cpu) and lengths, and their
/// device copies, in memory of the view's own or the cache's per-shape
/// buffers (`sets`); the kernels its views launch, loaded.
template <class Cache>
std::shared_ptr<BoundTables> bind_tables(const Cache& cache, BindBufferSets& sets, const at::Tensor& host_table,
                                         const std::vector<int64_t>* lengths, BindBuffers buffers) {
  const at::Device device = cache.device();
  prepare(device, view_kernels(cache.dtype(), cache.quant(), cache.head_dim()));
  auto b = std::make_shared<BoundTables>();
  b->host_table = host_table.contiguous();
  if (b->host_table.data_ptr() == host_table.data_ptr()) b->host_table = b->host_table.clone();  // a snapshot
  if (lengths != nullptr) b->host_lengths = *lengths;
  const int64_t batch = host_table.size(0);
  const at::TensorOptions on = at::TensorOptions().device(device);
  if (buffers == BindBuffers::per_shape) {
    std::shared_ptr<BindBufferSet>& set =
        sets[BindShape{batch, host_table.size(1), static_cast<int>(host_table.scalar_type())}];
    if (!set) {
      set = std::make_shared<BindBufferSet>();
      set->table = at::empty(host_table.sizes(), on.dtype(host_table.scalar_type()));
      set->lengths = at::empty({batch}, on.dtype(at::kLong));
    }
    b->device_table = set->table;
    b->device_lengths = set->lengths;
    b->buffers = set;
    b->generation = ++set->generation;
  } else {
    b->device_table = at::empty(host_table.sizes(), on.dtype(host_table.scalar_type()));
    if (lengths != nullptr) b->device_lengths = at::empty({batch}, on.dtype(at::kLong));
  }
  upload(b->device_table, b->host_table);
  if (lengths != nullptr) upload(b->device_lengths, host_int64(*lengths));
  b->alloc_epoch = cache.pool().alloc_epoch();
  b->free_epoch = cache.pool().free_epoch();
  return b;
}

}  // namespace cuda
}  // namespace pagedkv
