// Page copies and SequenceTable bookkeeping.
//
// Data-moving cases (`<case>/memcpy` then `<case>/pagedkv`, see
// bench_support.hpp), suite geometry (8 heads x 128, page 16, fp16, one
// layer; a page is 32 KiB of k + 32 KiB of v):
//   copy_pages/NHD/P1000              1000 scattered pages -> 1000 others, one cache
//   copy_pages_from/NHD<-NHD/P1000    the same between two caches (swap to a host cache)
//   copy_pages_from/HND<-NHD/P1000    the same with a relayout of every page
// (and each on one thread). memcpy: the same bytes, one contiguous buffer.
//
// Bookkeeping cases (plain times; no data moves but copy-on-write's one
// page per fork, so the cache geometry is tiny and irrelevant):
//   sequences/decode_step/B256   prepare_append(1) + commit_append(1) for 256
//                                sequences of 64..1024 tokens, then batch(256)
//   sequences/decode_step_shared/B256   the same for 8 forks of each of 32
//                                prompts (shared prompt pages; the first step
//                                copies each fork's partial page)
//   sequences/fork_step/B256     32 prompts x 8 forks: fork + prepare_append(1)
//                                (copy-on-write of the shared partial page) +
//                                commit_append(1) for 256 forks, batch(256),
//                                then release of the 256 forks
//   sequences/fork_step/B256_fp16_8x128   the same at the suite geometry (the
//                                copy-on-write then moves 256 real pages)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "pagedkv/pagedkv.hpp"

namespace {

using namespace pagedkv_bench;  // NOLINT: the suite's helpers
using pagedkv::HND;
using pagedkv::NHD;
using pagedkv::PagedCache;
using pagedkv::SequenceTable;

constexpr int64_t kCopyPages = 1000;

at::Tensor index_tensor(const std::vector<int64_t>& values) { return at::tensor(values, at::kLong); }

// ---- page copies ----

/// Two caches (or one) of 2 x kCopyPages pages, every page allocated, and
/// shuffled src / dst lists of kCopyPages pages each.
template <class ToLayout, class FromLayout>
struct CopyFixture {
  explicit CopyFixture(bool same_cache) {
    const int64_t n = 2 * kCopyPages;
    from = std::make_unique<PagedCache<FromLayout>>(1, n, kPageSize, kHeads, kHeadDim, half());
    fill_pattern(from->k_cache(), 1);
    fill_pattern(from->v_cache(), 2);
    from->alloc_n(n);
    if (!same_cache) {
      to = std::make_unique<PagedCache<ToLayout>>(1, n, kPageSize, kHeads, kHeadDim, half());
      to->alloc_n(n);
    }
    std::vector<int64_t> ids(static_cast<size_t>(n));
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937_64 rng(7);
    std::shuffle(ids.begin(), ids.end(), rng);
    src_ids.assign(ids.begin(), ids.begin() + kCopyPages);
    dst_ids.assign(ids.begin() + kCopyPages, ids.end());
    src = index_tensor(src_ids);
    dst = index_tensor(dst_ids);
    limit = std::make_unique<CopyLimit>(2 * kCopyPages * kPageSize * kTokenBytes);
    run();
    verify();
  }

  void run() {
    if constexpr (std::is_same<ToLayout, FromLayout>::value) {
      if (to == nullptr) {
        from->copy_pages(src, dst);
        return;
      }
    }
    to->copy_pages_from(*from, src, dst);
  }

  /// The benchmark is meaningless if the copy is wrong.
  void verify() const {
    auto logical = [](const at::Tensor& t, bool hnd) { return (hnd ? t.transpose(2, 3) : t).contiguous(); };
    const bool from_hnd = std::is_same<FromLayout, HND>::value;
    const at::Tensor from_k = logical(from->k_cache(), from_hnd).select(0, 0);
    const at::Tensor from_v = logical(from->v_cache(), from_hnd).select(0, 0);
    const at::Tensor to_k = to ? logical(to->k_cache(), std::is_same<ToLayout, HND>::value).select(0, 0) : from_k;
    const at::Tensor to_v = to ? logical(to->v_cache(), std::is_same<ToLayout, HND>::value).select(0, 0) : from_v;
    const at::Tensor s = index_tensor(src_ids), d = index_tensor(dst_ids);
    TORCH_CHECK(at::equal(to_k.index_select(0, d).view(at::kShort), from_k.index_select(0, s).view(at::kShort)) &&
                    at::equal(to_v.index_select(0, d).view(at::kShort), from_v.index_select(0, s).view(at::kShort)),
                "bench: copy_pages copied the wrong bytes");
  }

