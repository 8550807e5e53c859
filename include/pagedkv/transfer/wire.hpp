// The transfer's wire format: header and reply words, tags, the layout of a
// layer's message (sections of codes and scales at multiples of
// kSectionAlign), and the header a cache sends. Fixed and versioned, so
// that other implementations can speak it; the protocol around it is
// described at the top of transfer.hpp.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "pagedkv/cpu/copy.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/transfer/heads.hpp"

namespace pagedkv {

/// The wire format: fixed, versioned, documented for other implementations.
namespace transfer {
namespace wire {

constexpr int64_t kMagic = 0x564B444547415050;       // "PPAGEDKV" little-endian
constexpr int64_t kReplyMagic = 0x594C504556444B50;  // reply
constexpr int64_t kVersion = 1;
constexpr int64_t kHeaderWords = 32;  // never changes: a receiver of any version posts exactly this
constexpr int64_t kReplyWords = 4;
// c10d tags (engines that use send/recv on the same group for their own
// messages must avoid these three).
constexpr int kHeaderTag = 0x5044;
constexpr int kReplyTag = 0x5045;
constexpr int kPayloadTag = 0x5046;

/// Header word indices. Quantization travels in k_format / v_format (the
/// KVFormat values: 0 native, 1 fp8_e4m3, 2 int8) and the bytes of each
/// layer's scale sections in scale_bytes (0 for native pages, whose payload
/// is as it was before quantized pages travelled).
enum Field : int64_t {
  magic,
  version,
  transfer_id,
  n_layers,
  page_size,
  head_dim,
  sender_heads,  // the sender cache's n_kv_heads
  head_begin,    // the slice sent: [head_begin, head_end) of the sender's heads
  head_end,
  dtype,         // c10::ScalarType value of the logical dtype (what write takes)
  elem_size,     // of that dtype
  k_format,      // KVFormat value, 0 = native
  v_format,
  layout,        // of the payload's pages: 0 = NHD, 1 = HND
  n_tokens,
  n_pages,
  payload_bytes,  // all messages together
  scale_bytes,    // per layer: the scale sections of quantized pages, 0 for native ones
  first_page,     // columns a windowed table released before the pages sent (n_pages = the pages of
                  // n_tokens - first_page); 0 for every other transfer, which older receivers require
  first_reserved,  // this word up to the checksum: 0 in version 1
  checksum = kHeaderWords - 1,
};

/// Reply word indices and verdicts.
enum ReplyField : int64_t { reply_magic, verdict, reply_transfer_id, detail };
enum Verdict : int64_t { accept = 0, bad_header = 1, wrong_transfer_id = 2, mismatch = 3, short_pool = 4, window = 5 };

inline int64_t checksum_of(const int64_t* words) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the words
  for (int64_t i = 0; i < checksum; ++i) {
    h ^= static_cast<uint64_t>(words[i]);
    h *= 0x100000001b3ULL;
  }
  return static_cast<int64_t>(h >> 1);
}

template <class Layout>
constexpr int64_t layout_code() {
  return std::is_same<Layout, HND>::value ? 1 : 0;
}

/// Byte strides of one payload page: `width` heads in the layout `code`.
inline cpu::BlockStrides page_strides(int64_t code, int64_t page_size, int64_t width, int64_t head_dim,
                                          int64_t es) {
  if (code == 1) return {head_dim * es, page_size * head_dim * es, es};
  return {width * head_dim * es, head_dim * es, es};
}

/// Sections of a quantized payload message (k, v, k scales, v scales) start
/// at multiples of this many bytes, so that each can be viewed as its
/// element type wherever it lies.
constexpr int64_t kSectionAlign = 16;

/// `bytes` rounded up to a multiple of kSectionAlign.
constexpr int64_t padded(int64_t bytes) { return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

}  // namespace wire
}  // namespace transfer

namespace transfer {

/// Bytes of one page's head slice.
inline int64_t slice_bytes(int64_t page_size, int64_t width, int64_t head_dim, int64_t es) {
  return page_size * width * head_dim * es;
}

/// Where the sections of one layer's message lie when the cache has a
/// quantized side (byte offsets into the message; transfer::wire).
struct LayerSections {
  int64_t elements[2];    ///< k, v: codes, or a native side's elements
  int64_t scales[2];      ///< k, v scales; -1 for a native side
  int64_t element_bytes[2];
  int64_t scale_bytes[2];  ///< 0 for a native side
  int64_t all_scale_bytes;  ///< both scale sections, padded: the header's scale_bytes
  int64_t bytes;            ///< the whole message
};

/// The sections of a message carrying n pages' slices of `width` heads.
template <class Layout>
LayerSections layer_sections(const PagedCache<Layout>& cache, int64_t n, int64_t width) {
  namespace w = transfer::wire;
  const at::Tensor* pages[2] = {&cache.k_cache(), &cache.v_cache()};
  const bool quantized[2] = {is_quantized(cache.quant().k), is_quantized(cache.quant().v)};
  LayerSections s{};
  int64_t at = 0;
  for (int kv = 0; kv < 2; ++kv) {
    s.elements[kv] = at;
    s.element_bytes[kv] = n * slice_bytes(cache.page_size(), width, cache.head_dim(),
                                          static_cast<int64_t>(pages[kv]->element_size()));
    at += w::padded(s.element_bytes[kv]);
  }
  const int64_t scales_begin = at;
  for (int kv = 0; kv < 2; ++kv) {
    s.scales[kv] = quantized[kv] ? at : -1;
    s.scale_bytes[kv] = quantized[kv] ? n * slice_bytes(cache.page_size(), width, 1, sizeof(float)) : 0;
    at += w::padded(s.scale_bytes[kv]);
  }
  s.all_scale_bytes = at - scales_begin;
  s.bytes = at;
  return s;
}

/// Bytes of every message of a transfer of n pages' slices of `width` heads.
template <class Layout>
int64_t payload_bytes(const PagedCache<Layout>& cache, int64_t n, int64_t width) {
  if (is_quantized(cache.quant())) return cache.n_layers() * layer_sections(cache, n, width).bytes;
  const int64_t es = static_cast<int64_t>(c10::elementSize(cache.dtype()));
  return cache.n_layers() * 2 * n * slice_bytes(cache.page_size(), width, cache.head_dim(), es);
}

/// The header of a transfer of n pages (tokens [0, n_tokens), from
/// column first_page on) of `cache`, heads [heads.begin, heads.end)
/// (resolved: end != -1).
template <class Layout>
std::vector<int64_t> header_words(const PagedCache<Layout>& cache, int64_t n, int64_t n_tokens, int64_t transfer_id,
                                  HeadRange heads, int64_t first_page = 0) {
  namespace w = transfer::wire;
  const int64_t width = heads.end - heads.begin;
  std::vector<int64_t> h(static_cast<size_t>(w::kHeaderWords), 0);
  h[w::magic] = w::kMagic;
  h[w::version] = w::kVersion;
  h[w::transfer_id] = transfer_id;
  h[w::n_layers] = cache.n_layers();
  h[w::page_size] = cache.page_size();
  h[w::head_dim] = cache.head_dim();
  h[w::sender_heads] = cache.n_kv_heads();
  h[w::head_begin] = heads.begin;
  h[w::head_end] = heads.end;
  h[w::dtype] = static_cast<int64_t>(cache.dtype());
  h[w::elem_size] = static_cast<int64_t>(c10::elementSize(cache.dtype()));
  h[w::k_format] = static_cast<int64_t>(cache.quant().k);
  h[w::v_format] = static_cast<int64_t>(cache.quant().v);
  h[w::layout] = w::layout_code<Layout>();
  h[w::n_tokens] = n_tokens;
  h[w::n_pages] = n;
  h[w::first_page] = first_page;
  h[w::payload_bytes] = payload_bytes(cache, n, width);
  h[w::scale_bytes] = is_quantized(cache.quant()) ? layer_sections(cache, n, width).all_scale_bytes : 0;
  h[w::checksum] = w::checksum_of(h.data());
  return h;
}

}  // namespace transfer

}  // namespace pagedkv
