// The CPU write and gather kernels of caches with quantized pages: write
// quantizes each head vector inside the kernel (no dequantized temporary),
// gather dequantizes into the cache's logical dtype. Like the native kernels
// (cpu/write_gather.hpp) they check nothing: callers validate first. One side
// (K or V) at a time, so K and V may use different formats; a native side is
// a plain byte copy. Parallel over (sequence, page) work items, the codecs of
// cpu/quant/codecs.hpp on the instruction set the caller selected. The same
// arithmetic in ATen ops, for other devices: generic/quant.hpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "pagedkv/cpu/copy.hpp"
#include "pagedkv/cpu/quant/codecs.hpp"
#include "pagedkv/cpu/write_gather.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/simd/isa.hpp"

namespace pagedkv {
namespace cpu {
namespace quant {

/// One side (K or V) of one layer's pages.
template <class Byte>
struct SidePages {
  KVFormat format;
  Byte* pages;     // [n_pages, <page>]: codes (1 byte) or native elements
  float* scales;   // [n_pages, page_size * n_heads] in the layout's order; null for native
  int64_t elem_size;  // bytes per stored element
};

/// One side of a token-major [B, S or T, H, D] tensor, as raw bytes.
template <class Byte>
struct SideTokens {
  Byte* data;
  int64_t batch_stride;           // bytes between sequences
  cpu::BlockStrides strides;  // bytes between tokens / heads / elements
};

/// Quantizes `tokens` tokens of every head from `src` into one page, from
/// slot `first_slot_token` on (codes and scales: the page's own).
template <KVFormat F, class T>
void quantize_block(simd::Isa isa, const char* src, const cpu::BlockStrides& ss,
                    typename cpu::quant::Codec<F>::Code* codes,  // [<page>]
                    float* scales,                          // [page_size * H]
                    int64_t first_slot_token, const PageGeometry& g, int64_t tokens, float* buf /* [D] */) {
  const PageGeometry sg = scale_geometry(g);
  const bool contiguous = ss.elem == static_cast<int64_t>(sizeof(T));
  const bool heads_aligned = ss.head % static_cast<int64_t>(sizeof(T)) == 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const char* token = src + t * ss.token;
    typename cpu::quant::Codec<F>::Code* token_codes = codes + g.offset(first_slot_token + t, 0);
    float* token_scales = scales + sg.offset(first_slot_token + t, 0);
    if (contiguous && heads_aligned) {  // a token's heads at once: their chains overlap
      cpu::quant::quantize_rows<F>(isa, reinterpret_cast<const T*>(token), ss.head / static_cast<int64_t>(sizeof(T)),
                              g.n_heads, g.head_dim, token_codes, g.head_stride, token_scales, sg.head_stride);
      continue;
    }
    for (int64_t h = 0; h < g.n_heads; ++h) {
      cpu::quant::to_float<T>(isa, token + h * ss.head, ss.elem, g.head_dim, buf);
      token_scales[h * sg.head_stride] =
          cpu::quant::quantize_vector<F>(isa, buf, g.head_dim, token_codes + h * g.head_stride);
    }
  }
}

/// Writes one work item (cpu::locate_write_block) of one side.
template <class T>
void write_side_block(simd::Isa isa, const cpu::WriteBlock& b, const SideTokens<const char>& src,
                      const SidePages<char>& dst, const PageGeometry& g, float* buf /* [D] */) {
  const char* from = src.data + b.row * src.batch_stride + b.token * src.strides.token;
  const int64_t first_scale = b.page * g.page_size * g.n_heads;  // of the page's; a native side has none
  switch (dst.format) {
    case KVFormat::fp8_e4m3:
      return quantize_block<KVFormat::fp8_e4m3, T>(isa, from, src.strides,
                                                   reinterpret_cast<uint8_t*>(dst.pages) + b.page * g.page_elems,
                                                   dst.scales + first_scale, b.in_page, g, b.tokens, buf);
    case KVFormat::int8:
      return quantize_block<KVFormat::int8, T>(isa, from, src.strides,
                                               reinterpret_cast<int8_t*>(dst.pages) + b.page * g.page_elems,
                                               dst.scales + first_scale, b.in_page, g, b.tokens, buf);
    default:
      return cpu::copy_block(dst.pages + (b.page * g.page_elems + g.offset(b.in_page, 0)) * dst.elem_size,
                                 cpu::page_strides(g, dst.elem_size), from, src.strides,
                                 cpu::BlockShape{b.tokens, g.n_heads, g.head_dim, dst.elem_size});
  }
}

/// Writes tokens [0, n_tokens) of every sequence b, both sides, to logical
/// positions starts[b] + s, through the page table. K and V share one
/// parallel region (each work item's two sides run one after the other):
/// a region per side made the threads wait at the end of each.
template <class T, class Index>
void write_sides_cpu(const PageTableRef<Index>& table,    // [B, max_pages]
                     const std::vector<int64_t>& starts,  // [B]
                     int64_t n_tokens,
                     const SideTokens<const char> (&src)[2],  // k, v
                     const SidePages<char> (&dst)[2],         // k, v
                     const PageGeometry& g) {
  if (n_tokens == 0 || table.rows == 0) return;
  const PageDivisor pages(g.page_size);
  const int64_t items_per_row = cpu::write_items_per_row(starts, n_tokens, pages);
  const int64_t token_bytes = g.n_heads * g.head_dim * static_cast<int64_t>(sizeof(T));
  const simd::Isa isa = simd::selected_isa();  // ScopedIsa is per thread
  const int64_t grain = cpu::grain_for(2 * std::min(n_tokens, g.page_size) * token_bytes);
  at::parallel_for(0, table.rows * items_per_row, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(g.head_dim));
    for (int64_t item = begin; item < end; ++item) {
      const cpu::WriteBlock b = cpu::locate_write_block(table, starts, n_tokens, pages, items_per_row, item);
      if (b.tokens == 0) continue;
      write_side_block<T>(isa, b, src[0], dst[0], g, buf.data());
      write_side_block<T>(isa, b, src[1], dst[1], g, buf.data());
    }
  });
}

