// The data-moving kernels. Callers validate everything first; nothing here
// checks or throws, so a kernel that starts always finishes.
//
// CPU: hand-written byte copies (dtype-agnostic), contiguous runs merged
// into one memcpy, parallel over (sequence, page) work items.
// Other devices: a device-agnostic ATen path (whole pages for gathers, head
// rows for writes).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {

/// Which kernels a call uses. `automatic`: hand-written ones for CPU
/// tensors, the ATen path for any other device. `generic`: the ATen path
/// everywhere (lets CPU tests cover the path CUDA caches take).
enum class Backend { automatic, generic };

namespace detail {
inline Backend& backend_override() noexcept {
  thread_local Backend backend = Backend::automatic;
  return backend;
}
}  // namespace detail

/// Sets the backend of the calling thread for one scope.
class ScopedBackend {
 public:
  explicit ScopedBackend(Backend backend) : previous_(detail::backend_override()) {
    detail::backend_override() = backend;
  }
  ~ScopedBackend() { detail::backend_override() = previous_; }
  ScopedBackend(const ScopedBackend&) = delete;
  ScopedBackend& operator=(const ScopedBackend&) = delete;

 private:
  Backend previous_;
};

namespace kernels {

/// Whether a cache on `device` uses the hand-written CPU kernels.
inline bool use_cpu_kernels(const at::Device& device) {
  return device.is_cpu() && detail::backend_override() == Backend::automatic;
}

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
/// stores even where whole tokens are contiguous (NHD). Measured, one thread,
/// decode writes of 2 KiB tokens (bench/NOTES.md): into slots written just
/// before (still cached) plain stores win up to 512 KiB (128 sequences: 23
/// vs 31 us) and lose from 1 MiB (256: 86 vs 61 us); into cold slots, as in a
/// real decode step, streaming wins at every size (32 sequences: 17 vs 8 us).
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

/// Copies kBytes (a multiple of 16) with 16-byte moves the compiler unrolls.
/// For one head vector this beats both a libc call and the `rep movsq` GCC
/// emits for a constant-size memcpy of 256 bytes (bench/NOTES.md). kStream:
/// streaming stores when `dst` is 16-byte aligned.
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
/// prefill write (token-major source, head-major pages) took ~2.5x as long
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
/// Measured on 2 cores (bench/NOTES.md, "threads"): a second thread loses
/// below 64 KiB (decode write of 8 sequences: 2.5 us on one thread, 3.0 on
/// two), breaks even at 64-128 KiB and wins above (32 sequences: 7.3 vs 5.8).
constexpr int64_t kChunkBytes = int64_t{64} << 10;
inline int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes_per_item));
}

/// k and v of a batch in token-major order [B, S or T, H, D], as raw bytes.
template <class Byte>
struct TokenMajorKv {
  Byte* k;
  Byte* v;
  int64_t k_batch_stride;  ///< bytes between sequences of k
  int64_t v_batch_stride;  ///< bytes between sequences of v
  BlockStrides k_strides;  ///< bytes between tokens/heads/elements of k
  BlockStrides v_strides;  ///< same for v
};

template <class Byte>
TokenMajorKv<Byte> token_major(Byte* k_data, const at::Tensor& k, Byte* v_data, const at::Tensor& v) {
  const int64_t es = static_cast<int64_t>(k.element_size());
  return {k_data, v_data, k.stride(0) * es, v.stride(0) * es, token_major_strides(k), token_major_strides(v)};
}

/// Layer `layer` of a cache tensor [n_layers, ...] as raw bytes. CPU kernels
/// take this rather than select(0, layer): on libtorch 1.13 a select costs
/// about 1 us (a dispatch and an autograd view), a sixth of a 32-token decode
/// write (bench/NOTES.md, "Fixed costs of small writes").
inline char* layer_bytes(const at::Tensor& storage, int64_t layer) {
  const auto elem_size = static_cast<int64_t>(storage.element_size());
  return static_cast<char*>(storage.data_ptr()) + layer * storage.stride(0) * elem_size;
}

