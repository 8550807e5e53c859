// Kernel source of the quantized pages' write and gather, one side (K or V)
// per launch so that each side has its own format: write quantizes each
// head vector in the kernel (amax over the vector's lanes, the scale, the
// codes), gather dequantizes into the logical dtype. The codes and scales
// are the CPU's bit for bit (common.hpp). One group of `lanes` threads per
// head vector (its amax is reduced over the group with shuffles, so the
// loop over vectors runs the same number of times on every lane).
#pragma once

#include "pagedkv/cuda/source_text.hpp"

namespace pagedkv {
namespace cuda {
namespace sources {

// clang-format off
inline constexpr SourceText kQuant{"pagedkv/cuda/sources/quant.hpp", __LINE__, R"PAGEDKV(
namespace pkv {

/// write of side first_side, quantized to format kF from logical dtype kT.
template <int kT, int kF>
PKV_DEVICE void write_quantized(const WriteParams& p) {
  const TokensRef& src = p.first_side == 0 ? p.k_src : p.v_src;
  const PagesRef& dst = p.first_side == 0 ? p.k_pages : p.v_pages;
  const ItemGroups g = item_groups(p.lanes);
  const pkv_i64 total = p.batch * p.n_tokens * p.n_heads;
  // `base` is the same on every lane of a block: each lane reaches group_max as often.
  for (pkv_i64 base = g.first; base < total; base += g.stride) {
    const pkv_i64 vector = base + g.group;
    const unsigned char* x = nullptr;
    pkv_i64 page = -1;
    pkv_i64 slot = 0;
    pkv_i64 h = 0;
    if (vector < total) {
      h = vector % p.n_heads;
      const pkv_i64 s = (vector / p.n_heads) % p.n_tokens;
      const pkv_i64 b = vector / p.n_heads / p.n_tokens;
      page = page_of(p.table, b, write_start(p, b) + s, p.page_size, p.page_shift, p.n_pages, &slot);
      if (page >= 0) x = static_cast<const unsigned char*>(src.data) + b * src.batch + s * src.token + h * src.head;
    }
    float amax = 0.0f;
    if (x != nullptr) {
      for (pkv_i64 e = g.lane; e < p.head_dim; e += g.lanes) {
        const float a = pkv_fabs(Dtype<kT>::load(x + e * src.elem));
        amax = a > amax ? a : amax;  // NaN never wins, as on the CPU
      }
    }
    amax = group_max(amax, static_cast<int>(g.lanes));
    if (x == nullptr) continue;
    const float scale = pkv_div_rn(amax, format_max<kF>());
    unsigned char* codes = static_cast<unsigned char*>(dst.data) + page * dst.page_bytes + slot * dst.token_bytes +
                           h * dst.head_bytes;
    for (pkv_i64 e = g.lane; e < p.head_dim; e += g.lanes) {
      const pkv_u8 code = scale > 0.0f ? encode<kF>(Dtype<kT>::load(x + e * src.elem), scale) : pkv_u8(0);
      pkv_store_u8(codes + e, code);
    }
    if (g.lane == 0) dst.scales[page * dst.scale_page + slot * dst.scale_token + h * dst.scale_head] = scale;
  }
}

/// gather of side first_side, dequantized from format kF into logical dtype kT.
template <int kT, int kF>
PKV_DEVICE void gather_quantized(const GatherParams& p) {
  const PagesRef& src = p.first_side == 0 ? p.k_pages : p.v_pages;
  const TokensRef& out = p.first_side == 0 ? p.k_out : p.v_out;
  const ItemGroups g = item_groups(p.lanes);
  const pkv_i64 total = p.batch * p.n_tokens * p.n_heads;
  for (pkv_i64 vector = g.first + g.group; vector < total; vector += g.stride) {
    const pkv_i64 h = vector % p.n_heads;
    const pkv_i64 t = (vector / p.n_heads) % p.n_tokens;
    const pkv_i64 b = vector / p.n_heads / p.n_tokens;
    unsigned char* to = static_cast<unsigned char*>(out.data) + b * out.batch + t * out.token + h * out.head;
    pkv_i64 slot = 0;
    const pkv_i64 page =
        t < gather_length(p, b) ? page_of(p.table, b, t, p.page_size, p.page_shift, p.n_pages, &slot) : -1;
    if (page < 0) {
      for (pkv_i64 e = g.lane; e < p.head_dim; e += g.lanes) Dtype<kT>::store(to + e * out.elem, 0.0f);
      continue;
    }
    const unsigned char* codes = static_cast<const unsigned char*>(src.data) + page * src.page_bytes +
                                 slot * src.token_bytes + h * src.head_bytes;
    const float scale = src.scales[page * src.scale_page + slot * src.scale_token + h * src.scale_head];
    for (pkv_i64 e = g.lane; e < p.head_dim; e += g.lanes) {
      Dtype<kT>::store(to + e * out.elem, dequantize<kF>(pkv_load_u8(codes + e), scale));
    }
  }
}

}  // namespace pkv
)PAGEDKV"};
// clang-format on

}  // namespace sources
}  // namespace cuda
}  // namespace pagedkv
