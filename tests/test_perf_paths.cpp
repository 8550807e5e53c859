// The fast paths of issue 3 (performance) do exactly what the simple ones
// did: word-at-a-time alloc_n, recycled gather outputs, and the CPU kernels
// on several threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "pagedkv/pagedkv.hpp"
#include "test_support.hpp"

namespace {

using pagedkv::HierarchicalBitmap;
using pagedkv::PagePool;
using pagedkv_test::bitwise_equal;
using pagedkv_test::pattern;

TEST(PerfPaths, TakeLowestEqualsRepeatedFindFirst) {
  std::mt19937_64 rng(1);
  for (int64_t size : {1, 2, 63, 64, 65, 4095, 4096, 4097, 262144, 262145, 300000}) {
    HierarchicalBitmap fast(size, true);
    HierarchicalBitmap slow(size, true);
    for (int64_t i = 0; i < size; ++i) {
      if (rng() % 3 == 0) {
        fast.clear(i);
        slow.clear(i);
      }
    }
    int64_t remaining = fast.count();
    while (remaining > 0) {
      const int64_t n = std::min<int64_t>(remaining, static_cast<int64_t>(rng() % 200));
      std::vector<int64_t> got(static_cast<size_t>(n));
      fast.take_lowest(n, got.data());
      for (int64_t j = 0; j < n; ++j) {
        const int64_t want = slow.find_first();
        slow.clear(want);
        ASSERT_EQ(got[static_cast<size_t>(j)], want) << "size " << size;
      }
      ASSERT_TRUE(fast.summaries_consistent()) << "size " << size;
      ASSERT_EQ(fast.audit(), "") << "size " << size;
      remaining -= n;
    }
    EXPECT_EQ(fast.find_first(), -1);
    EXPECT_EQ(fast.count(), 0);
  }
}

TEST(PerfPaths, AllocNEqualsRepeatedAlloc) {
  std::mt19937_64 rng(2);
  PagePool fast(100000);
  PagePool slow(100000);
  std::vector<int64_t> live;
  for (int round = 0; round < 300; ++round) {
    const int64_t n = static_cast<int64_t>(rng() % 700);
    const std::vector<int64_t> got = fast.alloc_n(n);
    std::vector<int64_t> want;
    if (n <= slow.n_free()) {
      for (int64_t i = 0; i < n; ++i) want.push_back(slow.alloc());
    }
    ASSERT_EQ(got, want) << "round " << round;
    live.insert(live.end(), got.begin(), got.end());
    std::shuffle(live.begin(), live.end(), rng);
    const size_t n_free = live.size() / 2;
    for (size_t i = 0; i < n_free; ++i) {
      fast.free(live.back());
      slow.free(live.back());
      live.pop_back();
    }
    ASSERT_EQ(fast.n_free(), slow.n_free());
  }
  fast.check();
  for (int64_t page = 0; page < fast.n_pages(); ++page) ASSERT_EQ(fast.ref_count(page), slow.ref_count(page));
  EXPECT_TRUE(fast.alloc_n(fast.n_free() + 1).empty());
}

/// A small cache, every sequence filled with distinct values.
struct Filled {
  explicit Filled(int64_t batch, int64_t tokens) : cache(1, batch * ((tokens + 3) / 4) + 4, 4, 2, 8) {
    const int64_t cols = (tokens + 3) / 4;
    table = at::full({batch, cols}, -1, at::kLong);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t c = 0; c < cols; ++c) table[b][c] = cache.alloc();
    cache.write(0, table, 0, pattern({batch, tokens, 2, 8}, 1, at::kHalf),
                pattern({batch, tokens, 2, 8}, 2, at::kHalf));
  }
  pagedkv::PagedCache<pagedkv::NHD> cache;
  at::Tensor table;
};

TEST(PerfPaths, GatherOutputsNeverAliasLiveTensors) {
  Filled f(3, 10);
  auto first = f.cache.gather(0, f.table);
  const at::Tensor k_copy = first.first.clone();
  auto second = f.cache.gather(0, f.table);  // `first` is alive: fresh storage
  EXPECT_NE(first.first.data_ptr(), second.first.data_ptr());
  EXPECT_NE(first.second.data_ptr(), second.second.data_ptr());
  EXPECT_NE(second.first.data_ptr(), second.second.data_ptr());
  second.first.fill_(0);
  EXPECT_TRUE(bitwise_equal(first.first, k_copy));

  // Only a view of the output is alive: still no reuse.
  at::Tensor view = f.cache.gather(0, f.table).first.slice(1, 2, 5);
  const at::Tensor view_copy = view.clone();
  auto third = f.cache.gather(0, f.table);
  EXPECT_NE(third.first.data_ptr(), view.data_ptr());
  third.first.fill_(0);
  EXPECT_TRUE(bitwise_equal(view, view_copy));

  // A weak reference to the storage alone also blocks reuse. Compared by
  // storage object, not data pointer: the recycler drops the storage it may
  // not reuse, and the allocator may hand the freed block straight back to
  // the fresh output (torch 2.x's does), which is no aliasing. Reuse would
  // hand out the very StorageImpl the weak reference can still lock.
  const auto weak = f.cache.gather(0, f.table).first.storage().getWeakStorageImpl();
  auto fourth = f.cache.gather(0, f.table);
  EXPECT_NE(weak.lock().get(), fourth.first.storage().unsafeGetStorageImpl());
}

