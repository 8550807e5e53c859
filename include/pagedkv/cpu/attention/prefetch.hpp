// Software prefetch in the CPU attention kernel: which sides are read
// ahead, and in what pieces. The kernel reads a key block one piece (one kv
// head's chunk of tokens, at most 8) at a time, in a PieceOrder; before each
// piece it asks for the piece it reads after that one (or for the next
// block's first). A burst of a whole block's lines, as before, filled the
// core's miss buffers and stalled the arithmetic behind it (bench/NOTES.md,
// "Reading one chunk ahead").
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "pagedkv/layouts.hpp"
#include "pagedkv/simd/constants.hpp"

namespace pagedkv {
namespace cpu {
namespace attention {

/// Asks for the 64-byte line at `address` to be brought into the caches
/// (L2 and nearer). An asm statement where there is one: g++ counts
/// __builtin_prefetch as free of side effects, took prefetch_rows (nothing
/// but prefetches) for a pure function and deleted the calls whose result,
/// none, was unused: the kernel ran without prefetching (bench/NOTES.md,
/// "Reading one chunk ahead"). The line is a memory operand, which lets
/// the compiler fold the address arithmetic into the instruction (a
/// register operand made the decode step slower), but which it must assume
/// the asm reads: inside a loop over an array of vector accumulators, g++
/// then kept the array in memory, storing it every iteration. Call it
/// between vector loops, as the kernels do, or check the loop's code
/// (bench/NOTES.md, "Spread read-ahead, 512-bit passes and two-page steps
/// on Zen 4").
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

/// Bytes to read ahead a few lines at a time, spread over a piece of work:
/// `rows` runs of `row_lines` lines, `row_stride` bytes apart (one run
/// where the bytes are contiguous).
class LinesAhead {
 public:
  LinesAhead() = default;

  /// The lines that hold [first, first + bytes) of each of `rows` runs
  /// (one run where the rows are contiguous, row_stride == bytes).
  LinesAhead(const void* first, int64_t bytes, int64_t rows, int64_t row_stride) noexcept {
    if (bytes <= 0 || rows <= 0) return;
    if (row_stride == bytes) {
      bytes *= rows;
      rows = 1;
    }
    row_ = static_cast<const char*>(first) - offset_in_line(first);
    row_lines_ = (offset_in_line(first) + bytes + kLine - 1) / kLine;
    row_stride_ = row_stride;
    rows_ = rows;
  }

  /// Asks for the next `count` lines (fewer at the end).
  void next(int64_t count) noexcept {
    // One run with more than `count` lines left (a decode step's usual case):
    // `count` prefetches in a row. The general loop below spends cycles on
    // every line, a visible share of a decode step that reads a page ahead
    // (bench/NOTES.md, "Three keys per score pass").
    if (rows_ == 1 && row_lines_ - line_ > count) {
      const char* const at = row_ + line_ * kLine;
      for (int64_t i = 0; i < count; ++i) prefetch_line(at + i * kLine);
      line_ += count;
      return;
    }
    for (; count > 0 && rows_ > 0; --count) {
      prefetch_line(row_ + line_ * kLine);
      if (++line_ == row_lines_) {
        line_ = 0;
        row_ += row_stride_;
        --rows_;
      }
    }
  }

  /// Asks for every line left.
  void rest() noexcept { next(rows_ * row_lines_); }

 private:
  static constexpr int64_t kLine = 64;
  static int64_t offset_in_line(const void* address) noexcept {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(address) % static_cast<uintptr_t>(kLine));
  }

  const char* row_ = nullptr;
  int64_t row_lines_ = 0;
  int64_t row_stride_ = 0;
  int64_t rows_ = 0;
  int64_t line_ = 0;
};

/// The order in which the kernel reads one side of a key block, a piece
/// (one head's rows [j0, j0 + chunk)) at a time: head by head, each head's
/// chunks in a row, or (token_major) chunk by chunk, every head of a chunk
/// in a row.
struct PieceOrder {
  bool token_major;  ///< chunks outer, heads inner
  int64_t heads;     ///< kv heads of the work item
  int64_t chunk;     ///< tokens per piece

