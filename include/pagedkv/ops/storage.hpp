// What every operation of ops/ receives: the cache's pages (Storage), the
// page table of the call (Table) and its positions. PagedCache, a view and
// the Python ops each describe their input this way after validating it,
// so that one entry point per operation serves all of them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"

namespace pagedkv {
namespace ops {

/// A cache's pages: K and V [n_layers, n_pages, <page>] in the cache's
/// dtype or as codes, with float32 scales for a quantized side.
struct Storage {
  at::Tensor k;           ///< [n_layers, n_pages, <page>]
  at::Tensor v;           ///< [n_layers, n_pages, <page>]
  at::Tensor k_scales;    ///< [n_layers, n_pages, page_size * n_kv_heads] float32; undefined for native K
  at::Tensor v_scales;    ///< as k_scales for V
  KVQuant quant;          ///< how K and V are stored
  PageGeometry geometry;  ///< one page, the layout resolved into strides
  at::ScalarType dtype;   ///< what a write takes, a gather returns and attention reads

  int64_t n_layers() const { return k.size(0); }
  int64_t n_pages() const { return k.size(1); }
  at::Device device() const { return k.device(); }
  /// Pages of `other` have this storage's memory order (NHD and HND differ).
  bool same_layout_as(const Storage& other) const {
    return geometry.token_stride == other.geometry.token_stride && geometry.head_stride == other.geometry.head_stride;
  }
};

/// The page table of one call, validated: on the host for the checks and
/// the CPU kernels, and where the other kernels read it.
struct Table {
  at::Tensor given;  ///< [B, max_pages] int32/int64 as the caller passed it: on the cpu or the storage's device
  at::Tensor host;   ///< the same on the cpu (`given` itself, a copy, or bind's snapshot)
  /// A view bound for the CUDA kernels: bind's device copies of the table and
  /// its lengths, which the kernels read instead of uploading; else null.
  const cuda::BoundTables* bound = nullptr;

  int64_t rows() const { return host.size(0); }
};

/// Where a write puts token s of row b: starts[b] + s.
struct WriteStarts {
  std::vector<int64_t> starts;  ///< [B], on the host
  /// The caller gave one start for every row (the CUDA kernels take it as a
  /// launch argument, which a captured graph keeps).
  bool one_start = false;
  /// starts[b] = the bound lengths[b] - S (the CUDA kernels read the bound
  /// lengths on the device, which a replayed graph sees change).
  bool bound_tail = false;
};

}  // namespace ops
}  // namespace pagedkv
