// Page layouts: tag types that fix the memory order of one page. Kernels
// never branch on the layout: it is resolved once into a PageGeometry.
#pragma once

#include <array>
#include <cstdint>

#include "pagedkv/bits.hpp"

namespace pagedkv {

/// Token-major page: [page_size, n_kv_heads, head_dim] (the reference's).
struct NHD {
  /// Name used in error messages.
  static constexpr const char* name = "NHD";
  /// Shape of one page.
  static std::array<int64_t, 3> page_shape(int64_t page_size, int64_t n_heads, int64_t head_dim) {
    return {page_size, n_heads, head_dim};
  }
  /// Elements between token t and t+1 of one head inside a page.
  static constexpr int64_t token_stride(int64_t /*page_size*/, int64_t n_heads, int64_t head_dim) {
    return n_heads * head_dim;
  }
  /// Elements between head h and h+1 of one token inside a page.
  static constexpr int64_t head_stride(int64_t /*page_size*/, int64_t /*n_heads*/, int64_t head_dim) {
    return head_dim;
  }
};

/// Head-major page: [n_kv_heads, page_size, head_dim] (attention-friendly:
/// one head's keys of a page are contiguous).
struct HND {
  /// Name used in error messages.
  static constexpr const char* name = "HND";
  /// Shape of one page.
  static std::array<int64_t, 3> page_shape(int64_t page_size, int64_t n_heads, int64_t head_dim) {
    return {n_heads, page_size, head_dim};
  }
  /// Elements between token t and t+1 of one head inside a page.
  static constexpr int64_t token_stride(int64_t /*page_size*/, int64_t /*n_heads*/, int64_t head_dim) {
    return head_dim;
  }
  /// Elements between head h and h+1 of one token inside a page.
  static constexpr int64_t head_stride(int64_t page_size, int64_t /*n_heads*/, int64_t head_dim) {
    return page_size * head_dim;
  }
};

/// One page's geometry with the layout resolved into element strides.
struct PageGeometry {
  int64_t page_size;     ///< tokens per page
  int64_t n_heads;       ///< kv heads
  int64_t head_dim;      ///< elements per head vector
  int64_t token_stride;  ///< elements between consecutive tokens of one head
  int64_t head_stride;   ///< elements between consecutive heads of one token
  int64_t page_elems;    ///< elements in one page

  /// Element offset of (token, head) inside a page.
  int64_t offset(int64_t token, int64_t head) const noexcept {
    return token * token_stride + head * head_stride;
  }

  /// Whether a token's heads lie nearer each other than a head's tokens
  /// (NHD): a page is then read in memory order token by token, every head
  /// of a token in a row; otherwise (HND) head by head.
  bool heads_adjacent() const noexcept { return head_stride < token_stride; }

  template <class Layout>
  static PageGeometry of(int64_t page_size, int64_t n_heads, int64_t head_dim) {
    return {page_size,
            n_heads,
            head_dim,
            Layout::token_stride(page_size, n_heads, head_dim),
            Layout::head_stride(page_size, n_heads, head_dim),
            page_size * n_heads * head_dim};
  }
};

/// The page column of token positions (>= 0): a shift for a power-of-two
/// page size (every engine's default), a division for any other. A small
/// decode write splits positions several times per sequence, and a 64-bit
/// division there was a measurable share of its time (bench/NOTES.md,
/// "Fixed costs of small writes").
class PageDivisor {
 public:
  /// page_size >= 1.
  explicit PageDivisor(int64_t page_size) noexcept
      : page_size_(page_size),
        shift_((page_size & (page_size - 1)) == 0 ? bits::countr_zero(static_cast<uint64_t>(page_size)) : -1) {}

  /// The page column holding `position`: position / page_size.
  int64_t column(int64_t position) const noexcept { return shift_ >= 0 ? position >> shift_ : position / page_size_; }
  /// Tokens per page.
  int64_t page_size() const noexcept { return page_size_; }

 private:
  int64_t page_size_;
  int shift_;  // log2(page_size), or -1 when page_size is not a power of two
};

}  // namespace pagedkv
