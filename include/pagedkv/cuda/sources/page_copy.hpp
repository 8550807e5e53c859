// Kernel source of whole-page copies (every layer, relaid out through
// strides when the layouts differ); the launches are in cuda/page_copy.hpp.
// Moves as in sources/write_gather.hpp: a group of `lanes` threads per
// token, grid-stride over every (layer, page, token).
#pragma once

#include "pagedkv/cuda/source_text.hpp"

namespace pagedkv {
namespace cuda {
namespace sources {

// clang-format off
inline constexpr SourceText kPageCopy{"pagedkv/cuda/sources/page_copy.hpp", __LINE__, R"PAGEDKV(
namespace pkv {

/// Whole pages, every layer: dst page dst_ids[i] <- src page src_ids[i],
/// token by token through each side's strides (a page copied in its own
/// layout is one token of one row: the whole page).
PKV_DEVICE void copy_pages(const CopyParams& p) {
  const ItemGroups g = item_groups(p.lanes);
  const pkv_i64 total = p.n_layers * p.n * p.tokens;
  for (pkv_i64 item = g.first + g.group; item < total; item += g.stride) {
    const pkv_i64 token = item % p.tokens;
    const pkv_i64 i = (item / p.tokens) % p.n;
    const pkv_i64 layer = item / p.tokens / p.n;
    const pkv_i64 src_page = p.src_ids != nullptr ? p.src_ids[i] : i;
    const pkv_i64 dst_page = p.dst_ids != nullptr ? p.dst_ids[i] : i;
    const unsigned char* from = static_cast<const unsigned char*>(p.src) + layer * p.src_layer_bytes +
                                src_page * p.src_page_bytes + token * p.src_token;
    unsigned char* to =
        static_cast<unsigned char*>(p.dst) + layer * p.dst_layer_bytes + dst_page * p.dst_page_bytes + token * p.dst_token;
    copy_heads(to, p.dst_head, from, p.src_head, p.heads, p.row_bytes, p.row_vec, g.lane, g.lanes);
  }
}

}  // namespace pkv
)PAGEDKV"};
// clang-format on

}  // namespace sources
}  // namespace cuda
}  // namespace pagedkv
