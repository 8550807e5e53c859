// The CPU kernels' byte copies: the strides and extent of a [tokens, heads,
// head_dim] block, copy_block (contiguous runs merged into one memcpy, head
// vectors of common sizes inlined), streaming stores for writes into the
// cache and for large gathers, and the grain that decides when a copy runs
// on more than one thread. dtype-agnostic: everything is bytes. Callers
// validate first; nothing here checks or throws.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "pagedkv/layouts.hpp"

namespace pagedkv {
namespace cpu {

/// Byte strides of a [tokens, heads, head_dim] block.
struct BlockStrides {
  int64_t token;  ///< bytes between consecutive tokens
  int64_t head;   ///< bytes between consecutive heads
  int64_t elem;   ///< bytes between consecutive elements of a head vector
};

/// Extent of a [tokens, heads, head_dim] block.
struct BlockShape {
  int64_t tokens;
  int64_t heads;
  int64_t head_dim;
  int64_t elem_size;  ///< bytes per element
};

/// The byte strides of one page of `g`.
inline BlockStrides page_strides(const PageGeometry& g, int64_t elem_size) {
  return {g.token_stride * elem_size, g.head_stride * elem_size, elem_size};
}

/// The byte strides of dims 1..3 of a [B, S, H, D] tensor.
inline BlockStrides token_major_strides(const at::Tensor& t) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  return {t.stride(1) * es, t.stride(2) * es, t.stride(3) * es};
}

/// Whether kernels that write into the cache use streaming (non-temporal)
/// stores: they bypass the caches, so writing a decode step's tokens, one
/// per sequence at the same slot of pages that alias in the cache sets,
/// costs no read-for-ownership and evicts nothing (bench/NOTES.md). x86-64
/// only; elsewhere, and for destinations not 16-byte aligned, plain stores.
#if defined(__SSE2__)
constexpr bool kHaveStreamingStores = true;
#else
constexpr bool kHaveStreamingStores = false;
#endif

/// Writes into the cache that move at least this many bytes use streaming
/// stores even where whole tokens are contiguous (NHD). Into slots written
/// just before (still cached) plain stores win decode writes up to 512 KiB
/// and lose from 1 MiB; into cold slots, as in a real decode step,
/// streaming wins at every size, so the threshold bounds the cold case
/// (bench/NOTES.md, "Streaming stores (issue 3, change 5)").
constexpr int64_t kStreamingMinBytes = int64_t{1} << 20;

/// Whether a write of `bytes` into pages with strides `page` streams: when
/// it is large, or when it goes head vector by head vector (HND pages: short
/// runs that alias in the cache sets and defeat the prefetchers, so
/// streaming wins at every measured size, warm or cold).
inline bool use_streaming_stores(int64_t bytes, const BlockStrides& page, const PageGeometry& g,
                                 int64_t elem_size) noexcept {
  const bool head_vectors = g.n_heads > 1 && page.head != g.head_dim * elem_size;
  return kHaveStreamingStores && (head_vectors || bytes >= kStreamingMinBytes);
}

/// Gathers whose outputs total at least this many bytes stream them: an
/// output that large is read back from memory by whatever consumes it (it
/// outgrows the L2 caches many times over), so caching it buys nothing and
/// its read-for-ownership costs a third more memory traffic; glibc's memcpy
/// streams large copies for the same reason (bench/NOTES.md, "Streaming
/// gathers"). Smaller outputs are kept in cache for their consumer.
constexpr int64_t kGatherStreamingMinBytes = int64_t{16} << 20;

/// Whether a gather writing `bytes` of output streams it.
inline bool use_streaming_gather(int64_t bytes) noexcept {
  return kHaveStreamingStores && bytes >= kGatherStreamingMinBytes;
}

/// Orders this thread's streaming stores before whatever it does next; every
/// parallel chunk that streamed calls it before it returns.
inline void streaming_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// at::parallel_for over items [0, n) that copy with copy_block<kStream>:
/// runs copy_items(std::integral_constant<bool, stream>(), begin, end) on
/// each chunk, then fences a chunk that streamed (streaming_fence).
template <class CopyItems>
void parallel_copy(int64_t n, int64_t grain, bool stream, const CopyItems& copy_items) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    if (stream) {
      copy_items(std::true_type(), begin, end);
      streaming_fence();
    } else {
      copy_items(std::false_type(), begin, end);
    }
  });
}