/// layer_bytes of a float32 tensor, as floats (a quantized side's scales).
inline float* layer_floats(const at::Tensor& storage, int64_t layer) {
  return static_cast<float*>(storage.data_ptr()) + layer * storage.stride(0);
}

/// One layer of the cache's pages as raw bytes: [n_pages, <page>] for k and v.
template <class Byte>
struct LayerPages {
  Byte* k;
  Byte* v;
  int64_t page_bytes;    ///< bytes between pages
  BlockStrides strides;  ///< inside a page
};

/// Work items per sequence of a write of `n_tokens` tokens from `starts`:
/// the pages the widest sequence's run touches (at most ceil(n/P) + 1, when
/// it starts mid-page; exactly 1 for a decode step).
inline int64_t write_items_per_row(const std::vector<int64_t>& starts, int64_t n_tokens, const PageDivisor& pages) {
  int64_t items_per_row = 1;
  for (const int64_t start : starts) {
    items_per_row = std::max(items_per_row, pages.column(start + n_tokens - 1) - pages.column(start) + 1);
  }
  return items_per_row;
}

/// What one write work item copies: `tokens` input tokens of sequence `row`
/// from input token `token` on, into `page` from slot `in_page` on.
struct WriteBlock {
  int64_t row;      ///< the sequence
  int64_t token;    ///< its first input token written (an index into S)
  int64_t tokens;   ///< how many; 0 when the item writes nothing
  int64_t page;     ///< the page written (looked up only when tokens > 0)
  int64_t in_page;  ///< the slot of the first one in the page
};

/// The block of work item `item` of a write with `items_per_row` items per
/// sequence (write_items_per_row; items run sequence-major).
template <class Index>
inline WriteBlock locate_write_block(const PageTableRef<Index>& table,    // [B, max_pages]
                                     const std::vector<int64_t>& starts,  // [B]
                                     int64_t n_tokens, const PageDivisor& pages, int64_t items_per_row,
                                     int64_t item) {
  WriteBlock b{};
  b.row = items_per_row == 1 ? item : item / items_per_row;  // a decode step divides nothing
  const int64_t start = starts[static_cast<size_t>(b.row)];
  const int64_t page_size = pages.page_size();
  const int64_t col = pages.column(start) + (item - b.row * items_per_row);
  const int64_t first = std::max(col * page_size, start);
  const int64_t last = std::min((col + 1) * page_size, start + n_tokens);
  if (first >= last) return b;
  b.token = first - start;
  b.tokens = last - first;
  b.page = table(b.row, col);
  b.in_page = first - col * page_size;
  return b;
}

/// Writes tokens [0, n_tokens) of every sequence b to logical positions
/// starts[b] + s, through the page table.
template <class Index>
void write_cpu(const PageTableRef<Index>& table,  // [B, max_pages]
               const std::vector<int64_t>& starts,  // [B]
               int64_t n_tokens, const TokenMajorKv<const char>& src, const LayerPages<char>& dst,
               const PageGeometry& g, int64_t elem_size) {
  if (n_tokens == 0 || table.rows == 0) return;
  const PageDivisor pages(g.page_size);
  const int64_t items_per_row = write_items_per_row(starts, n_tokens, pages);
  const int64_t token_bytes = g.n_heads * g.head_dim * elem_size;
  const int64_t bytes_per_item = 2 * std::min(n_tokens, g.page_size) * token_bytes;
  const bool stream = use_streaming_stores(2 * table.rows * n_tokens * token_bytes, dst.strides, g, elem_size);
  const auto run = [&](auto stream_tag, int64_t begin, int64_t end) {
    constexpr bool kStream = decltype(stream_tag)::value;
    for (int64_t item = begin; item < end; ++item) {
      const WriteBlock b = locate_write_block(table, starts, n_tokens, pages, items_per_row, item);
      if (b.tokens == 0) continue;
      const int64_t to = b.page * dst.page_bytes + b.in_page * dst.strides.token;
      const BlockShape shape{b.tokens, g.n_heads, g.head_dim, elem_size};
      copy_block<kStream>(dst.k + to, dst.strides, src.k + b.row * src.k_batch_stride + b.token * src.k_strides.token,
                          src.k_strides, shape);
      copy_block<kStream>(dst.v + to, dst.strides, src.v + b.row * src.v_batch_stride + b.token * src.v_strides.token,
                          src.v_strides, shape);
    }
  };
  parallel_copy(table.rows * items_per_row, grain_for(bytes_per_item), stream, run);
}