  /// Calls f(head, j0, count) for each piece of a block's first n tokens.
  template <class F>
  void for_each(int64_t n, F&& f) const {
    if (token_major) {
      for (int64_t j0 = 0; j0 < n; j0 += chunk)
        for (int64_t h = 0; h < heads; ++h) f(h, j0, std::min(chunk, n - j0));
    } else {
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j0 = 0; j0 < n; j0 += chunk) f(h, j0, std::min(chunk, n - j0));
    }
  }

  /// The piece read after (h, j0) in a block of n tokens; false when that
  /// is the next block's first.
  bool next_in_block(int64_t n, int64_t& h, int64_t& j0) const noexcept {
    if (token_major) {
      if (++h == heads) {
        h = 0;
        j0 += chunk;
      }
    } else {
      j0 += chunk;
      if (j0 >= n) {
        j0 = 0;
        ++h;
      }
    }
    return h < heads && j0 < n;
  }
};

/// Prefetches the piece read after piece (h, j0) of a block: in `rows`,
/// else the next block's first (head 0, in `next_rows`, of which n_next
/// rows are located).
inline void prefetch_piece_after(const PieceOrder& order,
                                 const void* const* rows,       // [heads, kKeyBlock]: this block's
                                 int64_t n,
                                 const void* const* next_rows,  // [heads, kKeyBlock]: the next block's
                                 int64_t n_next, int64_t h, int64_t j0, int64_t bytes) noexcept {
  if (order.next_in_block(n, h, j0)) {
    prefetch_rows(rows + h * simd::kKeyBlock + j0, std::min(order.chunk, n - j0), bytes);
  } else {
    prefetch_rows(next_rows, std::min(order.chunk, n_next), bytes);
  }
}

/// Bytes of one head's vectors prefetched at once, between two pieces of
/// work: 32 lines, about what one core keeps in flight. Bursts of 64 lines
/// and more were slower (bench/NOTES.md, "Reading one chunk ahead").
constexpr int64_t kPrefetchChunkBytes = 2048;

/// The shortest run of a head's bytes, contiguous in a page, that this CPU's
/// hardware prefetchers fetch well enough alone. Intel's L2 streamer keeps up
/// from 2 KiB: prefetching HND fp16 pages of 16 tokens too cost time
/// (bench/NOTES.md, "Prefetching the next block (Xeon, 2026-12-01)"). AMD's
/// (Zen 3) did not on 4 KiB runs: decode read them much faster prefetched
/// ("Reading one chunk ahead"). Elsewhere every side is prefetched.
inline int64_t hardware_streamed_run_bytes() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const int64_t bytes = __builtin_cpu_is("intel") ? int64_t{2048} : std::numeric_limits<int64_t>::max();
  return bytes;
#else
  return std::numeric_limits<int64_t>::max();
#endif
}

/// Whether the general item loop (kernel.hpp) prefetches a side whose
/// elements are `elem_size` bytes: when the bytes of one head that lie
/// contiguous in a page are fewer than the hardware streams by itself. The
/// decode step reads its next page ahead on every CPU (decode.hpp).
inline bool prefetches_side(const PageGeometry& g, int64_t elem_size) {
  const int64_t run_tokens = g.token_stride == g.head_dim ? g.page_size : 1;  // a head's tokens adjacent (HND) or not
  return run_tokens * g.head_dim * elem_size < hardware_streamed_run_bytes();
}

/// Tokens per chunk when a side is read ahead: 8 where kPrefetchChunkBytes
/// hold 8 of its vectors, else 4 (the score loop's keys per pass).
/// More than 8 rows per chunk was slower even where they are short (fp8
/// rows of 128 bytes, 16 at a time against 8), on NHD pages most
/// (bench/NOTES.md, "Token-major pieces").
inline int64_t read_ahead_chunk(int64_t head_dim, int64_t elem_size) noexcept {
  const int64_t tokens = kPrefetchChunkBytes / (head_dim * elem_size);
  return tokens >= 8 ? 8 : 4;
}

}  // namespace attention
}  // namespace cpu
}  // namespace pagedkv
