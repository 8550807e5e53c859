// PrefixCache at a pool of 1M pages (page_size 16) with 100k cached pages
// (391 prompts of 4096 random tokens, registered and released, so every
// cached page is reclaimable). Bookkeeping only: bench/report lists these as
// plain times; `ns_per_page` is the figure of merit.
//   prefix/acquire_hit/P255     acquire of a cached 4096-token prompt: 255
//                               pages match (the last token is recomputed)
//   prefix/acquire_miss/P255    acquire of a 4096-token prompt whose first
//                               page misses (an empty sequence)
//   prefix/insert/P256          insert of a sequence's 256 written pages, all new
//   prefix/evict/P256           evict(256): the least recently used prompt's
//                               chain, leaf to root
// Each iteration times only that call (manual time, steady_clock around
// it); the bookkeeping that restores the state (release of the acquired
// sequence, a new sequence to insert, eviction back to 100k cached pages)
// runs outside the timing.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "pagedkv/pagedkv.hpp"

namespace {

using namespace pagedkv_bench;  // NOLINT: the suite's helpers
using pagedkv::NHD;
using pagedkv::PagedCache;
using pagedkv::PrefixCache;
using pagedkv::SequenceTable;

constexpr int64_t kPoolPages = int64_t{1} << 20;
constexpr int64_t kPromptTokens = 4096;
constexpr int64_t kPromptPages = kPromptTokens / kPageSize;
constexpr int64_t kCachedPrompts = 391;  // 391 x 256 = 100,096 cached pages

/// The pool, table and prefix cache with 100k cached pages, and a source of
/// fresh random prompts (int64, as a tokenizer hands them over).
struct PrefixFixture {
  PrefixFixture()
      : cache(1, kPoolPages, kPageSize, 1, 1, half()), table(cache), prefix(table), rng(17) {
    for (int64_t p = 0; p < kCachedPrompts; ++p) {
      prompts.push_back(new_prompt());
      register_prompt(prompts.back());
    }
    TORCH_CHECK(prefix.n_cached() == kCachedPrompts * kPromptPages, "bench: setup cached ", prefix.n_cached());
  }

  at::Tensor new_prompt() { return at::randint(1, 32000, {kPromptTokens}, at::kLong); }

  /// A sequence that has written `tokens` (the K/V contents do not matter here).
  int64_t written(const at::Tensor& tokens) {
    const int64_t s = table.create();
    TORCH_CHECK(table.prepare_append(s, tokens.size(0)), "bench: pool too small");
    table.commit_append(s, tokens.size(0));
    return s;
  }

  void register_prompt(const at::Tensor& tokens) {
    const int64_t s = written(tokens);
    prefix.insert(s, tokens);
    table.release(s);
  }

  PagedCache<NHD> cache;
  SequenceTable<NHD> table;
  PrefixCache<NHD> prefix;
  std::vector<at::Tensor> prompts;
  std::mt19937_64 rng;
};

/// Times one call for the iteration and adds it to `total`.
class CallTimer {
 public:
  template <class F>
  void time(benchmark::State& state, F&& f) {
    const auto start = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(s);
    total_ += s;
  }
  /// Pages per call -> items processed and the mean ns per page.
  void report(benchmark::State& state, int64_t pages) const {
    const auto n = static_cast<double>(std::max<int64_t>(1, state.iterations()) * pages);
    state.SetItemsProcessed(state.iterations() * pages);
    state.counters["ns_per_page"] = total_ * 1e9 / n;
  }

 private:
  double total_ = 0;
};

void acquire_hit(benchmark::State& state) {
  PrefixFixture f;
  const at::Tensor prompt = f.prompts[f.prompts.size() / 2];
  CallTimer timer;
  for (auto _ : state) {
    std::pair<int64_t, int64_t> hit;
    timer.time(state, [&] { hit = f.prefix.acquire(prompt); });
    if (hit.second != kPromptTokens - kPageSize) std::abort();
    f.table.release(hit.first);
  }
  timer.report(state, kPromptPages - 1);
}

void acquire_miss(benchmark::State& state) {
  PrefixFixture f;
  const at::Tensor prompt = f.new_prompt();
  CallTimer timer;
  for (auto _ : state) {
    std::pair<int64_t, int64_t> hit;
    timer.time(state, [&] { hit = f.prefix.acquire(prompt); });
    if (hit.second != 0) std::abort();
    f.table.release(hit.first);
  }
  timer.report(state, kPromptPages - 1);
}

void insert(benchmark::State& state) {
  PrefixFixture f;
  CallTimer timer;
  for (auto _ : state) {
    const at::Tensor prompt = f.new_prompt();
    const int64_t s = f.written(prompt);
    int64_t fresh = 0;
    timer.time(state, [&] { fresh = f.prefix.insert(s, prompt); });
    if (fresh != kPromptPages) std::abort();
    f.table.release(s);
    f.prefix.evict(kPromptPages);  // back to 100k cached pages
  }
  timer.report(state, kPromptPages);
}

void evict(benchmark::State& state) {
  PrefixFixture f;
  CallTimer timer;
  for (auto _ : state) {
    f.register_prompt(f.new_prompt());  // 100k + 256 cached
    int64_t freed = 0;
    timer.time(state, [&] { freed = f.prefix.evict(kPromptPages); });
    if (freed != kPromptPages) std::abort();
  }
  timer.report(state, kPromptPages);
}

const bool registered = [] {
  const std::pair<const char*, void (*)(benchmark::State&)> cases[] = {
      {"prefix/acquire_hit/P255", acquire_hit},
      {"prefix/acquire_miss/P255", acquire_miss},
      {"prefix/insert/P256", insert},
      {"prefix/evict/P256", evict},
  };
  for (const auto& c : cases) {
    benchmark::RegisterBenchmark(c.first, c.second)->UseManualTime()->Unit(benchmark::kMicrosecond);
  }
  return true;
}();

}  // namespace