/// What one gather work item (sequence `row`, page column `col`) copies:
/// the block's positions [first, last) of the output; [first, valid_end)
/// are read from `page`, the rest are zeros (past the sequence's length, or
/// an unmapped page).
struct GatherBlock {
  int64_t row;        ///< the sequence
  int64_t first;      ///< first position of the block (the page column's first)
  int64_t last;       ///< one past its last: the column's end, or T
  int64_t valid_end;  ///< end of the positions read from `page`
  int64_t page;       ///< the page read; kUnmappedPage when none is
};

/// The block of work item `item` of a gather over `cols` page columns of
/// every sequence (items run sequence-major).
template <class Index>
inline GatherBlock locate_gather_block(const PageTableRef<Index>& table,    // [B, max_pages]
                                       const std::vector<int64_t>& lengths,  // [B], each <= T
                                       int64_t n_tokens,                     // T
                                       int64_t page_size, int64_t cols, int64_t item) {
  GatherBlock b{};
  b.row = item / cols;
  const int64_t col = item % cols;
  b.first = col * page_size;
  b.last = std::min(b.first + page_size, n_tokens);
  b.valid_end = std::min(std::max(lengths[static_cast<size_t>(b.row)], b.first), b.last);
  b.page = b.valid_end > b.first ? static_cast<int64_t>(table(b.row, col)) : kUnmappedPage;
  if (b.page == kUnmappedPage) b.valid_end = b.first;
  return b;
}

/// Reads positions [0, lengths[b]) of every sequence into contiguous
/// [B, T, H, D] outputs; positions past a length, and unmapped pages, are zeros.
template <class Index>
void gather_cpu(const PageTableRef<Index>& table,    // [B, max_pages]
                const std::vector<int64_t>& lengths,  // [B], each <= T
                int64_t n_tokens,                     // T
                const LayerPages<const char>& src, const TokenMajorKv<char>& dst, const PageGeometry& g,
                int64_t elem_size) {
  if (n_tokens == 0 || table.rows == 0) return;
  const int64_t page_size = g.page_size;
  const int64_t cols = (n_tokens + page_size - 1) / page_size;
  const int64_t token_bytes = g.n_heads * g.head_dim * elem_size;
  const int64_t bytes_per_item = 2 * std::min(n_tokens, page_size) * token_bytes;
  const bool stream = use_streaming_gather(2 * table.rows * n_tokens * token_bytes);
  const auto run = [&](auto stream_tag, int64_t begin, int64_t end) {
    constexpr bool kStream = decltype(stream_tag)::value;
    for (int64_t item = begin; item < end; ++item) {
      const GatherBlock b = locate_gather_block(table, lengths, n_tokens, page_size, cols, item);
      char* k_out = dst.k + b.row * dst.k_batch_stride + b.first * token_bytes;
      char* v_out = dst.v + b.row * dst.v_batch_stride + b.first * token_bytes;
      if (b.valid_end > b.first) {
        const BlockShape shape{b.valid_end - b.first, g.n_heads, g.head_dim, elem_size};
        copy_block<kStream>(k_out, dst.k_strides, src.k + b.page * src.page_bytes, src.strides, shape);
        copy_block<kStream>(v_out, dst.v_strides, src.v + b.page * src.page_bytes, src.strides, shape);
      }
      const int64_t valid_bytes = (b.valid_end - b.first) * token_bytes;
      zero_tokens(k_out + valid_bytes, b.last - b.valid_end, token_bytes);
      zero_tokens(v_out + valid_bytes, b.last - b.valid_end, token_bytes);
    }
  };
  parallel_copy(table.rows * cols, grain_for(bytes_per_item), stream, run);
}