TEST(PerfPaths, GatherRecyclesDroppedOutputs) {
  Filled f(3, 10);
  const auto want = f.cache.gather(0, f.table);
  const auto want_k = want.first.clone();
  const auto want_v = want.second.clone();
  void* k_ptr = nullptr;
  {
    auto out = f.cache.gather(0, f.table);
    k_ptr = out.first.data_ptr();
    out.first.fill_(7);  // dirty it: the next gather must overwrite everything
    out.second.fill_(7);
  }
  auto again = f.cache.gather(0, f.table);
  EXPECT_EQ(again.first.data_ptr(), k_ptr);  // recycled
  EXPECT_TRUE(bitwise_equal(again.first, want_k));
  EXPECT_TRUE(bitwise_equal(again.second, want_v));
  EXPECT_TRUE(again.first.is_contiguous());
  EXPECT_EQ(again.first.sizes(), want_k.sizes());
  EXPECT_EQ(again.first.storage_offset(), 0);

  // A caller may resize or re-point what it got; the recycler keeps working.
  again.first.resize_({1000, 2, 8});
  again.second.set_();
  again = {};
  // Ragged, with padding: the dirty recycled storage must come back zeroed past each length.
  for (int round = 0; round < 3; ++round) {
    const at::Tensor lengths = pagedkv_test::ints({10, 3, 7});
    auto ragged = f.cache.gather(0, f.table, lengths);
    EXPECT_TRUE(bitwise_equal(ragged.first.slice(1, 0, 3)[1], want_k.slice(1, 0, 3)[1]));
    EXPECT_TRUE(bitwise_equal(ragged.first[1].slice(0, 3), at::zeros({7, 2, 8}, at::kHalf)));
    EXPECT_TRUE(bitwise_equal(ragged.second[2].slice(0, 7), at::zeros({3, 2, 8}, at::kHalf)));
    ragged.first.fill_(5);
    ragged.second.fill_(5);
  }
  // A much smaller gather does not pin the big storage; the results stay right.
  auto small = f.cache.gather(0, f.table.slice(0, 0, 1), pagedkv_test::ints({2}));
  EXPECT_TRUE(bitwise_equal(small.first[0], want_k[0].slice(0, 0, 2)));
}

TEST(PerfPaths, ThreadedKernelsMatchOneThread) {
  const int threads = at::get_num_threads();
  for (const int64_t page_size : {16, 5}) {
    for (const bool hnd : {false, true}) {
      std::vector<std::vector<at::Tensor>> results;
      for (const int n : {1, 2, 3}) {
        at::set_num_threads(n);
        auto run = [&](auto& cache) {
          const int64_t batch = 9;
          const int64_t cols = 64;
          at::Tensor table = at::full({batch, cols}, -1, at::kLong);
          std::mt19937_64 rng(4);
          std::vector<int64_t> ids = cache.alloc_n(batch * cols);
          std::shuffle(ids.begin(), ids.end(), rng);
          for (int64_t i = 0; i < batch * cols; ++i) table[i / cols][i % cols] = ids[static_cast<size_t>(i)];
          const at::Tensor starts = pagedkv_test::ints({0, 1, 17, 33, 100, 5, 64, 0, 31});
          cache.write(0, table, starts, pattern({batch, 150, 4, 64}, 3, at::kHalf),
                      pattern({batch, 150, 4, 64}, 4, at::kHalf));
          cache.write(0, table, 150, pattern({batch, 1, 4, 64}, 5, at::kHalf),
                      pattern({batch, 1, 4, 64}, 6, at::kHalf));
          const auto all = cache.gather(0, table);
          const auto ragged = cache.gather(0, table, pagedkv_test::ints({1, 200, 17, 151, 250, 9, 64, 0, 31}));
          return std::vector<at::Tensor>{all.first.clone(), all.second.clone(), ragged.first.clone(),
                                         ragged.second.clone()};
        };
        if (hnd) {
          pagedkv::PagedCache<pagedkv::HND> cache(1, 9 * 64, page_size, 4, 64);
          results.push_back(run(cache));
        } else {
          pagedkv::PagedCache<pagedkv::NHD> cache(1, 9 * 64, page_size, 4, 64);
          results.push_back(run(cache));
        }
      }
      for (size_t r = 1; r < results.size(); ++r)
        for (size_t i = 0; i < results[0].size(); ++i)
          EXPECT_TRUE(bitwise_equal(results[r][i], results[0][i])) << "threads run " << r << " output " << i;
    }
  }
  at::set_num_threads(threads);
}

}  // namespace
