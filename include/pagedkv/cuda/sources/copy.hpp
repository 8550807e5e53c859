// Kernel source of the byte-copying kernels: write and gather of native
// pages (any dtype: the copy is by bytes, as on the CPU) and whole-page
// copies (every layer, relaid out through strides when the layouts
// differ). One group of `lanes` threads moves one token (its head vectors,
// rows of head_dim elements); the host picks `lanes` and the width of each move
// (`row_vec`: 16 bytes where every address and stride allows, else 8, 4, 2
// or 1; 0: elements of a source row that is not contiguous). Grids come
// from shapes; each kernel loops over its rows grid-stride, so any grid
// size the host picks covers them.
#pragma once

#include "pagedkv/cuda/source_text.hpp"

namespace pagedkv {
namespace cuda {
namespace sources {

// clang-format off
inline constexpr SourceText kCopy{"pagedkv/cuda/sources/copy.hpp", __LINE__, R"PAGEDKV(
namespace pkv {

/// The first position write_* writes in sequence b.
PKV_DEVICE pkv_i64 write_start(const WriteParams& p, pkv_i64 b) {
  if (p.starts != nullptr) return p.starts[b];
  if (p.tail_lengths != nullptr) return p.tail_lengths[b] - p.n_tokens;
  return p.start;
}

/// The items a block's thread groups take: groups of `lanes` threads (a
/// power of two <= 32, so a group never spans two warps), item
/// `first + group` then every `stride` items.
struct ItemGroups {
  pkv_i64 lanes;
  pkv_i64 lane;
  pkv_i64 group;
  pkv_i64 first;
  pkv_i64 stride;
};
PKV_DEVICE ItemGroups item_groups(pkv_i64 lanes) {
  ItemGroups g;
  const pkv_i64 per_block = static_cast<pkv_i64>(pkv_ntid()) / lanes;
  g.lanes = lanes;
  g.lane = static_cast<pkv_i64>(pkv_tid()) % lanes;
  g.group = static_cast<pkv_i64>(pkv_tid()) / lanes;
  g.first = static_cast<pkv_i64>(pkv_bid_x()) * per_block;
  g.stride = static_cast<pkv_i64>(pkv_nbid_x()) * per_block;
  return g;
}

/// Lane `lane` of `lanes` copies its share of `heads` rows of `row_bytes`
/// (`vec` as in copy_row): one run when both sides hold the rows back to
/// back (a token of NHD pages and of a contiguous tensor), else the lanes
/// split over the rows, as many on each as it has moves (up to `lanes`).
PKV_DEVICE void copy_heads(unsigned char* dst, pkv_i64 dst_head, const unsigned char* src, pkv_i64 src_head,
                           pkv_i64 heads, pkv_i64 row_bytes, pkv_i64 vec, pkv_i64 lane, pkv_i64 lanes) {
  if (dst_head == row_bytes && src_head == row_bytes) {
    copy_row(dst, src, heads * row_bytes, vec, lane, lanes);
    return;
  }
  const pkv_i64 moves = row_bytes / vec;
  pkv_i64 per_head = lanes;
  while (per_head > 1 && per_head > moves) per_head /= 2;
  for (pkv_i64 h = lane / per_head; h < heads; h += lanes / per_head) {
    copy_row(dst + h * dst_head, src + h * src_head, row_bytes, vec, lane % per_head, per_head);
  }
}

/// write of a native side (side first_side + blockIdx.y): each token
/// (b, s) of k or v, every head, is copied into its page slot.
PKV_DEVICE void write_native(const WriteParams& p) {
  const pkv_i64 side = p.first_side + static_cast<pkv_i64>(pkv_bid_y());
  const TokensRef& src = side == 0 ? p.k_src : p.v_src;
  const PagesRef& dst = side == 0 ? p.k_pages : p.v_pages;
  const ItemGroups g = item_groups(p.lanes);
  const pkv_i64 total = p.batch * p.n_tokens;
  const pkv_i64 row_bytes = p.head_dim * p.elem_size;
  for (pkv_i64 item = g.first + g.group; item < total; item += g.stride) {
    const pkv_i64 s = item % p.n_tokens;
    const pkv_i64 b = item / p.n_tokens;
    pkv_i64 slot = 0;
    const pkv_i64 page = page_of(p.table, b, write_start(p, b) + s, p.page_size, p.page_shift, p.n_pages, &slot);
    if (page < 0) continue;
    unsigned char* to = static_cast<unsigned char*>(dst.data) + page * dst.page_bytes + slot * dst.token_bytes;
    const unsigned char* from = static_cast<const unsigned char*>(src.data) + b * src.batch + s * src.token;
    if (p.row_vec > 0) {
      copy_heads(to, dst.head_bytes, from, src.head, p.n_heads, row_bytes, p.row_vec, g.lane, g.lanes);
    } else {
      for (pkv_i64 h = 0; h < p.n_heads; ++h) {
        copy_strided_row(to + h * dst.head_bytes, from + h * src.head, p.head_dim, p.elem_size, src.elem, g.lane,
                         g.lanes);
      }
    }
  }
}

/// The positions gather_* reads from sequence b (the rest are zeros).
PKV_DEVICE pkv_i64 gather_length(const GatherParams& p, pkv_i64 b) {
  return p.lengths != nullptr ? p.lengths[b] : p.length;
}

/// gather of a native side into a token-major [B, T, H, D] output: each
/// token (b, t), every head, is copied from its page, or zeroed past the
/// sequence's length and on an unmapped page.
PKV_DEVICE void gather_native(const GatherParams& p) {
  const pkv_i64 side = p.first_side + static_cast<pkv_i64>(pkv_bid_y());
  const PagesRef& src = side == 0 ? p.k_pages : p.v_pages;
  const TokensRef& out = side == 0 ? p.k_out : p.v_out;
  const ItemGroups g = item_groups(p.lanes);
  const pkv_i64 total = p.batch * p.n_tokens;
  const pkv_i64 row_bytes = p.head_dim * p.elem_size;
  for (pkv_i64 item = g.first + g.group; item < total; item += g.stride) {
    const pkv_i64 t = item % p.n_tokens;
    const pkv_i64 b = item / p.n_tokens;
    unsigned char* to = static_cast<unsigned char*>(out.data) + b * out.batch + t * out.token;
    pkv_i64 slot = 0;
    const pkv_i64 page =
        t < gather_length(p, b) ? page_of(p.table, b, t, p.page_size, p.page_shift, p.n_pages, &slot) : -1;
    if (page < 0) {
      zero_row(to, p.n_heads * row_bytes, p.row_vec, g.lane, g.lanes);  // the output is contiguous
      continue;
    }
    const unsigned char* from =
        static_cast<const unsigned char*>(src.data) + page * src.page_bytes + slot * src.token_bytes;
    copy_heads(to, out.head, from, src.head_bytes, p.n_heads, row_bytes, p.row_vec, g.lane, g.lanes);
  }
}

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
