// Exhaustion and scale: a 1M-page pool filled, drained in random order and
// refilled stays lowest-first with an exact n_free; a bounded soak of random
// cache operations against the fuzzer's model, with check() every 1000 calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "../fuzz/script.hpp"
#include "pagedkv/pagedkv.hpp"

namespace {

using pagedkv::PagePool;

constexpr int64_t kMillion = int64_t{1} << 20;

TEST(Exhaustion, MillionPagePoolFillDrainRefillStaysLowestFirst) {
  std::mt19937_64 rng(1234);
  PagePool pool(kMillion);
  pool.check();

  // Fill: ids come out 0, 1, 2, ... and n_free counts down exactly.
  for (int64_t i = 0; i < kMillion; ++i) {
    ASSERT_EQ(pool.alloc(), i);
    ASSERT_EQ(pool.n_free(), kMillion - 1 - i);
  }
  EXPECT_EQ(pool.alloc(), -1);
  EXPECT_TRUE(pool.alloc_n(1).empty());
  pool.check();

  // Free half in random order, then refill: the freed ids come back ascending.
  std::vector<int64_t> ids(static_cast<size_t>(kMillion));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int64_t> freed(ids.begin(), ids.begin() + kMillion / 2);
  for (size_t i = 0; i < freed.size(); ++i) {
    pool.free(freed[i]);
    ASSERT_EQ(pool.n_free(), static_cast<int64_t>(i) + 1);
  }
  pool.check();
  std::sort(freed.begin(), freed.end());
  for (size_t i = 0; i < freed.size(); ++i) {
    if (i % 2 == 0) {
      ASSERT_EQ(pool.alloc(), freed[i]);
    } else {
      ASSERT_EQ(pool.alloc_n(1), std::vector<int64_t>{freed[i]});
    }
  }
  EXPECT_EQ(pool.n_free(), 0);
  pool.check();

  // Drain completely in random order, then refill in one alloc_n: 0..N-1.
  std::shuffle(ids.begin(), ids.end(), rng);
  for (size_t i = 0; i < ids.size(); ++i) {
    pool.free(ids[i]);
    ASSERT_EQ(pool.n_free(), static_cast<int64_t>(i) + 1);
  }
  pool.check();
  const std::vector<int64_t> all = pool.alloc_n(kMillion);
  ASSERT_EQ(static_cast<int64_t>(all.size()), kMillion);
  for (int64_t i = 0; i < kMillion; ++i) ASSERT_EQ(all[static_cast<size_t>(i)], i);
  EXPECT_EQ(pool.n_free(), 0);
  pool.check();
}

TEST(Exhaustion, MillionPagePoolRandomChurnAgreesWithAnOrderedSet) {
  std::mt19937_64 rng(99);
  PagePool pool(kMillion);
  std::vector<int64_t> held = pool.alloc_n(kMillion - 1000);  // nearly full: the summary levels matter
  std::set<int64_t> free_ids;
  for (int64_t p = kMillion - 1000; p < kMillion; ++p) free_ids.insert(p);
  for (int step = 0; step < 200000; ++step) {
    if (rng() % 2 == 0 && !held.empty()) {
      const size_t i = rng() % held.size();
      std::swap(held[i], held.back());
      pool.free(held.back());
      free_ids.insert(held.back());
      held.pop_back();
    } else {
      const int64_t want = free_ids.empty() ? -1 : *free_ids.begin();
      ASSERT_EQ(pool.alloc(), want) << "step " << step;
      if (want >= 0) {
        free_ids.erase(free_ids.begin());
        held.push_back(want);
      }
    }
    ASSERT_EQ(pool.n_free(), static_cast<int64_t>(free_ids.size()));
    if (step % 50000 == 0) pool.check();
  }
  pool.check();
}

TEST(Exhaustion, MillionPageCacheAllocNFillsAndRefusesOneMore) {
  pagedkv::PagedCache<pagedkv::NHD> cache(1, kMillion, 1, 1, 1, at::TensorOptions().dtype(at::kFloat));
  EXPECT_EQ(cache.alloc_n(kMillion).back(), kMillion - 1);
  EXPECT_EQ(cache.alloc(), -1);
  EXPECT_TRUE(cache.alloc_n(1).empty());
  cache.free(kMillion / 2);
  cache.free(7);
  EXPECT_EQ(cache.alloc_n(2), (std::vector<int64_t>{7, kMillion / 2}));
  cache.check();
}

// Random operations on one larger cache for a bounded time (the fuzzer's
// script engine and model, fed random bytes), check() every 1000 calls.
TEST(Soak, RandomOperationsAgainstTheModel) {
  const auto budget = std::chrono::seconds(20);  // CI bound: <= 30 s with setup, sanitizers included
  pagedkv_fuzz::Options options;
  options.max_layers = 3;
  options.max_pages = 64;
  options.max_page_size = 7;
  options.max_heads = 3;
  options.max_head_dim = 8;
  options.max_batch = 6;
  options.max_cols = 10;
  options.max_tokens = 24;
  options.check_every = 1000;
  options.deadline = std::chrono::steady_clock::now() + budget;
  std::mt19937_64 rng(2024);
  int64_t calls = 0, succeeded = 0, checks = 0, scripts = 0;
  while (std::chrono::steady_clock::now() < options.deadline) {
    std::vector<uint8_t> bytes(1 << 20);  // thousands of calls on one cache
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    try {
      const auto stats = pagedkv_fuzz::run_script(bytes.data(), bytes.size(), options);
      calls += stats.calls;
      succeeded += stats.succeeded;
      checks += stats.checks;
      ++scripts;
    } catch (const pagedkv_fuzz::Failure& failure) {
      FAIL() << "script " << scripts << ": " << failure.what();
    }
  }
  RecordProperty("calls", static_cast<int>(calls));
  std::printf("soak: %lld calls (%lld succeeded) in %lld scripts, %lld full checks\n", static_cast<long long>(calls),
              static_cast<long long>(succeeded), static_cast<long long>(scripts), static_cast<long long>(checks));
  EXPECT_GT(calls, 1000);
  EXPECT_GT(checks, 1);
}

}  // namespace
