#include <gtest/gtest.h>

#include <random>
#include <set>

#include "pagedkv/bitmap.hpp"
#include "pagedkv/bits.hpp"

namespace {

using pagedkv::HierarchicalBitmap;

TEST(Bits, CountrZeroAndPopcount) {
  EXPECT_EQ(pagedkv::bits::countr_zero(1), 0);
  EXPECT_EQ(pagedkv::bits::countr_zero(uint64_t{1} << 63), 63);
  EXPECT_EQ(pagedkv::bits::countr_zero(0b101000), 3);
  EXPECT_EQ(pagedkv::bits::popcount(0), 0);
  EXPECT_EQ(pagedkv::bits::popcount(~uint64_t{0}), 64);
  EXPECT_EQ(pagedkv::bits::popcount(0b1011), 3);
  EXPECT_EQ(pagedkv::bits::low_mask(0), 0u);
  EXPECT_EQ(pagedkv::bits::low_mask(3), 7u);
  EXPECT_EQ(pagedkv::bits::low_mask(64), ~uint64_t{0});
  EXPECT_EQ(pagedkv::bits::words_for(0), 0);
  EXPECT_EQ(pagedkv::bits::words_for(64), 1);
  EXPECT_EQ(pagedkv::bits::words_for(65), 2);
}

TEST(HierarchicalBitmap, StartsFullOrEmpty) {
  for (int64_t size : {1, 63, 64, 65, 4096, 4097, 300000}) {
    HierarchicalBitmap full(size, true);
    EXPECT_EQ(full.count(), size);
    EXPECT_EQ(full.find_first(), 0);
    EXPECT_TRUE(full.summaries_consistent());
    HierarchicalBitmap empty(size, false);
    EXPECT_EQ(empty.count(), 0);
    EXPECT_EQ(empty.find_first(), -1);
    EXPECT_TRUE(empty.summaries_consistent());
  }
}

TEST(HierarchicalBitmap, FindFirstTracksLowestSetBitAcrossLevels) {
  const int64_t size = 64 * 64 * 64 + 5;  // four levels
  HierarchicalBitmap bitmap(size, false);
  bitmap.set(size - 1);
  EXPECT_EQ(bitmap.find_first(), size - 1);
  bitmap.set(4097);
  EXPECT_EQ(bitmap.find_first(), 4097);
  bitmap.clear(4097);
  EXPECT_EQ(bitmap.find_first(), size - 1);
  bitmap.clear(size - 1);
  EXPECT_EQ(bitmap.find_first(), -1);
  EXPECT_TRUE(bitmap.summaries_consistent());
}

TEST(HierarchicalBitmap, RandomOperationsAgreeWithASet) {
  std::mt19937_64 rng(7);
  for (int64_t size : {1, 64, 130, 5000, 262145}) {
    HierarchicalBitmap bitmap(size, false);
    std::set<int64_t> model;
    std::uniform_int_distribution<int64_t> pick(0, size - 1);
    for (int step = 0; step < 20000; ++step) {
      const int64_t i = pick(rng);
      if (rng() % 2) {
        bitmap.set(i);
        model.insert(i);
      } else {
        bitmap.clear(i);
        model.erase(i);
      }
      ASSERT_EQ(bitmap.test(i), model.count(i) == 1);
      ASSERT_EQ(bitmap.find_first(), model.empty() ? -1 : *model.begin());
    }
    EXPECT_EQ(bitmap.count(), static_cast<int64_t>(model.size()));
    EXPECT_TRUE(bitmap.summaries_consistent());
  }
}

}  // namespace
