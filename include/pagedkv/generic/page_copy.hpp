// Whole-page copies on any device pair (or under Backend::generic):
// index_select on the page dimension, transpose when the layouts differ,
// to(device), index_copy_; each list moves as one batch, never with a host
// round trip per page. The checks and the choice of path: page_copy.hpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "pagedkv/generic/write_gather.hpp"

namespace pagedkv {
namespace generic {

/// Device-agnostic: to[:, dst] = from[:, src] (relayout by transpose); the
/// index_select materialises every source page before any write, so
/// overlapping lists read the old contents.
inline void copy_generic(const at::Tensor& to, const at::Tensor& from, const int64_t* src, const int64_t* dst,
                         int64_t n, bool same_layout) {
  if (n == 0) return;
  const auto list = [n](const int64_t* ids, const at::Device& device) {
    return generic::host_index(std::vector<int64_t>(ids, ids + n), device);
  };
  at::Tensor pages = from.index_select(1, list(src, from.device()));
  // [L, n, a, b, D]: NHD pages are [P, H, D] and HND pages [H, P, D].
  if (!same_layout) pages = pages.transpose(2, 3).contiguous();
  if (pages.device() != to.device()) pages = pages.to(to.device());
  to.index_copy_(1, list(dst, to.device()), pages);
}

}  // namespace generic
}  // namespace pagedkv