  std::unique_ptr<PagedCache<FromLayout>> from;
  std::unique_ptr<PagedCache<ToLayout>> to;  // null: copy within `from`
  std::vector<int64_t> src_ids, dst_ids;
  at::Tensor src, dst;
  std::unique_ptr<CopyLimit> limit;
};

template <class ToLayout, class FromLayout>
void register_copy(const std::string& case_name, bool same_cache) {
  using F = CopyFixture<ToLayout, FromLayout>;
  auto get = [case_name, same_cache]() -> F& {
    return fixture<F>(case_name, [&] { return std::make_unique<F>(same_cache); });
  };
  const int64_t bytes = 2 * kCopyPages * kPageSize * kTokenBytes;
  for (const std::string& name : {case_name, case_name + "/1thread"}) {
    add(name + "/memcpy", [get, bytes](benchmark::State& state, const std::string& bench_name) {
      auto& f = get();
      timed_loop(state, bench_name, bytes, [&] { f.limit->run(); });
    });
    add(name + "/pagedkv", [get, bytes](benchmark::State& state, const std::string& bench_name) {
      auto& f = get();
      timed_loop(state, bench_name, bytes, [&] { f.run(); });
    });
  }
}

// ---- SequenceTable bookkeeping ----

constexpr int64_t kBatch = 256;

/// 256 sequences of 64..1024 tokens (`shared`: 8 forks of each of 32
/// prompts, so that prompt pages have ref_count 8 and each fork's first
/// append copies its partial page), each prepared and committed one token per
/// step, then the batch's table; the pool is sized for every iteration.
void decode_step(benchmark::State& state, const std::string& name, bool shared) {
  constexpr int64_t kPrompts = 32;
  const int64_t steps = state.max_iterations + 1;  // + timed_loop's warm-up
  const int64_t pages = kBatch * (1024 / kPageSize + 2) + kBatch * (steps / kPageSize + 2);
  PagedCache<NHD> cache(1, pages, kPageSize, 1, 1, half());
  SequenceTable<NHD> table(cache);
  std::mt19937_64 rng(11);
  std::vector<int64_t> seqs;
  for (int64_t b = 0; b < (shared ? kPrompts : kBatch); ++b) {
    const int64_t s = table.create();
    const int64_t len = std::uniform_int_distribution<int64_t>(64, 1024)(rng) | 1;  // a partly written last page
    TORCH_CHECK(table.prepare_append(s, len), "bench: pool too small");
    table.commit_append(s, len);
    seqs.push_back(s);
  }
  if (shared) {
    std::vector<int64_t> forks;
    for (int64_t p : seqs)
      for (int64_t j = 0; j < kBatch / kPrompts; ++j) forks.push_back(table.fork(p));
    seqs = forks;  // the prompts stay alive, holding the shared pages
  }
  timed_loop(state, name, 0, [&] {
    for (int64_t s : seqs) {
      if (!table.prepare_append(s, 1)) std::abort();
      table.commit_append(s, 1);
    }
    auto pt_len = table.batch(seqs);
    benchmark::DoNotOptimize(pt_len.first.data_ptr());
  });
  state.counters["sequences"] = kBatch;
}

/// 32 prompts, each forked 8 times; every fork appends one token (its first
/// write copies the prompt's shared, partly written last page), the batch
/// of 256 forks is built, then the forks are released (steady state).
void fork_step(benchmark::State& state, const std::string& name, int64_t heads, int64_t head_dim) {
  constexpr int64_t kPrompts = 32;
  constexpr int64_t kForks = kBatch / kPrompts;
  PagedCache<NHD> cache(1, kPrompts * (1024 / kPageSize + 1) + kBatch + 16, kPageSize, heads, head_dim, half());
  SequenceTable<NHD> table(cache);
  std::mt19937_64 rng(13);
  std::vector<int64_t> prompts;
  for (int64_t p = 0; p < kPrompts; ++p) {
    const int64_t s = table.create();
    int64_t len = std::uniform_int_distribution<int64_t>(64, 1024)(rng);
    if (len % kPageSize == 0) ++len;  // a partly written last page: forks copy it
    TORCH_CHECK(table.prepare_append(s, len), "bench: pool too small");
    table.commit_append(s, len);
    prompts.push_back(s);
  }
  std::vector<int64_t> forks(static_cast<size_t>(kBatch));
  timed_loop(state, name, 0, [&] {
    size_t i = 0;
    for (int64_t p : prompts) {
      for (int64_t j = 0; j < kForks; ++j) {
        const int64_t c = table.fork(p);
        if (!table.prepare_append(c, 1)) std::abort();
        table.commit_append(c, 1);
        forks[i++] = c;
      }
    }
    auto pt_len = table.batch(forks);
    benchmark::DoNotOptimize(pt_len.first.data_ptr());
    for (int64_t c : forks) table.release(c);
  });
  state.counters["sequences"] = kBatch;
}

const bool registered = [] {
  register_copy<NHD, NHD>("copy_pages/NHD/P1000", /*same_cache=*/true);
  register_copy<NHD, NHD>("copy_pages_from/NHD<-NHD/P1000", /*same_cache=*/false);
  register_copy<HND, NHD>("copy_pages_from/HND<-NHD/P1000", /*same_cache=*/false);
  // A fixed iteration count (so no MinTime, hence not `add`): each decode
  // step grows the sequences (1000 steps: + 63 pages each), and the pool is
  // sized for the whole run.
  for (const bool shared : {false, true}) {
    const std::string name = shared ? "sequences/decode_step_shared/B256" : "sequences/decode_step/B256";
    benchmark::RegisterBenchmark(name.c_str(), [name, shared](benchmark::State& state) {
      decode_step(state, name, shared);
    })
        ->UseRealTime()
        ->Iterations(1000)
        ->Unit(benchmark::kMicrosecond);
  }
  add("sequences/fork_step/B256",
      [](benchmark::State& state, const std::string& name) { fork_step(state, name, 1, 1); });
  add("sequences/fork_step/B256_fp16_8x128",
      [](benchmark::State& state, const std::string& name) { fork_step(state, name, kHeads, kHeadDim); });
  return true;
}();

}  // namespace