/// Storage for the outputs of CPU gathers, recycled once the caller has
/// dropped every tensor that used it. A fresh large at::empty costs a page
/// fault per 4 KiB (the kernel zeroes each page on first touch), which made
/// a gather several times slower than a memcpy of the same bytes; engines
/// drop a gather's k and v before the next gather (next layer, next step),
/// so the storage can be reused. A storage is reused only when nothing else
/// refers to it (no tensor, no view, no weak reference), when it is large
/// enough, and when it is at most twice the size needed (so a small gather
/// does not pin a huge buffer). Holds at most one storage per slot.
/// Thread-safe (gather is const and may run concurrently).
class OutputRecycler {
 public:
  static constexpr size_t kSlots = 2;  ///< one for k, one for v

  /// An uninitialised contiguous tensor of `sizes` on the CPU.
  at::Tensor empty(size_t slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
    const int64_t numel = c10::multiply_integers(sizes);
    const auto bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
    c10::Storage storage;
    if (bytes > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      c10::Storage& cached = cached_[slot];
      if (cached && reusable(cached, bytes, options)) storage = std::move(cached);
      cached = c10::Storage();
    }
    at::Tensor out;
    if (storage) {
      std::vector<int64_t> strides(sizes.size(), 1);
      for (size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(sizes[d], 1);
      out = at::empty({0}, options).set_(storage, 0, sizes, strides);
    } else {
      out = at::empty(sizes, options);
      if (bytes == 0) return out;
      storage = out.storage();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    cached_[slot] = std::move(storage);
    return out;
  }

 private:
  static bool reusable(const c10::Storage& s, size_t bytes, const at::TensorOptions& options) {
    // use_count 1: only this recycler holds it; weak count 2: the recycler's
    // strong reference plus the temporary weak pointer asked.
    return s.use_count() == 1 && s.getWeakStorageImpl().weak_use_count() == 2 && s.nbytes() >= bytes &&
           s.nbytes() <= 2 * bytes && s.device() == options.device() && s.data() != nullptr;
  }

  std::mutex mutex_;
  std::array<c10::Storage, kSlots> cached_;
};

/// A zeroed tensor for a cache's K or V storage. On Linux, CPU storage is
/// advised to use transparent huge pages before its first touch: the kernels
/// hop between pages far apart, and with 4 KiB pages every hop is a TLB miss
/// (a nested page walk under a hypervisor). Only a hint: the storage is
/// zeroed whole anyway, so it costs no memory.
inline at::Tensor zeroed_storage(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty(shape, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (t.device().is_cpu() && t.nbytes() >= kHuge) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t last = (begin + t.nbytes()) & ~(kHuge - 1);
    if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return t.zero_();
}

/// Row of the [n_pages * page_size * n_heads, head_dim] view of one layer
/// that holds (page, token offset, head): the layout's strides in head rows.
inline int64_t head_row(const PageGeometry& g, int64_t page, int64_t offset, int64_t head) {
  return (page * g.page_elems + g.offset(offset, head)) / g.head_dim;
}

inline at::Tensor host_index(const std::vector<int64_t>& values, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return device.is_cpu() ? host : host.to(device);
}

/// Device-agnostic write: index_copy_ of head rows into the flattened layer.
template <class Index>
void write_generic(const PageTableRef<Index>& table, const std::vector<int64_t>& starts, int64_t n_tokens,
                   const at::Tensor& k,        // [B, S, H, D]
                   const at::Tensor& v,        // [B, S, H, D]
                   const at::Tensor& k_layer,  // [n_pages, <page>]
                   const at::Tensor& v_layer,  // [n_pages, <page>]
                   const PageGeometry& g) {
  if (n_tokens == 0 || table.rows == 0) return;
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(table.rows * n_tokens * g.n_heads));
  for (int64_t b = 0; b < table.rows; ++b) {
    for (int64_t s = 0; s < n_tokens; ++s) {
      const int64_t pos = starts[static_cast<size_t>(b)] + s;
      const int64_t page = table(b, pos / g.page_size);
      for (int64_t h = 0; h < g.n_heads; ++h) rows.push_back(head_row(g, page, pos % g.page_size, h));
    }
  }
  const at::Tensor index = host_index(rows, k_layer.device());
  k_layer.view({-1, g.head_dim}).index_copy_(0, index, k.reshape({-1, g.head_dim}));
  v_layer.view({-1, g.head_dim}).index_copy_(0, index, v.reshape({-1, g.head_dim}));
}

/// Device-agnostic gather, one index entry per (sequence, page column): the
/// layer seen as [n_pages, P, H, D] through the layout's strides (so HND
/// pages come out token-major), index_select of whole pages, then zeros
/// where a column is unmapped or past a length. Indexing head rows instead
/// (B*T*H entries built on the host and copied to the device per call) made
/// it 2.5x slower (bench/NOTES.md, change 10).
template <class Index>
std::pair<at::Tensor, at::Tensor> gather_generic(const PageTableRef<Index>& table,
                                                 const std::vector<int64_t>& lengths,  // [B], each <= T
                                                 int64_t n_tokens,                     // T
                                                 const at::Tensor& k_layer,  // [n_pages, <page>]
                                                 const at::Tensor& v_layer,  // [n_pages, <page>]
                                                 const PageGeometry& g) {
  const int64_t batch = table.rows;
  const int64_t page_size = g.page_size;
  const int64_t cols = (n_tokens + page_size - 1) / page_size;
  if (batch == 0 || cols == 0) {
    return {at::zeros({batch, n_tokens, g.n_heads, g.head_dim}, k_layer.options()),
            at::zeros({batch, n_tokens, g.n_heads, g.head_dim}, v_layer.options())};
  }
  std::vector<int64_t> pages(static_cast<size_t>(batch * cols), 0);  // [B * cols]; 0: any page, masked
  std::vector<int64_t> valid(static_cast<size_t>(batch * cols), 0);  // [B * cols] leading tokens kept
  bool masked = false;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = std::min(lengths[static_cast<size_t>(b)], n_tokens);
    for (int64_t c = 0; c < cols; ++c) {
      const auto slot = static_cast<size_t>(b * cols + c);
      const int64_t page = c * page_size < length ? static_cast<int64_t>(table(b, c)) : kUnmappedPage;
      if (page != kUnmappedPage) {
        pages[slot] = page;
        valid[slot] = std::min(page_size, length - c * page_size);
      }
      masked |= valid[slot] < std::min(page_size, n_tokens - c * page_size);
    }
  }
  const at::Device device = k_layer.device();
  const at::Tensor page_index = host_index(pages, device);
  at::Tensor zeroed;  // [B, cols * P, 1, 1] bool: positions that read as zeros
  if (masked) {
    const at::Tensor offsets = at::arange(page_size, at::TensorOptions().dtype(at::kLong).device(device));
    zeroed = (offsets.view({1, 1, page_size}) >= host_index(valid, device).view({batch, cols, 1}))
                 .view({batch, cols * page_size, 1, 1});
  }
  const auto gather_layer = [&](const at::Tensor& layer) {
    const at::Tensor by_token = layer.as_strided({layer.size(0), page_size, g.n_heads, g.head_dim},
                                                 {g.page_elems, g.token_stride, g.head_stride, 1});
    at::Tensor out = by_token.index_select(0, page_index).reshape({batch, cols * page_size, g.n_heads, g.head_dim});
    if (masked) out.masked_fill_(zeroed, 0);
    return cols * page_size == n_tokens ? out : out.narrow(1, 0, n_tokens).contiguous();
  };
  return {gather_layer(k_layer), gather_layer(v_layer)};
}

}  // namespace kernels
}  // namespace pagedkv
