#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "pagedkv/page_pool.hpp"

namespace {

using pagedkv::PagePool;

TEST(PagePool, AllocatesLowestFirstLikeTheReference) {
  PagePool pool(5);
  EXPECT_EQ(pool.n_pages(), 5);
  EXPECT_EQ(pool.n_free(), 5);
  EXPECT_EQ(pool.alloc(), 0);
  EXPECT_EQ(pool.alloc(), 1);
  EXPECT_EQ(pool.alloc(), 2);
  pool.free(1);
  EXPECT_EQ(pool.alloc(), 1);  // the lowest free page comes back first
  EXPECT_EQ(pool.alloc_n(2), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(pool.alloc(), -1);
  EXPECT_EQ(pool.n_free(), 0);
}

TEST(PagePool, AllocNIsAllOrNothing) {
  PagePool pool(4);
  pool.alloc();
  EXPECT_TRUE(pool.alloc_n(4).empty());
  EXPECT_EQ(pool.n_free(), 3);
  for (int64_t p = 1; p < 4; ++p) EXPECT_EQ(pool.ref_count(p), 0);
  EXPECT_EQ(pool.alloc_n(0), std::vector<int64_t>{});
  EXPECT_EQ(pool.alloc_n(3), (std::vector<int64_t>{1, 2, 3}));
}

TEST(PagePool, AllocNFillsHolesInAscendingOrder) {
  PagePool pool(10);
  pool.alloc_n(10);
  for (int64_t p : {7, 2, 9, 4}) pool.free(p);
  EXPECT_EQ(pool.alloc_n(3), (std::vector<int64_t>{2, 4, 7}));
  EXPECT_EQ(pool.alloc(), 9);
}

TEST(PagePool, RefCountsShareAndRelease) {
  PagePool pool(3);
  const int64_t p = pool.alloc();
  pool.retain(p);
  pool.retain(p);
  EXPECT_EQ(pool.ref_count(p), 3);
  pool.free(p);
  pool.free(p);
  EXPECT_EQ(pool.ref_count(p), 1);
  EXPECT_EQ(pool.n_free(), 2);
  pool.free(p);
  EXPECT_EQ(pool.ref_count(p), 0);
  EXPECT_EQ(pool.n_free(), 3);
  EXPECT_FALSE(pool.is_allocated(p));
}

/// Bad calls throw c10::Error with a message naming the call, and change nothing.
void expect_rejected(PagePool& pool, const std::function<void()>& call, const std::string& phrase) {
  std::vector<int64_t> refs_before;
  for (int64_t p = 0; p < pool.n_pages(); ++p) refs_before.push_back(pool.ref_count(p));
  const int64_t free_before = pool.n_free();
  try {
    call();
    ADD_FAILURE() << "expected c10::Error containing '" << phrase << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.n_free(), free_before);
  for (int64_t p = 0; p < pool.n_pages(); ++p) EXPECT_EQ(pool.ref_count(p), refs_before[static_cast<size_t>(p)]);
}

TEST(PagePool, RetainAllAndFreeAllCountEveryListedPage) {
  PagePool pool(6);
  EXPECT_EQ(pool.alloc_n(4), (std::vector<int64_t>{0, 1, 2, 3}));
  pool.retain_all({1, 2, 2});  // a page listed twice gains 2
  EXPECT_EQ(pool.ref_count(0), 1);
  EXPECT_EQ(pool.ref_count(1), 2);
  EXPECT_EQ(pool.ref_count(2), 3);
  pool.retain_all({});
  pool.free_all({});
  EXPECT_EQ(pool.n_free(), 2);
  pool.free_all({2, 0, 2, 1, 2});  // 0 and 2 reach 0 and are free again; 1 only loses a reference
  EXPECT_EQ(pool.ref_count(0), 0);
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.ref_count(2), 0);
  EXPECT_EQ(pool.n_free(), 4);
  EXPECT_NO_THROW(pool.check());
  EXPECT_EQ(pool.alloc_n(3), (std::vector<int64_t>{0, 2, 4}));  // the freed pages come back lowest-first
}

TEST(PagePool, RetainAllAndFreeAllAreAllOrNothing) {
  PagePool pool(5);
  pool.alloc_n(4);  // pages 0..3, page 4 free
  pool.retain(1);   // ref 2
  // The bad entry comes last, after entries the call would already have
  // changed: a partial change would show in the ref counts or n_free.
  expect_rejected(pool, [&] { pool.retain_all({0, 1, 4}); },
                  "PagePool::retain_all: argument 'pages' expected allocated pages, got page 4 at pages[2] which is "
                  "free (retain of a free page)");
  expect_rejected(pool, [&] { pool.retain_all({0, 5}); }, "retain_all: argument 'pages' expected ids in [0, 5), got 5 "
                                                          "at pages[1]");
  expect_rejected(pool, [&] { pool.retain_all({2, -1}); }, "got -1 at pages[1]");
  expect_rejected(pool, [&] { pool.free_all({0, 2, 4}); },
                  "PagePool::free_all: argument 'pages' expected allocated pages, got page 4 at pages[2] which is "
                  "already free (double free)");
  // 0 reaches 0 at pages[0] (and would be free) before pages[2] lists it again.
  expect_rejected(pool, [&] { pool.free_all({0, 1, 0}); },
                  "PagePool::free_all: argument 'pages' expected each page at most ref_count times, got page 0 at "
                  "pages[2] listed 2 times with ref_count 1 (double free)");
  expect_rejected(pool, [&] { pool.free_all({3, 1, 1, 1}); }, "got page 1 at pages[3] listed 3 times with ref_count 2");
  expect_rejected(pool, [&] { pool.free_all({3, 7}); }, "free_all: argument 'pages' expected ids in [0, 5), got 7");
  EXPECT_NO_THROW(pool.check());  // the free bitmap was restored too
  EXPECT_EQ(pool.alloc(), 4);
  EXPECT_EQ(pool.alloc(), -1);
}

TEST(PagePool, RejectsBadCallsWithoutChangingAnything) {
  PagePool pool(4);
  pool.alloc_n(2);
  expect_rejected(pool, [&] { pool.free(3); }, "PagePool::free: argument 'page' expected an allocated page, got page 3");
  expect_rejected(pool, [&] { pool.free(3); }, "double free");
  expect_rejected(pool, [&] { pool.retain(2); }, "retain of a free page");
  expect_rejected(pool, [&] { pool.free(4); }, "PagePool::free: argument 'page' expected in [0, 4), got 4");
  expect_rejected(pool, [&] { pool.free(-1); }, "expected in [0, 4), got -1");
  expect_rejected(pool, [&] { pool.retain(-5); }, "PagePool::retain");
  expect_rejected(pool, [&] { (void)pool.ref_count(9); }, "PagePool::ref_count");
  expect_rejected(pool, [&] { pool.alloc_n(-1); }, "PagePool::alloc_n: argument 'n' expected >= 0, got -1");
}

TEST(PagePool, RejectsBadSizes) {
  EXPECT_THROW(PagePool(0), c10::Error);
  EXPECT_THROW(PagePool(-3), c10::Error);
  EXPECT_THROW(PagePool(int64_t{1} << 40), c10::Error);
}

TEST(PagePool, DoubleFreeAfterSharingIsCaught) {
  PagePool pool(2);
  const int64_t p = pool.alloc();
  pool.retain(p);
  pool.free(p);
  pool.free(p);
  EXPECT_THROW(pool.free(p), c10::Error);
  EXPECT_EQ(pool.ref_count(p), 0);  // never negative, unlike the reference
  EXPECT_EQ(pool.n_free(), 2);
}

TEST(PagePool, MillionPagesStayLowestFirst) {
  const int64_t n = int64_t{1} << 20;
  PagePool pool(n);
  EXPECT_EQ(static_cast<int64_t>(pool.alloc_n(n).size()), n);
  EXPECT_EQ(pool.alloc(), -1);
  std::mt19937_64 rng(3);
  std::vector<int64_t> freed;
  for (int i = 0; i < 1000; ++i) freed.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(n)));
  std::sort(freed.begin(), freed.end());
  freed.erase(std::unique(freed.begin(), freed.end()), freed.end());
  std::vector<int64_t> order = freed;
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t p : order) pool.free(p);
  EXPECT_EQ(pool.n_free(), static_cast<int64_t>(freed.size()));
  for (int64_t p : freed) EXPECT_EQ(pool.alloc(), p);
  EXPECT_EQ(pool.n_free(), 0);
}

