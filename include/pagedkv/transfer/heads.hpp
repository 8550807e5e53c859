// Tensor parallelism across a transfer: the kv heads a rank of a TP group
// holds, and which sender rank sends which heads to which receiver when the
// two sides' TP degrees differ (send_pages' HeadRange).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

#include "pagedkv/checks.hpp"

namespace pagedkv {

/// A range [begin, end) of kv heads; end = -1 means every head.
struct HeadRange {
  int64_t begin = 0;
  int64_t end = -1;
};

/// The kv heads rank `tp_rank` of a tensor-parallel group of `tp_size`
/// ranks holds: n_kv_heads / tp_size consecutive heads when tp_size divides
/// n_kv_heads; when tp_size > n_kv_heads (a multiple of it), each head is
/// replicated on tp_size / n_kv_heads consecutive ranks and a rank holds one.
inline HeadRange tp_head_range(int64_t n_kv_heads, int64_t tp_size, int64_t tp_rank) {
  const checks::Caller caller{"tp_head_range", nullptr, nullptr};
  checks::positive(caller, "n_kv_heads", n_kv_heads);
  checks::positive(caller, "tp_size", tp_size);
  TORCH_CHECK_INDEX(tp_rank >= 0 && tp_rank < tp_size, caller, ": argument 'tp_rank' expected in [0, ", tp_size,
                    "), got ", tp_rank);
  if (tp_size <= n_kv_heads) {
    TORCH_CHECK(n_kv_heads % tp_size == 0, caller, ": argument 'tp_size' expected a divisor of n_kv_heads ",
                n_kv_heads, " (or a multiple of it), got ", tp_size);
    const int64_t width = n_kv_heads / tp_size;
    return {tp_rank * width, (tp_rank + 1) * width};
  }
  TORCH_CHECK(tp_size % n_kv_heads == 0, caller, ": argument 'tp_size' expected a multiple of n_kv_heads ",
              n_kv_heads, " (or a divisor of it), got ", tp_size);
  const int64_t head = tp_rank / (tp_size / n_kv_heads);
  return {head, head + 1};
}

/// One message of a resharding plan: sender rank `src_rank` of the source
/// TP group sends `heads` (indices into its own kv heads, ready for
/// send_pages) to rank `dst_rank` of the destination TP group.
struct HeadRoute {
  // cppcheck-suppress unusedStructMember ; read by engines, not by pagedkv
  int64_t src_rank;
  // cppcheck-suppress unusedStructMember ; read by engines, not by pagedkv
  int64_t dst_rank;
  // cppcheck-suppress unusedStructMember ; read by engines, not by pagedkv
  HeadRange heads;
};

/// The routes that give every destination rank its heads
/// (tp_head_range(n_kv_heads, dst_tp, dst_rank)) from the source ranks of a
/// group of src_tp ranks, one route per destination rank: a destination's
/// heads must all sit on one source rank (src_tp <= dst_tp, or replicated
/// heads); for src_tp > dst_tp each receiver would need several senders'
/// slices, which recv_pages (one transfer = all of the receiver's heads)
/// does not assemble, so that throws. Among the source ranks that hold the
/// heads, the lowest one sends.
inline std::vector<HeadRoute> tp_routes(int64_t n_kv_heads, int64_t src_tp, int64_t dst_tp) {
  const checks::Caller caller{"tp_routes", nullptr, nullptr};
  std::vector<HeadRoute> routes;
  for (int64_t dst = 0; dst < dst_tp; ++dst) {
    const HeadRange want = tp_head_range(n_kv_heads, dst_tp, dst);
    bool found = false;
    for (int64_t src = 0; src < src_tp && !found; ++src) {
      const HeadRange has = tp_head_range(n_kv_heads, src_tp, src);
      if (has.begin <= want.begin && want.end <= has.end) {
        routes.push_back({src, dst, {want.begin - has.begin, want.end - has.begin}});
        found = true;
      }
    }
    TORCH_CHECK(found, caller, ": expected destination rank ", dst, "'s kv heads [", want.begin, ", ", want.end,
                ") on one source rank, got src_tp ", src_tp, " and dst_tp ", dst_tp, " over ", n_kv_heads,
                " kv heads (each receiver needs one sender)");
  }
  return routes;
}

}  // namespace pagedkv
