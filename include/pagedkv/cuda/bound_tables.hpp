// What bind keeps for a view of a cache that runs the CUDA kernels: host
// snapshots of the page table and lengths (every later check reads these,
// so no per-layer call copies device memory to the host) and their device
// copies (the kernels read these), plus what tells a stale view: the pool's
// epochs at bind, and, for a bind into a cache's per-shape buffers (the
// memory a captured CUDA graph reads), the buffers' generation.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

namespace pagedkv {

namespace cuda {

/// Device memory a cache keeps for per_shape binds of one shape.
struct BindBufferSet {
  at::Tensor table;          ///< [B, max_pages], the table's dtype
  at::Tensor lengths;        ///< [B] int64
  uint64_t generation = 0;   ///< bumped by every bind into the set
};

/// The key of a per_shape buffer set: (B, max_pages, table dtype).
using BindShape = std::tuple<int64_t, int64_t, int>;

/// A cache's per_shape buffer sets.
using BindBufferSets = std::map<BindShape, std::shared_ptr<BindBufferSet>>;

/// The state of a view bound on a cache with CUDA kernels.
struct BoundTables {
  at::Tensor host_table;              ///< [B, max_pages] on the cpu: bind's snapshot
  std::vector<int64_t> host_lengths;  ///< [B] (views bound with lengths)
  at::Tensor device_table;            ///< [B, max_pages] on the cache's device
  at::Tensor device_lengths;          ///< [B] int64 on the cache's device (views bound with lengths)
  uint64_t alloc_epoch = 0;           ///< the pool's at bind
  uint64_t free_epoch = 0;            ///< the pool's at bind
  std::shared_ptr<BindBufferSet> buffers;  ///< per_shape binds: the set written into; else null
  uint64_t generation = 0;            ///< the set's generation this bind made
  bool leading_unmapped = false;      ///< some row has -1 columns before its length (a windowed table's rows)
};

/// dst <- host (a contiguous cpu tensor of dst's shape and dtype). For a
/// CUDA dst through pinned staging memory (torch's caching host allocator)
/// and a copy on the current stream: ordered after earlier work on the
/// stream, with no wait for the device. On the cpu, at once.
inline void upload(const at::Tensor& dst, const at::Tensor& host) {
  if (!dst.is_cuda()) {
    dst.copy_(host);
    return;
  }
  at::Tensor staging = at::empty(host.sizes(), host.options().pinned_memory(true));
  staging.copy_(host);
  dst.copy_(staging, /*non_blocking=*/true);
}

/// `t` on `device`: t itself when it is there, else a copy (upload()).
inline at::Tensor on_device(const at::Tensor& t, const at::Device& device) {
  if (t.device() == device) return t;
  at::Tensor out = at::empty(t.sizes(), t.options().device(device));
  upload(out, t.contiguous());
  return out;
}

/// A contiguous cpu int64 tensor holding `values`.
inline at::Tensor host_int64(const std::vector<int64_t>& values) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  return t;
}

}  // namespace cuda
}  // namespace pagedkv
