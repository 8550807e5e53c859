// A bitmap with summary levels: the lowest set bit is found with one
// countr_zero per level (4 levels at 1M bits), and set/clear touch one word
// per level at most.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pagedkv/bits.hpp"

namespace pagedkv {

/// Bitmap over [0, size) whose level l+1 has bit w set iff word w of level l
/// is non-zero. The top level is a single word.
class HierarchicalBitmap {
 public:
  /// All `size` bits start set when `all_set`, else clear.
  explicit HierarchicalBitmap(int64_t size = 0, bool all_set = false) : size_(size) {
    int64_t bits_at_level = size;
    do {
      const int64_t words = bits::words_for(bits_at_level);
      levels_.emplace_back(static_cast<size_t>(words > 0 ? words : 1), uint64_t{0});
      bits_at_level = bits::words_for(bits_at_level);
    } while (bits_at_level > 1);
    if (all_set) fill_all();
  }

  /// Number of bits.
  int64_t size() const noexcept { return size_; }

  /// Whether bit i is set; i must be in [0, size).
  bool test(int64_t i) const noexcept {
    return (levels_[0][static_cast<size_t>(bits::word_index(i))] & bits::bit(i)) != 0;
  }

  /// Lowest set bit, or -1 when none is set.
  int64_t find_first() const noexcept {
    if (levels_.back()[0] == 0) return -1;
    int64_t index = 0;
    for (size_t l = levels_.size(); l-- > 0;) {
      index = index * bits::kWordBits + bits::countr_zero(levels_[l][static_cast<size_t>(index)]);
    }
    return index;
  }

  /// Sets bit i (i in [0, size)); parents are updated only when a word
  /// goes from empty to non-empty.
  void set(int64_t i) noexcept {
    for (auto& level : levels_) {
      uint64_t& word = level[static_cast<size_t>(bits::word_index(i))];
      const bool was_empty = word == 0;
      word |= bits::bit(i);
      if (!was_empty) return;
      i = bits::word_index(i);
    }
  }

  /// Clears bit i (i in [0, size)); parents are updated only when a word
  /// becomes empty.
  void clear(int64_t i) noexcept {
    for (auto& level : levels_) {
      uint64_t& word = level[static_cast<size_t>(bits::word_index(i))];
      word &= ~bits::bit(i);
      if (word != 0) return;
      i = bits::word_index(i);
    }
  }

  /// Clears the `n` lowest set bits and writes their indices, ascending, to
  /// out[0, n); n must not exceed the number of set bits. Word at a time: one
  /// descent through the summaries per level-0 word, not one per bit.
  void take_lowest(int64_t n, int64_t* out) noexcept {
    int64_t taken = 0;
    while (taken < n) {
      int64_t w = 0;  // the first non-zero level-0 word
      for (size_t l = levels_.size(); l-- > 1;) {
        w = w * bits::kWordBits + bits::countr_zero(levels_[l][static_cast<size_t>(w)]);
      }
      uint64_t& word = levels_[0][static_cast<size_t>(w)];
      uint64_t rest = word;
      for (; rest != 0 && taken < n; rest &= rest - 1) out[taken++] = w * bits::kWordBits + bits::countr_zero(rest);
      word = rest;
      // The word is empty: clear its summary bits, as clear() does.
      for (size_t l = 1; rest == 0 && l < levels_.size(); ++l) {
        uint64_t& summary = levels_[l][static_cast<size_t>(bits::word_index(w))];
        summary &= ~bits::bit(w);
        rest = summary;
        w = bits::word_index(w);
      }
    }
  }

  /// Number of set bits (a scan: for audits, not hot paths).
  int64_t count() const noexcept {
    int64_t n = 0;
    for (uint64_t word : levels_[0]) n += bits::popcount(word);
    return n;
  }

  /// Whether every summary bit agrees with the level below (for audits).
  bool summaries_consistent() const noexcept {
    for (size_t l = 1; l < levels_.size(); ++l) {
      const auto& below = levels_[l - 1];
      for (size_t w = 0; w < below.size(); ++w) {
        const bool summary_bit =
            (levels_[l][w / bits::kWordBits] & bits::bit(static_cast<int64_t>(w))) != 0;
        if (summary_bit != (below[w] != 0)) return false;
      }
    }
    return true;
  }

  /// The first broken invariant found by a full scan, described; empty when
  /// there is none (for audits, not hot paths). Checks the level sizes, that
  /// every summary bit agrees with the word below it, and that no bit is set
  /// at or past the end of a level.
  std::string audit() const {
    int64_t bits_at_level = size_;
    for (size_t l = 0; l < levels_.size(); ++l) {
      const auto& level = levels_[l];
      const int64_t words = bits::words_for(bits_at_level);
      const size_t expected_words = static_cast<size_t>(words > 0 ? words : 1);
      if (level.size() != expected_words) {
        return "level " + std::to_string(l) + " has " + std::to_string(level.size()) + " words, expected " +
               std::to_string(expected_words);
      }
      for (size_t w = 0; w < level.size(); ++w) {
        const int64_t remaining = bits_at_level - static_cast<int64_t>(w) * bits::kWordBits;
        const uint64_t stray = level[w] & ~bits::low_mask(remaining > 0 ? remaining : 0);
        if (stray != 0) {
          return "level " + std::to_string(l) + " word " + std::to_string(w) + " has bit " +
                 std::to_string(static_cast<int64_t>(w) * bits::kWordBits + bits::countr_zero(stray)) +
                 " set, past the level's " + std::to_string(bits_at_level) + " bits";
        }
        if (l + 1 < levels_.size()) {
          const bool summary_bit = (levels_[l + 1][w / bits::kWordBits] & bits::bit(static_cast<int64_t>(w))) != 0;
          if (summary_bit != (level[w] != 0)) {
            return "level " + std::to_string(l + 1) + " bit " + std::to_string(w) + " is " +
                   (summary_bit ? "set" : "clear") + " but level " + std::to_string(l) + " word " +
                   std::to_string(w) + " is " + (level[w] != 0 ? "non-zero" : "zero");
          }
        }
      }
      bits_at_level = bits::words_for(bits_at_level);
    }
    if (levels_.back().size() != 1) {
      return "the top level has " + std::to_string(levels_.back().size()) + " words, expected 1";
    }
    return {};
  }

 private:
  friend struct HierarchicalBitmapTestAccess;  // tests corrupt levels_ to prove audit() sees it

  void fill_all() {
    int64_t bits_at_level = size_;
    for (auto& level : levels_) {
      for (int64_t w = 0; w < static_cast<int64_t>(level.size()); ++w) {
        const int64_t remaining = bits_at_level - w * bits::kWordBits;
        level[static_cast<size_t>(w)] = bits::low_mask(remaining);
      }
      bits_at_level = bits::words_for(bits_at_level);
    }
  }

  int64_t size_;
  std::vector<std::vector<uint64_t>> levels_;  // [level][word]; level 0 holds the bits
};

}  // namespace pagedkv
