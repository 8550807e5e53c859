// Tiny bit helpers for 64-bit words (C++17 has no <bit>).
#pragma once

#include <cstdint>

namespace pagedkv {
namespace bits {

/// Number of bits in one bitmap word.
constexpr int kWordBits = 64;

/// Index of the lowest set bit; `word` must not be 0.
inline int countr_zero(uint64_t word) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_ctzll(word);
#else
  int n = 0;
  while ((word & 1u) == 0) {
    word >>= 1;
    ++n;
  }
  return n;
#endif
}

/// Number of set bits.
inline int popcount(uint64_t word) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_popcountll(word);
#else
  int n = 0;
  for (; word != 0; word &= word - 1) ++n;
  return n;
#endif
}

/// The word with only bit `i` set.
constexpr uint64_t bit(int64_t i) noexcept { return uint64_t{1} << (i % kWordBits); }

/// The word holding bit `i`.
constexpr int64_t word_index(int64_t i) noexcept { return i / kWordBits; }

/// Words needed to hold `n` bits.
constexpr int64_t words_for(int64_t n) noexcept { return (n + kWordBits - 1) / kWordBits; }

/// A word whose lowest `n` bits are set (0 <= n <= 64).
constexpr uint64_t low_mask(int64_t n) noexcept {
  return n >= kWordBits ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
}

}  // namespace bits
}  // namespace pagedkv