/// Copies kBytes (a multiple of 16) with 16-byte moves the compiler unrolls,
/// not a libc call per head vector or the `rep movsq` GCC emits for a constant
/// 256-byte memcpy (bench/NOTES.md, "Smaller changes and what was not kept
/// (issue 3, Xeon)"). kStream: streaming stores when `dst` is 16-byte aligned.
template <int64_t kBytes, bool kStream = false>
inline void copy_fixed(char* dst, const char* src) noexcept {
  static_assert(kBytes % 16 == 0, "copy_fixed: a multiple of 16 bytes");
#if defined(__SSE2__)
  if (kStream && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    for (int64_t i = 0; i < kBytes; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < kBytes; i += 16) std::memcpy(dst + i, src + i, 16);
}

/// memcpy; kStream: with streaming stores when `dst` is 16-byte aligned and
/// `bytes` a multiple of 16.
template <bool kStream>
inline void copy_run(char* dst, const char* src, int64_t bytes) noexcept {
#if defined(__SSE2__)
  if (kStream && ((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes)) & 15) == 0) {
    int64_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    for (; i < bytes; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

/// Copies a [tokens, heads] grid of head vectors with copy_row(dst, src),
/// reading the source in memory order: the outer loop walks the source's
/// dimension that jumps further. The reads are what the prefetchers must
/// follow; the writes stream, or go to as many runs at once as the inner
/// loop has steps (a block's tokens, at most page_size, or its heads). An HND
/// prefill write (token-major source, head-major pages) was much slower
/// when the loop followed the pages instead (bench/NOTES.md, "Head vectors
/// copied in the source's order").
template <class CopyRow>
inline void copy_head_vectors(char* dst, const BlockStrides& ds, const char* src, const BlockStrides& ss,
                              const BlockShape& shape, const CopyRow& copy_row) {
  if (ss.head > ss.token) {
    for (int64_t h = 0; h < shape.heads; ++h)
      for (int64_t t = 0; t < shape.tokens; ++t)
        copy_row(dst + t * ds.token + h * ds.head, src + t * ss.token + h * ss.head);
  } else {
    for (int64_t t = 0; t < shape.tokens; ++t)
      for (int64_t h = 0; h < shape.heads; ++h)
        copy_row(dst + t * ds.token + h * ds.head, src + t * ss.token + h * ss.head);
  }
}

/// Copies a block of bytes; merges head vectors, then whole tokens, into
/// single memcpys wherever both sides are contiguous. kStream: streaming
/// stores (see kHaveStreamingStores); the caller then calls streaming_fence().
template <bool kStream = false>
inline void copy_block(char* dst, const BlockStrides& ds, const char* src, const BlockStrides& ss,
                       const BlockShape& shape) {
  const int64_t es = shape.elem_size;
  const int64_t row_bytes = shape.head_dim * es;
  const bool rows_contiguous = shape.head_dim == 1 || (ds.elem == es && ss.elem == es);
  if (!rows_contiguous) {
    for (int64_t t = 0; t < shape.tokens; ++t)
      for (int64_t h = 0; h < shape.heads; ++h)
        for (int64_t d = 0; d < shape.head_dim; ++d)
          std::memcpy(dst + t * ds.token + h * ds.head + d * ds.elem, src + t * ss.token + h * ss.head + d * ss.elem,
                      static_cast<size_t>(es));
    return;
  }
  const bool heads_contiguous = shape.heads == 1 || (ds.head == row_bytes && ss.head == row_bytes);
  if (heads_contiguous) {
    const int64_t token_bytes = shape.heads * row_bytes;
    if (shape.tokens == 1 || (ds.token == token_bytes && ss.token == token_bytes)) {
      copy_run<kStream>(dst, src, shape.tokens * token_bytes);
      return;
    }
    for (int64_t t = 0; t < shape.tokens; ++t) copy_run<kStream>(dst + t * ds.token, src + t * ss.token, token_bytes);
    return;
  }
  // Head vectors one by one (HND pages), with the common sizes inlined.
  const auto fixed = [&](auto bytes) {
    copy_head_vectors(dst, ds, src, ss, shape,
                      [](char* d, const char* s) { copy_fixed<decltype(bytes)::value, kStream>(d, s); });
  };
  switch (row_bytes) {
    case 128: return fixed(std::integral_constant<int64_t, 128>());
    case 256: return fixed(std::integral_constant<int64_t, 256>());
    case 512: return fixed(std::integral_constant<int64_t, 512>());
    default:
      return copy_head_vectors(dst, ds, src, ss, shape,
                               [row_bytes](char* d, const char* s) { copy_run<kStream>(d, s, row_bytes); });
  }
}

/// Zeroes `tokens` whole tokens of a contiguous [T, H, D] output.
inline void zero_tokens(char* dst, int64_t tokens, int64_t token_bytes) {
  if (tokens > 0) std::memset(dst, 0, static_cast<size_t>(tokens * token_bytes));
}

/// Work items per at::parallel_for chunk so that one chunk moves about
/// `kChunkBytes`; a call that moves less runs on the calling thread.
/// On 2 cores a second thread loses below 64 KiB (a decode write of 8
/// sequences), breaks even at 64-128 KiB and wins above (bench/NOTES.md,
/// "Threads and grain sizes (issue 3, change 8)").
constexpr int64_t kChunkBytes = int64_t{64} << 10;
inline int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes_per_item));
}
}  // namespace cpu
}  // namespace pagedkv
