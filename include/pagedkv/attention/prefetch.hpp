// Software prefetch in the CPU attention kernel: which sides are read
// ahead, and in what pieces. The kernel reads one kv head of a key block at
// a time, a chunk of about kPrefetchChunkBytes at a time; before each chunk
// it asks for the chunk it reads after that one (the head's next, or the
// first of the next head, or of the next block's first head). A burst of a
// whole block's lines, as before, filled the core's miss buffers and stalled
// the arithmetic behind it (bench/NOTES.md, "Reading one chunk ahead").
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "pagedkv/layouts.hpp"

namespace pagedkv {
namespace attention_kernels {

/// Asks for the 64-byte line at `address` to be brought into the caches
/// (L2 and nearer). An asm statement where there is one: g++ counts
/// __builtin_prefetch as free of side effects, took prefetch_rows (nothing
/// but prefetches) for a pure function and deleted the calls whose result,
/// none, was unused: the kernel ran without prefetching (bench/NOTES.md,
/// "Reading one chunk ahead").
inline void prefetch_line(const void* address) noexcept {
#if defined(__GNUC__) && defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm volatile("prfm pldl2keep, [%0]" : : "r"(address));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

/// Asks for the `bytes` bytes at `first` to be brought into the caches:
/// each 64-byte line they touch, once.
inline void prefetch_bytes(const void* first, int64_t bytes) noexcept {
  constexpr uintptr_t kLine = 64;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(first);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = begin & ~(kLine - 1); line < end; line += kLine) {
    prefetch_line(reinterpret_cast<const void*>(line));
  }
}

/// Asks for the `n` stored vectors at rows[0, n) (`bytes` each) to be
/// brought into the caches, ahead of their use.
inline void prefetch_rows(const void* const* rows,  // [n]
                          int64_t n, int64_t bytes) noexcept {
  for (int64_t j = 0; j < n; ++j) prefetch_bytes(rows[j], bytes);
}

/// Prefetches the chunk read after rows [j0, j0 + chunk) of a head: rows
/// [j0 + chunk, j0 + 2 chunk) of the same head, else the first chunk of
/// the head read after it (`ahead`, of which `ahead_n` rows are located).
inline void prefetch_chunk_after(const void* const* rows,  // [n]: this head's
                                 int64_t n,
                                 const void* const* ahead,  // [ahead_n]: the next head's
                                 int64_t ahead_n, int64_t j0, int64_t chunk, int64_t bytes) noexcept {
  const int64_t j1 = j0 + chunk;
  if (j1 < n) {
    prefetch_rows(rows + j1, std::min(chunk, n - j1), bytes);
  } else {
    prefetch_rows(ahead, std::min(chunk, ahead_n), bytes);
  }
}

/// Bytes of one head's vectors prefetched at once, between two pieces of
/// work: 32 lines, about what one core keeps in flight. Bursts of 64 lines
/// and more were slower (bench/NOTES.md, "Reading one chunk ahead").
constexpr int64_t kPrefetchChunkBytes = 2048;

/// The shortest run of a head's bytes, contiguous in a page, that this CPU's
/// hardware prefetchers fetch well enough on their own. Intel's L2 streamer
/// keeps up from 2 KiB (HND pages of 16 fp16 tokens are 4 KiB per head;
/// prefetching those as well cost 10-20 %); AMD's (Zen 3) did not on 4 KiB
/// runs: prefetching them took 30-40 % off attention decode. Elsewhere
/// every side is prefetched. bench/NOTES.md has both measurements.
inline int64_t hardware_streamed_run_bytes() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const int64_t bytes = __builtin_cpu_is("intel") ? int64_t{2048} : std::numeric_limits<int64_t>::max();
  return bytes;
#else
  return std::numeric_limits<int64_t>::max();
#endif
}

/// Whether the kernel prefetches a side whose elements are `elem_size`
/// bytes: when the bytes of one head that lie contiguous in a page are
/// fewer than the hardware streams by itself.
inline bool prefetches_side(const PageGeometry& g, int64_t elem_size) {
  const int64_t run_tokens = g.token_stride == g.head_dim ? g.page_size : 1;  // a head's tokens adjacent (HND) or not
  return run_tokens * g.head_dim * elem_size < hardware_streamed_run_bytes();
}

/// Tokens per chunk when a side is read ahead: kPrefetchChunkBytes of its
/// vectors, a multiple of 4 (the score loop's keys per pass), at least 4.
inline int64_t read_ahead_chunk(int64_t head_dim, int64_t elem_size) noexcept {
  const int64_t tokens = kPrefetchChunkBytes / (head_dim * elem_size);
  return tokens < 4 ? 4 : tokens / 4 * 4;
}

}  // namespace attention_kernels
}  // namespace pagedkv
