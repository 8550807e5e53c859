// PagePool::check() / PagedCache::check(): pass on every reachable state,
// and name the first broken invariant when the state is corrupted (through
// the test-only access structs befriended by HierarchicalBitmap and PagePool).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "pagedkv/pagedkv.hpp"
#include "test_support.hpp"

namespace pagedkv {

struct HierarchicalBitmapTestAccess {
  static std::vector<std::vector<uint64_t>>& levels(HierarchicalBitmap& b) { return b.levels_; }
};

struct PagePoolTestAccess {
  static HierarchicalBitmap& free_bitmap(PagePool& p) { return p.free_; }
  static std::vector<int32_t>& refs(PagePool& p) { return p.refs_; }
  static int64_t& n_free(PagePool& p) { return p.n_free_; }
};

}  // namespace pagedkv

namespace {

using pagedkv::HierarchicalBitmap;
using pagedkv::HierarchicalBitmapTestAccess;
using pagedkv::PagedCache;
using pagedkv::PagePool;
using pagedkv::PagePoolTestAccess;
using pagedkv_test::expect_error;

TEST(BitmapAudit, CleanOnEveryShapeAndAfterRandomOperations) {
  std::mt19937_64 rng(11);
  for (int64_t size : {1, 2, 63, 64, 65, 4095, 4096, 4097, 262144, 262145}) {
    for (bool all_set : {false, true}) {
      HierarchicalBitmap bitmap(size, all_set);
      EXPECT_EQ(bitmap.audit(), "") << size;
      for (int step = 0; step < 2000; ++step) {
        const auto i = static_cast<int64_t>(rng() % static_cast<uint64_t>(size));
        if (rng() % 2) bitmap.set(i);
        else bitmap.clear(i);
      }
      EXPECT_EQ(bitmap.audit(), "") << size;
      EXPECT_TRUE(bitmap.summaries_consistent());
    }
  }
}

TEST(BitmapAudit, NamesASummaryBitThatDisagrees) {
  HierarchicalBitmap bitmap(4097, false);
  bitmap.set(130);  // level 0 word 2; level 1 bit 2
  HierarchicalBitmapTestAccess::levels(bitmap)[1][0] &= ~(uint64_t{1} << 2);
  EXPECT_EQ(bitmap.audit(), "level 1 bit 2 is clear but level 0 word 2 is non-zero");
  HierarchicalBitmapTestAccess::levels(bitmap)[1][0] |= uint64_t{1} << 2;
  EXPECT_EQ(bitmap.audit(), "");
  HierarchicalBitmapTestAccess::levels(bitmap)[2][0] |= uint64_t{1} << 1;  // level 1 word 1 is empty
  EXPECT_EQ(bitmap.audit(), "level 2 bit 1 is set but level 1 word 1 is zero");
}

TEST(BitmapAudit, NamesAStrayBitPastTheEnd) {
  HierarchicalBitmap bitmap(70, true);
  HierarchicalBitmapTestAccess::levels(bitmap)[0][1] |= uint64_t{1} << 10;  // bit 74 of 70
  EXPECT_EQ(bitmap.audit(), "level 0 word 1 has bit 74 set, past the level's 70 bits");
}

TEST(BitmapAudit, NamesAWrongLevelSize) {
  HierarchicalBitmap bitmap(200, false);
  HierarchicalBitmapTestAccess::levels(bitmap)[0].pop_back();
  EXPECT_EQ(bitmap.audit(), "level 0 has 3 words, expected 4");
}

TEST(PoolCheck, PassesOnEveryStateOfARandomRun) {
  std::mt19937_64 rng(5);
  PagePool pool(300);
  std::vector<int64_t> held;
  for (int step = 0; step < 5000; ++step) {
    switch (rng() % 4) {
      case 0: {
        const int64_t p = pool.alloc();
        if (p >= 0) held.push_back(p);
        break;
      }
      case 1: {
        for (int64_t p : pool.alloc_n(static_cast<int64_t>(rng() % 5))) held.push_back(p);
        break;
      }
      case 2:
        if (!held.empty()) {
          const int64_t p = held[rng() % held.size()];
          pool.retain(p);
          held.push_back(p);
        }
        break;
      default:
        if (!held.empty()) {
          const size_t i = rng() % held.size();
          pool.free(held[i]);
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
        }
    }
    ASSERT_NO_THROW(pool.check()) << "step " << step;
  }
}

TEST(PoolCheck, NamesANegativeRefCount) {
  PagePool pool(10);
  pool.alloc_n(4);
  PagePoolTestAccess::refs(pool)[3] = -1;
  expect_error([&] { pool.check(); }, {"pagedkv::PagePool::check", "page 3 has ref_count -1, expected >= 0"});
}

TEST(PoolCheck, NamesAnAllocatedPageTheBitmapCallsFree) {
  PagePool pool(10);
  pool.alloc_n(4);
  PagePoolTestAccess::free_bitmap(pool).set(2);
  expect_error([&] { pool.check(); },
               {"pagedkv::PagePool::check", "page 2 has ref_count 1 but the free bitmap marks it free"});
}

TEST(PoolCheck, NamesAFreePageTheBitmapCallsAllocated) {
  PagePool pool(10);
  pool.alloc_n(4);
  PagePoolTestAccess::free_bitmap(pool).clear(7);
  expect_error([&] { pool.check(); },
               {"pagedkv::PagePool::check", "page 7 has ref_count 0 but the free bitmap marks it allocated"});
}

TEST(PoolCheck, NamesAWrongNFree) {
  PagePool pool(10);
  pool.alloc_n(4);
  ++PagePoolTestAccess::n_free(pool);
  expect_error([&] { pool.check(); }, {"pagedkv::PagePool::check", "n_free() is 7 but 6 pages have ref_count 0"});
}

TEST(PoolCheck, NamesAnInconsistentSummaryLevel) {
  PagePool pool(5000);
  pool.alloc_n(64);  // level 0 word 0 is empty now, so level 1 bit 0 is clear
  HierarchicalBitmapTestAccess::levels(PagePoolTestAccess::free_bitmap(pool))[1][0] |= 1;
  expect_error([&] { pool.check(); },
               {"pagedkv::PagePool::check", "free bitmap is inconsistent",
                "level 1 bit 0 is set but level 0 word 0 is zero"});
}

TEST(PoolCheck, ChangesNothing) {
  PagePool pool(100);
  pool.alloc_n(10);
  pool.retain(3);
  pool.free(5);
  pool.check();
  EXPECT_EQ(pool.n_free(), 91);
  EXPECT_EQ(pool.ref_count(3), 2);
  EXPECT_EQ(pool.ref_count(5), 0);
  EXPECT_EQ(pool.alloc(), 5);
}

template <class Layout>
PagedCache<Layout> small_cache() {
  return PagedCache<Layout>(2, 6, 3, 2, 4, at::TensorOptions().dtype(at::kFloat));
}

TEST(CacheCheck, PassesAfterWritesAndPoolCalls) {
  auto cache = small_cache<pagedkv::HND>();
  cache.check();
  const auto pages = cache.alloc_n(4);
  cache.retain(pages[1]);
  const at::Tensor table = pagedkv_test::table({{pages[0], pages[1]}, {pages[2], pages[3]}});
  const at::Tensor k = pagedkv_test::pattern({2, 5, 2, 4}, 1, at::kFloat);
  cache.write(1, table, 1, k, k);
  cache.check();
  cache.free(pages[1]);
  cache.check();
  EXPECT_NO_THROW(cache.bind(table, 6).gather(1));
  cache.check();
}

TEST(CacheCheck, ReportsPoolCorruption) {
  auto cache = small_cache<pagedkv::NHD>();
  cache.alloc_n(2);
  PagePoolTestAccess::refs(cache.pool())[1] = -3;
  expect_error([&] { cache.check(); }, {"pagedkv::PagePool::check", "page 1 has ref_count -3"});
}

TEST(CacheCheck, NamesAResizedStorage) {
  auto cache = small_cache<pagedkv::NHD>();
  cache.v_cache().resize_({2, 5, 3, 2, 4});  // an engine shrinks the cache in place
  expect_error([&] { cache.check(); }, {"pagedkv::PagedCache<NHD>::check", "v_cache has shape [2, 5, 3, 2, 4]",
                                        "expected [2, 6, 3, 2, 4]"});
}

TEST(CacheCheck, NamesANonContiguousStorage) {
  auto cache = small_cache<pagedkv::HND>();
  const at::Tensor& k = cache.k_cache();
  // Same sizes, other strides: the kernels' page arithmetic would be wrong.
  k.as_strided_(k.sizes(), {6 * 2 * 3 * 4, 2 * 3 * 4, 1, 2, 6});
  expect_error([&] { cache.check(); }, {"pagedkv::PagedCache<HND>::check", "k_cache has strides",
                                        "expected contiguous"});
}

TEST(CacheCheck, NamesAnUndefinedStorage) {
  auto cache = small_cache<pagedkv::NHD>();
  const_cast<at::Tensor&>(cache.k_cache()) = at::Tensor();
  expect_error([&] { cache.check(); }, {"pagedkv::PagedCache<NHD>::check", "k_cache is undefined"});
}

TEST(CacheCheck, NamesADtypeMismatchBetweenKAndV) {
  auto cache = small_cache<pagedkv::NHD>();
  const_cast<at::Tensor&>(cache.v_cache()) = at::zeros(cache.k_cache().sizes(), at::kHalf);
  expect_error([&] { cache.check(); }, {"pagedkv::PagedCache<NHD>::check", "v_cache has dtype Half",
                                        "expected k_cache's Float"});
}

}  // namespace
