// PagePool at a million pages: single-page alloc + free, and alloc_n(1000)
// + free. Not data-moving: bench/report lists these as plain times.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "bench_support.hpp"
#include "pagedkv/page_pool.hpp"

namespace {

constexpr int64_t kPages = int64_t{1} << 20;

/// A 1M-page pool, every page allocated, then a random half freed, so free
/// pages are scattered over the whole bitmap.
pagedkv::PagePool half_full_pool() {
  pagedkv::PagePool pool(kPages);
  std::vector<int64_t> pages = pool.alloc_n(kPages);
  std::mt19937_64 rng(3);
  std::shuffle(pages.begin(), pages.end(), rng);
  for (size_t i = 0; i < pages.size() / 2; ++i) pool.free(pages[i]);
  return pool;
}

/// alloc() then free() of that page: the cost of one allocation round trip.
void alloc_free(benchmark::State& state) {
  pagedkv::PagePool pool = half_full_pool();
  for (auto _ : state) {
    const int64_t page = pool.alloc();
    benchmark::DoNotOptimize(page);
    pool.free(page);
  }
  state.SetItemsProcessed(state.iterations());
}

/// Churn: each iteration allocates a page and frees the oldest of a window
/// of 4096 live pages, so the allocated set keeps moving through the bitmap.
void alloc_free_churn(benchmark::State& state) {
  pagedkv::PagePool pool = half_full_pool();
  std::vector<int64_t> window(4096);
  for (auto& p : window) p = pool.alloc();
  size_t oldest = 0;
  for (auto _ : state) {
    const int64_t page = pool.alloc();
    pool.free(window[oldest]);
    window[oldest] = page;
    oldest = (oldest + 1) % window.size();
  }
  state.SetItemsProcessed(state.iterations());
}

/// alloc_n(1000) then free of each page.
void alloc_n_free(benchmark::State& state) {
  pagedkv::PagePool pool = half_full_pool();
  for (auto _ : state) {
    std::vector<int64_t> pages = pool.alloc_n(1000);
    benchmark::DoNotOptimize(pages.data());
    for (int64_t p : pages) pool.free(p);
  }
  state.SetItemsProcessed(state.iterations() * 1000);
}

/// alloc_n(1000) alone (the free is outside the timing).
void alloc_n(benchmark::State& state) {
  pagedkv::PagePool pool = half_full_pool();
  for (auto _ : state) {
    std::vector<int64_t> pages = pool.alloc_n(1000);
    benchmark::DoNotOptimize(pages.data());
    state.PauseTiming();
    for (int64_t p : pages) pool.free(p);
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * 1000);
}

BENCHMARK(alloc_free)->Name("pool/alloc_free/1M")->Unit(benchmark::kNanosecond);
BENCHMARK(alloc_free_churn)->Name("pool/alloc_free_churn/1M")->Unit(benchmark::kNanosecond);
BENCHMARK(alloc_n_free)->Name("pool/alloc_n1000_free/1M")->Unit(benchmark::kMicrosecond);
BENCHMARK(alloc_n)->Name("pool/alloc_n1000/1M")->Unit(benchmark::kMicrosecond);

}  // namespace
