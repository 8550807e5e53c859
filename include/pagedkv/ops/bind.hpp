// The page table an operation reads, and what bind prepares for it: on a
// cache that runs the CUDA kernels, bind validates the table and lengths
// once and keeps a host snapshot with device copies (cuda/bind.hpp), which
// the view's calls then read; everywhere else a call reads the caller's
// table itself.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "pagedkv/cuda/bind.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/ops/storage.hpp"

namespace pagedkv {
namespace ops {

/// Whether bind on storage `s` makes device copies (its kernels are CUDA's).
inline bool bind_copies_tables(const Storage& s) { return kernels_for(s.device()) == Kernels::cuda; }

/// bind's device copies for storage `s` (validated input, outside a CUDA
/// graph capture); null where the kernels read the caller's table.
inline std::shared_ptr<cuda::BoundTables> bind_tables(const Storage& s, uint64_t alloc_epoch, uint64_t free_epoch,
                                                      cuda::BindBufferSets& sets, const at::Tensor& host_table,
                                                      const std::vector<int64_t>* lengths, bool per_shape) {
  if (!bind_copies_tables(s)) return nullptr;
  return cuda::bind_tables(s.device(), s.dtype, s.quant, s.geometry.head_dim, alloc_epoch, free_epoch, sets,
                           host_table, lengths, per_shape);
}

/// The table a call on `s` reads: a bound view's snapshot and device copies
/// (`bound`, while the CUDA kernels run; a view bound for them and used
/// without them reads its table as any view does), else `page_table`
/// itself, copied to the host when it is on the device.
inline Table table_of(const Storage& s, const at::Tensor& page_table, const cuda::BoundTables* bound) {
  if (bound != nullptr && bind_copies_tables(s)) return {page_table, bound->host_table, bound};
  return {page_table, page_table.device().is_cpu() ? page_table : page_table.to(at::kCPU), nullptr};
}

}  // namespace ops
}  // namespace pagedkv