TEST(PagePool, RandomOperationsAgreeWithAModel) {
  std::mt19937_64 rng(11);
  for (int64_t n : {1, 3, 64, 65, 1000}) {
    PagePool pool(n);
    std::vector<int64_t> refs(static_cast<size_t>(n), 0);
    for (int step = 0; step < 5000; ++step) {
      const auto op = rng() % 4;
      const int64_t page = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
      int64_t& ref = refs[static_cast<size_t>(page)];
      if (op == 0) {
        const auto lowest = std::find(refs.begin(), refs.end(), 0);
        const int64_t expected = lowest == refs.end() ? -1 : lowest - refs.begin();
        ASSERT_EQ(pool.alloc(), expected);
        if (expected >= 0) refs[static_cast<size_t>(expected)] = 1;
      } else if (op == 1) {
        if (ref > 0) {
          pool.free(page);
          --ref;
        } else {
          EXPECT_THROW(pool.free(page), c10::Error);
        }
      } else if (op == 2) {
        if (ref > 0) {
          pool.retain(page);
          ++ref;
        } else {
          EXPECT_THROW(pool.retain(page), c10::Error);
        }
      } else {
        const int64_t want = static_cast<int64_t>(rng() % 4);
        const int64_t free_now = std::count(refs.begin(), refs.end(), 0);
        const std::vector<int64_t> got = pool.alloc_n(want);
        if (want > free_now) {
          ASSERT_TRUE(got.empty());
        } else {
          ASSERT_EQ(static_cast<int64_t>(got.size()), want);
          for (int64_t p : got) {
            ASSERT_EQ(refs[static_cast<size_t>(p)], 0);
            ASSERT_EQ(std::find(refs.begin(), refs.end(), 0) - refs.begin(), p);
            refs[static_cast<size_t>(p)] = 1;
          }
        }
      }
      ASSERT_EQ(pool.n_free(), std::count(refs.begin(), refs.end(), 0));
      ASSERT_EQ(pool.ref_count(page), refs[static_cast<size_t>(page)]);
    }
  }
}

}  // namespace
