// Kernel source of write and gather of native pages (any dtype: the copy
// is by bytes, as on the CPU); their launches are in cuda/write_gather.hpp.
// One group of `lanes` threads moves one token (its head vectors, rows of
// head_dim elements); the host picks `lanes` and the width of each move
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
inline constexpr SourceText kWriteGather{"pagedkv/cuda/sources/write_gather.hpp", __LINE__, R"PAGEDKV(
namespace pkv {

/// The first position write_* writes in sequence b.
PKV_DEVICE pkv_i64 write_start(const WriteParams& p, pkv_i64 b) {
  if (p.starts != nullptr) return p.starts[b];
  if (p.tail_lengths != nullptr) return p.tail_lengths[b] - p.n_tokens;
  return p.start;
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

}  // namespace pkv
)PAGEDKV"};
// clang-format on

}  // namespace sources
}  // namespace cuda
}  // namespace pagedkv
