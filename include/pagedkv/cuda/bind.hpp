// What bind makes for a view of a cache that runs the CUDA kernels: the
// kernels its per-layer calls launch, loaded now (never inside a capture),
// and the snapshot and device copies of its page table and lengths
// (bound_tables.hpp), in the view's own memory or the cache's per-shape
// buffers that a captured CUDA graph reads.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "pagedkv/cuda/attention.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/cuda/executor.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "pagedkv/kv_format.hpp"

namespace pagedkv {
namespace cuda {

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

/// bind on a cache with CUDA kernels (validated, outside a capture): a
/// snapshot of the table (`host_table`, on the cpu) and lengths, and their
/// device copies, in memory of the view's own or (`per_shape`) the cache's
/// per-shape buffers (`sets`); the kernels its views launch, loaded. The
/// pool's epochs at bind tell a stale view later.
inline std::shared_ptr<BoundTables> bind_tables(const at::Device& device, at::ScalarType dtype,
                                                      const KVQuant& quant, int64_t head_dim, uint64_t alloc_epoch,
                                                      uint64_t free_epoch, BindBufferSets& sets,
                                                      const at::Tensor& host_table,
                                                      const std::vector<int64_t>* lengths, bool per_shape) {
  prepare(device, view_kernels(dtype, quant, head_dim));
  auto b = std::make_shared<BoundTables>();
  b->host_table = host_table.contiguous();
  if (b->host_table.data_ptr() == host_table.data_ptr()) b->host_table = b->host_table.clone();  // a snapshot
  if (lengths != nullptr) b->host_lengths = *lengths;
  const int64_t batch = host_table.size(0);
  const at::TensorOptions on = at::TensorOptions().device(device);
  if (per_shape) {
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
  b->alloc_epoch = alloc_epoch;
  b->free_epoch = free_epoch;
  return b;
}

}  // namespace cuda
}  // namespace pagedkv