/// Dequantizes `tokens` tokens of every head of a page into a contiguous
/// token-major [tokens, H, D] output of T (`stream`: cpu::quant::dequantize_row's).
/// The page is read in memory order: on HND pages head by head (a head's
/// tokens are adjacent there), which brought HND fp8 / int8 gathers from
/// well behind NHD ones to their time (bench/NOTES.md, "HND pages
/// dequantized in memory order").
template <KVFormat F, class T>
void dequantize_block(simd::Isa isa, const typename cpu::quant::Codec<F>::Code* codes, const float* scales,
                      const PageGeometry& g, int64_t tokens, T* out, float* buf /* [D] */, bool stream) {
  const int64_t D = g.head_dim;
  const PageGeometry sg = scale_geometry(g);
  const auto dequantize = [&](int64_t t, int64_t h) {
    cpu::quant::dequantize_row<F>(isa, codes + g.offset(t, h), D, scales[sg.offset(t, h)],
                             out + (t * g.n_heads + h) * D, buf, stream);
  };
  if (g.heads_adjacent()) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < g.n_heads; ++h) dequantize(t, h);
  } else {
    for (int64_t h = 0; h < g.n_heads; ++h)
      for (int64_t t = 0; t < tokens; ++t) dequantize(t, h);
  }
}

/// Reads positions [0, lengths[b]) of one side into a contiguous
/// [B, T, H, D] output of T; positions past a length, and unmapped pages, are zeros.
/// Streams its output where a native gather of the same K and V would
/// (cpu::use_streaming_gather): the dequantizing gather writes twice
/// the bytes it reads, and streaming saves the output's read for ownership.
template <class T, class Index>
void gather_side_cpu(const PageTableRef<Index>& table,     // [B, max_pages]
                     const std::vector<int64_t>& lengths,  // [B], each <= T
                     int64_t n_tokens,                     // T
                     const SidePages<const char>& src,
                     T* out,  // [B, T, H, D], contiguous
                     const PageGeometry& g) {
  if (n_tokens == 0 || table.rows == 0) return;
  const int64_t page_size = g.page_size;
  const int64_t cols = (n_tokens + page_size - 1) / page_size;
  const int64_t token_elems = g.n_heads * g.head_dim;
  const int64_t elem = static_cast<int64_t>(sizeof(T));
  const simd::Isa isa = simd::selected_isa();
  const cpu::BlockStrides page_strides = cpu::page_strides(g, src.elem_size);
  const cpu::BlockStrides out_strides{token_elems * elem, g.head_dim * elem, elem};
  const bool stream = cpu::use_streaming_gather(2 * table.rows * n_tokens * token_elems * elem);
  const int64_t grain = cpu::grain_for(std::min(n_tokens, page_size) * token_elems * elem);
  cpu::parallel_copy(table.rows * cols, grain, stream, [&](auto stream_tag, int64_t begin, int64_t end) {
    constexpr bool kStream = decltype(stream_tag)::value;
    std::vector<float> buf(static_cast<size_t>(g.head_dim));
    for (int64_t item = begin; item < end; ++item) {
      const cpu::GatherBlock b = cpu::locate_gather_block(table, lengths, n_tokens, page_size, cols, item);
      const int64_t page = b.page;
      T* dst = out + (b.row * n_tokens + b.first) * token_elems;
      const int64_t valid = b.valid_end - b.first;
      if (valid > 0) {
        const float* scales = src.scales == nullptr ? nullptr : src.scales + page * page_size * g.n_heads;
        switch (src.format) {
          case KVFormat::fp8_e4m3:
            dequantize_block<KVFormat::fp8_e4m3>(isa,
                                                 reinterpret_cast<const uint8_t*>(src.pages) + page * g.page_elems,
                                                 scales, g, valid, dst, buf.data(), kStream);
            break;
          case KVFormat::int8:
            dequantize_block<KVFormat::int8>(isa, reinterpret_cast<const int8_t*>(src.pages) + page * g.page_elems,
                                             scales, g, valid, dst, buf.data(), kStream);
            break;
          default:
            cpu::copy_block<kStream>(reinterpret_cast<char*>(dst), out_strides,
                                         src.pages + page * g.page_elems * src.elem_size, page_strides,
                                         cpu::BlockShape{valid, g.n_heads, g.head_dim, elem});
            break;
        }
      }
      std::fill(dst + valid * token_elems, dst + (b.last - b.first) * token_elems, T(0));
    }
  });
}
}  // namespace quant
}  // namespace cpu
}  // namespace pagedkv
