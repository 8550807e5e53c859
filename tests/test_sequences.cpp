// SequenceTable: create / reserve / fork / copy-on-write appends / batch /
// release / swap to a host cache and back. Unit tests pin down each call's
// semantics and every failure path (which must throw or return false and
// change nothing); a property test runs random operation sequences against
// a reference model of per-sequence token lists — on every test target
// (cpu, cpu_generic, cuda; the host cache is always on the cpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "test_support.hpp"

namespace {

using pagedkv::SequenceTable;
using namespace pagedkv_test;

constexpr int64_t kHeads = 2;
constexpr int64_t kDim = 4;
constexpr int64_t kLayers = 2;

class SequencesTest : public TargetTest {
 protected:
  template <class L = NHD>
  PagedCache<L> device_cache(int64_t n_pages, int64_t page_size = 3) const {
    return PagedCache<L>(kLayers, n_pages, page_size, kHeads, kDim, opts());
  }
  template <class L = HND>
  static PagedCache<L> host_cache(int64_t n_pages, int64_t page_size = 3) {
    return PagedCache<L>(kLayers, n_pages, page_size, kHeads, kDim, at::TensorOptions().dtype(at::kFloat));
  }
};

// ---- token contents: token id t of layer l is k = t*16 + l*8 + [0..8), v = -k - 1 ----

at::Tensor token_k(const std::vector<int64_t>& ids, int64_t layer) {
  const at::Tensor t = at::tensor(ids, at::kLong).view({-1, 1, 1});
  return (t * 16 + layer * 8 + at::arange(kHeads * kDim, at::kLong).view({1, kHeads, kDim})).to(at::kFloat);
}
at::Tensor token_v(const std::vector<int64_t>& ids, int64_t layer) { return -token_k(ids, layer) - 1; }

/// Writes tokens `ids` at the end of `seq` (after prepare_append) and commits them.
template <class L>
void write_tokens(SequenceTable<L>& table, int64_t seq, const std::vector<int64_t>& ids) {
  const auto n = static_cast<int64_t>(ids.size());
  PagedCache<L>& cache = table.cache();
  const auto pt_len = table.batch({seq});
  const at::TensorOptions o = cache.k_cache().options();
  for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
    cache.write(layer, pt_len.first, table.length(seq), token_k(ids, layer).unsqueeze(0).to(o),
                token_v(ids, layer).unsqueeze(0).to(o));
  }
  table.commit_append(seq, n);
}

/// prepare_append + write + commit; expects prepare_append to succeed.
template <class L>
void append(SequenceTable<L>& table, int64_t seq, const std::vector<int64_t>& ids) {
  ASSERT_TRUE(table.prepare_append(seq, static_cast<int64_t>(ids.size())));
  write_tokens(table, seq, ids);
}

std::vector<int64_t> range(int64_t first, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(first + i);
  return out;
}

/// Every sequence in `expected` gathers exactly its tokens (zeros after).
template <class L>
void expect_contents(const SequenceTable<L>& table, const std::map<int64_t, std::vector<int64_t>>& expected,
                     const std::string& what) {
  std::vector<int64_t> seqs;
  for (const auto& e : expected) seqs.push_back(e.first);
  const auto pt_len = table.batch(seqs);
  for (int64_t layer = 0; layer < table.cache().n_layers(); ++layer) {
    const auto kv = table.cache().gather(layer, pt_len.first, pt_len.second);
    const at::Tensor k = kv.first.cpu(), v = kv.second.cpu();
    int64_t b = 0;
    for (const auto& e : expected) {
      const auto n = static_cast<int64_t>(e.second.size());
      ASSERT_EQ(table.length(e.first), n) << what;
      if (n > 0) {
        EXPECT_TRUE(bitwise_equal(k[b].narrow(0, 0, n), token_k(e.second, layer)))
            << what << ": k of sequence " << e.first << " layer " << layer;
        EXPECT_TRUE(bitwise_equal(v[b].narrow(0, 0, n), token_v(e.second, layer)))
            << what << ": v of sequence " << e.first << " layer " << layer;
      }
      EXPECT_EQ(k[b].narrow(0, n, k.size(1) - n).abs().sum().item<float>(), 0.0f) << what;
      ++b;
    }
  }
}

/// Everything a failed call must leave as it was: the cache's tensors and
/// pool, and every listed sequence's pages and length.
struct Snapshot {
  CacheSnapshot cache;
  std::map<int64_t, std::pair<std::vector<int64_t>, int64_t>> seqs;

  template <class L>
  Snapshot(const SequenceTable<L>& table, const std::vector<int64_t>& ids) : cache(table.cache()) {
    for (int64_t id : ids) seqs[id] = {table.pages(id), table.length(id)};
  }

  template <class L>
  void expect_same(const SequenceTable<L>& table, const std::string& what) const {
    cache.expect_same(table.cache(), what);
    for (const auto& s : seqs) {
      ASSERT_TRUE(table.contains(s.first)) << what;
      EXPECT_EQ(table.pages(s.first), s.second.first) << what << ": pages of " << s.first;
      EXPECT_EQ(table.length(s.first), s.second.second) << what << ": length of " << s.first;
    }
  }
};

/// ref_count of every page == how many sequences of `tables` hold it.
template <class L, class... Tables>
void expect_refcounts_match(const PagedCache<L>& cache, const Tables&... tables) {
  std::map<int64_t, int64_t> held;
  auto count = [&](const auto& table) {
    for (int64_t id = 0; id < 1000; ++id)
      if (table.contains(id))
        for (int64_t p : table.pages(id)) ++held[p];
  };
  (count(tables), ...);
  int64_t used = 0;
  for (int64_t p = 0; p < cache.n_pages(); ++p) {
    const int64_t want = held.count(p) ? held[p] : 0;
    EXPECT_EQ(cache.ref_count(p), want) << "page " << p;
    used += want > 0 ? 1 : 0;
  }
  EXPECT_EQ(cache.n_free(), cache.n_pages() - used);
}

// ---------------------------------------------------------------------------

TEST_P(SequencesTest, CreateReserveLengthRelease) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  const int64_t s = table.create();
  EXPECT_EQ(s, 0);
  EXPECT_EQ(table.length(s), 0);
  EXPECT_EQ(table.capacity(s), 0);
  EXPECT_TRUE(table.pages(s).empty());
  EXPECT_TRUE(table.reserve(s, 7));  // page size 3: 3 pages
  EXPECT_EQ(table.pages(s), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(table.capacity(s), 9);
  EXPECT_EQ(table.length(s), 0);
  EXPECT_TRUE(table.reserve(s, 5));  // a total: already there, never shrinks
  EXPECT_TRUE(table.reserve(s, 0));
  EXPECT_EQ(table.pages(s).size(), 3u);
  EXPECT_TRUE(table.reserve(s, 10));
  EXPECT_EQ(table.pages(s), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(cache.n_free(), 4);
  EXPECT_EQ(table.size(), 1);
  table.release(s);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
  EXPECT_EQ(table.size(), 0);
  EXPECT_FALSE(table.contains(s));
}

TEST_P(SequencesTest, IdsAreSmallAndReusedLowestFirst) {
  auto cache = device_cache(4);
  SequenceTable<NHD> table(cache);
  EXPECT_EQ(table.create(), 0);
  EXPECT_EQ(table.create(), 1);
  EXPECT_EQ(table.create(), 2);
  table.release(1);
  table.release(0);
  EXPECT_EQ(table.create(), 0);
  EXPECT_EQ(table.fork(2), 1);
  EXPECT_EQ(table.create(), 3);
}

TEST_P(SequencesTest, ReserveIsAllOrNothing) {
  auto cache = device_cache(4);
  SequenceTable<NHD> table(cache);
  const int64_t a = table.create(), b = table.create();
  ASSERT_TRUE(table.reserve(a, 7));  // 3 pages, 1 free
  append(table, a, range(0, 2));
  const Snapshot before(table, {a, b});
  EXPECT_FALSE(table.reserve(b, 4));  // needs 2
  before.expect_same(table, "reserve short");
  EXPECT_FALSE(table.reserve(a, 13));  // needs 2 more
  before.expect_same(table, "reserve short, existing sequence");
  EXPECT_TRUE(table.reserve(b, 3));
  EXPECT_EQ(cache.n_free(), 0);
}

// Found by fuzz/fuzz_sequences: length + n and the page count rounding
// overflowed near INT64_MAX, and both calls "succeeded" without pages.
TEST_P(SequencesTest, HugeTokenCountsAreAShortPoolNotAnOverflow) {
  auto cache = device_cache(4);
  SequenceTable<NHD> table(cache);
  const int64_t s = table.create();
  append(table, s, range(0, 2));
  const Snapshot before(table, {s});
  for (const int64_t n : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 1,
                          std::numeric_limits<int64_t>::max() - 2, int64_t{4 * 3 - 1}}) {
    EXPECT_FALSE(table.prepare_append(s, n)) << n;
    EXPECT_FALSE(table.reserve(s, n + (n < 100 ? 2 : 0))) << n;  // 13 tokens need 5 pages of 4
    before.expect_same(table, "n = " + std::to_string(n));
  }
  EXPECT_TRUE(table.prepare_append(s, 4 * 3 - 2));  // exactly the pool
  EXPECT_EQ(table.capacity(s), 12);
}

TEST_P(SequencesTest, ForkSharesEveryPageAndReleaseUnreferences) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  const int64_t parent = table.create();
  ASSERT_TRUE(table.reserve(parent, 9));
  append(table, parent, range(100, 5));
  const int64_t child = table.fork(parent);
  EXPECT_EQ(table.pages(child), table.pages(parent));
  EXPECT_EQ(table.length(child), 5);
  for (int64_t p : table.pages(parent)) EXPECT_EQ(cache.ref_count(p), 2);  // reserved page 2 included
  EXPECT_EQ(cache.n_free(), 5);
  expect_contents(table, {{parent, range(100, 5)}, {child, range(100, 5)}}, "after fork");
  table.release(parent);
  for (int64_t p : table.pages(child)) EXPECT_EQ(cache.ref_count(p), 1);
  EXPECT_EQ(cache.n_free(), 5);
  expect_contents(table, {{child, range(100, 5)}}, "parent released");
  table.release(child);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
}

TEST_P(SequencesTest, CopyOnWriteKeepsForksApart) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  const int64_t parent = table.create();
  append(table, parent, range(0, 4));  // pages {0, 1}; page 1 holds token 3
  const int64_t child = table.fork(parent);
  ASSERT_TRUE(table.prepare_append(child, 1));  // page 1 is shared and holds a token: copied
  EXPECT_EQ(table.pages(child), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(cache.ref_count(0), 2);
  EXPECT_EQ(cache.ref_count(1), 1);
  EXPECT_EQ(cache.ref_count(2), 1);
  write_tokens(table, child, {50});
  append(table, parent, {60, 61, 62});  // parent's page 1 is its own now: no copy, one new page
  EXPECT_EQ(table.pages(parent), (std::vector<int64_t>{0, 1, 3}));
  append(table, child, {51, 52});
  expect_contents(table, {{parent, {0, 1, 2, 3, 60, 61, 62}}, {child, {0, 1, 2, 3, 50, 51, 52}}}, "after cow");
  // a second fork of the child, written at a page boundary of a page shared by both
  const int64_t grandchild = table.fork(child);
  append(table, grandchild, {70});
  expect_contents(table,
                  {{parent, {0, 1, 2, 3, 60, 61, 62}},
                   {child, {0, 1, 2, 3, 50, 51, 52}},
                   {grandchild, {0, 1, 2, 3, 50, 51, 52, 70}}},
                  "grandchild");
  expect_refcounts_match(cache, table);
  table.release(parent);
  table.release(child);
  table.release(grandchild);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
}

TEST_P(SequencesTest, SharedReservedPageIsReplacedWithoutACopy) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  const int64_t parent = table.create();
  ASSERT_TRUE(table.reserve(parent, 6));
  append(table, parent, range(0, 3));  // page 0 full; page 1 reserved, empty
  const int64_t child = table.fork(parent);
  EXPECT_EQ(cache.ref_count(1), 2);
  const int64_t free_before = cache.n_free();
  ASSERT_TRUE(table.prepare_append(child, 2));  // page 1 shared, holds no token: a fresh page, no copy needed
  EXPECT_EQ(cache.n_free(), free_before - 1);
  EXPECT_EQ(table.pages(child)[0], table.pages(parent)[0]);
  EXPECT_NE(table.pages(child)[1], table.pages(parent)[1]);
  EXPECT_EQ(cache.ref_count(table.pages(parent)[1]), 1);
  write_tokens(table, child, {7, 8});
  append(table, parent, {9});
  expect_contents(table, {{parent, {0, 1, 2, 9}}, {child, {0, 1, 2, 7, 8}}}, "reserved page");
  expect_refcounts_match(cache, table);
}

TEST_P(SequencesTest, PrepareAppendIsAllOrNothing) {
  auto cache = device_cache(4);
  SequenceTable<NHD> table(cache);
  const int64_t parent = table.create();
  append(table, parent, range(0, 5));  // 2 pages
  const int64_t child = table.fork(parent);
  const int64_t other = table.create();
  ASSERT_TRUE(table.reserve(other, 3));  // 1 free page left
  // child: writing 2 tokens needs a copy of shared page 1 and one new page: 2 > 1
  const Snapshot before(table, {parent, child, other});
  EXPECT_FALSE(table.prepare_append(child, 2));
  before.expect_same(table, "prepare_append short (copy-on-write + growth)");
  EXPECT_FALSE(table.prepare_append(other, 7));  // needs 2 new pages
  before.expect_same(table, "prepare_append short (growth)");
  EXPECT_TRUE(table.prepare_append(child, 1));  // the copy alone fits
  EXPECT_TRUE(table.prepare_append(parent, 0));
  EXPECT_EQ(cache.n_free(), 0);
}

TEST_P(SequencesTest, CommitAppendPastTheCapacityThrowsAndChangesNothing) {
  auto cache = device_cache(4);
  SequenceTable<NHD> table(cache);
  const int64_t s = table.create();
  ASSERT_TRUE(table.prepare_append(s, 2));
  const Snapshot before(table, {s});
  expect_error([&] { table.commit_append(s, 4); },
               {"pagedkv::SequenceTable<NHD>::commit_append", "'n_tokens'", "<= 3", "prepare_append", "got 4"});
  before.expect_same(table, "commit past capacity");
  expect_error([&] { table.commit_append(s, -1); }, {"commit_append", "'n_tokens'", ">= 0"});
  expect_error([&] { table.prepare_append(s, -1); }, {"prepare_append", "'n_tokens'", ">= 0"});
  expect_error([&] { table.reserve(s, -2); }, {"reserve", "'n_tokens'", ">= 0"});
  before.expect_same(table, "negative n");
  table.commit_append(s, 3);
  EXPECT_EQ(table.length(s), 3);
}

TEST_P(SequencesTest, BatchIsAPaddedInt32TableReadyForBind) {
  auto cache = device_cache(10);
  SequenceTable<NHD> table(cache);
  const int64_t a = table.create(), b = table.create(), c = table.create();
  append(table, a, range(0, 7));   // 3 pages
  append(table, b, range(10, 2));  // 1 page
  ASSERT_TRUE(table.reserve(b, 5));  // 2 pages, length 2
  const auto pt_len = table.batch({b, c, a});
  EXPECT_EQ(pt_len.first.scalar_type(), at::kInt);
  EXPECT_TRUE(pt_len.first.device().is_cpu());
  EXPECT_EQ(pt_len.first.sizes(), (std::vector<int64_t>{3, 3}));
  const std::vector<int32_t> want{3, 4, -1, -1, -1, -1, 0, 1, 2};
  EXPECT_EQ(std::vector<int32_t>(pt_len.first.data_ptr<int32_t>(), pt_len.first.data_ptr<int32_t>() + 9), want);
  EXPECT_EQ(pt_len.second.sizes(), (std::vector<int64_t>{3}));
  EXPECT_EQ(pt_len.second[0].item<int64_t>(), 2);
  EXPECT_EQ(pt_len.second[1].item<int64_t>(), 0);
  EXPECT_EQ(pt_len.second[2].item<int64_t>(), 7);
  const auto view = cache.bind(pt_len.first, pt_len.second);
  const auto kv = view.gather(1);
  EXPECT_EQ(kv.first.sizes(), (std::vector<int64_t>{3, 7, kHeads, kDim}));
  EXPECT_TRUE(bitwise_equal(kv.first[2], token_k(range(0, 7), 1).to(opts())));
  const auto empty = table.batch({});
  EXPECT_EQ(empty.first.sizes(), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(empty.second.sizes(), (std::vector<int64_t>{0}));
  const auto only_empty = table.batch({c, c});
  EXPECT_EQ(only_empty.first.sizes(), (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(cache.gather(0, only_empty.first, only_empty.second).first.size(1), 0);
}

TEST_P(SequencesTest, UnknownAndReleasedIdsThrowAndChangeNothing) {
  auto cache = device_cache(6);
  SequenceTable<NHD> table(cache);
  auto host_cache_ = host_cache(6);
  SequenceTable<HND> host(host_cache_);
  const int64_t live = table.create();
  append(table, live, range(0, 4));
  const int64_t gone = table.create();
  table.release(gone);
  const Snapshot before(table, {live});
  for (int64_t bad : {gone, int64_t{7}, int64_t{-1}}) {
    const std::string id = std::to_string(bad);
    const std::vector<std::string> parts{"argument 'seq' expected a live sequence id", "got " + id};
    auto with = [&](const char* fn) {
      std::vector<std::string> all{std::string("pagedkv::SequenceTable<NHD>::") + fn};
      all.insert(all.end(), parts.begin(), parts.end());
      return all;
    };
    expect_error([&] { table.reserve(bad, 3); }, with("reserve"));
    expect_error([&] { table.fork(bad); }, with("fork"));
    expect_error([&] { table.release(bad); }, with("release"));
    expect_error([&] { table.length(bad); }, with("length"));
    expect_error([&] { table.prepare_append(bad, 1); }, with("prepare_append"));
    expect_error([&] { table.commit_append(bad, 0); }, with("commit_append"));
    expect_error([&] { table.batch({live, bad}); }, with("batch"));
    expect_error([&] { table.swap_out(bad, host); }, with("swap_out"));
    expect_error([&] { table.swap_in(bad, host); }, with("swap_in"));
    before.expect_same(table, "bad id " + id);
    EXPECT_EQ(table.size(), 1);
    EXPECT_EQ(host.size(), 0);
    EXPECT_EQ(host_cache_.n_free(), host_cache_.n_pages());
  }
  expect_error([&] { table.release(gone); }, {"(released)"});
  expect_error([&] { table.release(9); }, {"(unknown)"});
}

TEST_P(SequencesTest, SwapOutAndBackKeepsTheTokens) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  auto hc = host_cache(8);
  SequenceTable<HND> host(hc);
  const int64_t a = table.create(), b = table.create();
  append(table, a, range(0, 7));  // 3 pages
  ASSERT_TRUE(table.reserve(a, 12));  // + 1 reserved page, not swapped
  append(table, b, range(20, 2));
  ASSERT_TRUE(table.swap_out(a, host));
  EXPECT_TRUE(table.swapped(a));
  EXPECT_TRUE(table.contains(a));
  EXPECT_EQ(table.length(a), 7);
  EXPECT_TRUE(table.pages(a).empty());
  EXPECT_EQ(cache.n_free(), 7);   // all 4 of a's pages are back
  EXPECT_EQ(hc.n_free(), 5);      // 3 pages hold the tokens
  EXPECT_EQ(host.size(), 1);
  expect_contents(host, {{0, range(0, 7)}}, "host-side copy");  // holder id 0, readable
  expect_contents(table, {{b, range(20, 2)}}, "b untouched");
  // b can use a's old pages meanwhile
  append(table, b, range(30, 9));
  ASSERT_TRUE(table.swap_in(a, host));
  EXPECT_FALSE(table.swapped(a));
  EXPECT_EQ(table.capacity(a), 9);
  EXPECT_EQ(hc.n_free(), hc.n_pages());
  EXPECT_EQ(host.size(), 0);
  append(table, a, {99});
  std::vector<int64_t> b_tokens = range(20, 2);
  for (int64_t t : range(30, 9)) b_tokens.push_back(t);
  std::vector<int64_t> a_tokens = range(0, 7);
  a_tokens.push_back(99);
  expect_contents(table, {{a, a_tokens}, {b, b_tokens}}, "after swap_in");
  table.release(a);
  table.release(b);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
}

TEST_P(SequencesTest, SwappedSequencesOnlyAnswerLengthReleaseAndSwapIn) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  auto hc = host_cache(8);
  SequenceTable<HND> host(hc);
  const int64_t a = table.create();
  append(table, a, range(0, 4));
  ASSERT_TRUE(table.swap_out(a, host));
  const Snapshot before(table, {a});
  const std::vector<std::string> parts{"swapped out", "swap_in"};
  expect_error([&] { table.reserve(a, 9); }, parts);
  expect_error([&] { table.fork(a); }, parts);
  expect_error([&] { table.prepare_append(a, 1); }, parts);
  expect_error([&] { table.commit_append(a, 0); }, parts);
  expect_error([&] { table.batch({a}); }, parts);
  expect_error([&] { table.swap_out(a, host); }, parts);
  before.expect_same(table, "calls on a swapped sequence");
  EXPECT_EQ(hc.n_free(), 6);
  // the host-side sequence belongs to `table`: host's mutating calls refuse it
  const int64_t holder = 0;
  ASSERT_TRUE(host.contains(holder));
  const std::vector<std::string> holder_parts{"holds another table's swapped-out sequence"};
  expect_error([&] { host.release(holder); }, holder_parts);
  expect_error([&] { host.fork(holder); }, holder_parts);
  expect_error([&] { host.reserve(holder, 9); }, holder_parts);
  expect_error([&] { host.prepare_append(holder, 1); }, holder_parts);
  expect_error([&] { host.commit_append(holder, 0); }, holder_parts);
  expect_error([&] { host.swap_out(holder, table); }, holder_parts);
  EXPECT_EQ(host.length(holder), 4);
  EXPECT_EQ(hc.n_free(), 6);
  // releasing the swapped sequence frees its host copy
  table.release(a);
  EXPECT_EQ(hc.n_free(), hc.n_pages());
  EXPECT_EQ(host.size(), 0);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
}

TEST_P(SequencesTest, SwapFailuresChangeNothing) {
  auto cache = device_cache(6);
  SequenceTable<NHD> table(cache);
  auto small_hc = host_cache(2);
  SequenceTable<HND> small_host(small_hc);
  auto hc = host_cache(8);
  SequenceTable<HND> host(hc);
  auto other_hc = host_cache<NHD>(8);
  SequenceTable<NHD> other_host(other_hc);
  const int64_t a = table.create();
  append(table, a, range(0, 7));  // 3 pages
  {
    const Snapshot dev(table, {a});
    EXPECT_FALSE(table.swap_out(a, small_host));  // host short
    dev.expect_same(table, "swap_out, host short");
    EXPECT_EQ(small_hc.n_free(), 2);
    EXPECT_EQ(small_host.size(), 0);
    expect_error([&] { table.swap_out(a, table); }, {"swap_out", "'host'", "another table"});
    SequenceTable<NHD> same_cache(cache);
    expect_error([&] { table.swap_out(a, same_cache); }, {"swap_out", "'host'", "another cache"});
    auto odd_hc = host_cache(8, /*page_size=*/4);
    SequenceTable<HND> odd(odd_hc);
    expect_error([&] { table.swap_out(a, odd); }, {"swap_out", "geometry"});
    PagedCache<HND> half_hc(kLayers, 8, 3, kHeads, kDim, at::TensorOptions().dtype(at::kHalf));
    SequenceTable<HND> half(half_hc);
    expect_error([&] { table.swap_out(a, half); }, {"swap_out", "dtype"});
    expect_error([&] { table.swap_in(a, host); }, {"swap_in", "expected a swapped-out sequence", "resident"});
    dev.expect_same(table, "swap_out errors");
    EXPECT_EQ(odd_hc.n_free(), 8);
    EXPECT_EQ(half_hc.n_free(), 8);
  }
  ASSERT_TRUE(table.swap_out(a, host));
  // fill the device so that swap_in is short
  const int64_t filler = table.create();
  ASSERT_TRUE(table.reserve(filler, 12));  // 4 of 6 pages: 2 left, a needs 3
  const Snapshot dev(table, {a, filler});
  const Snapshot hst(host, {0});
  EXPECT_FALSE(table.swap_in(a, host));
  dev.expect_same(table, "swap_in, device short");
  hst.expect_same(host, "swap_in, device short (host side)");
  EXPECT_TRUE(table.swapped(a));
  expect_error([&] { table.swap_in(a, other_host); }, {"swap_in", "'host'", "the table sequence"});
  expect_error([&] { table.swap_in(a, small_host); }, {"swap_in", "'host'", "the table sequence"});
  dev.expect_same(table, "swap_in, wrong host");
  hst.expect_same(host, "swap_in, wrong host (host side)");
  table.release(filler);
  ASSERT_TRUE(table.swap_in(a, host));
  expect_contents(table, {{a, range(0, 7)}}, "after the failures");
}

// An engine that frees a page through the cache while a sequence still
// lists it breaks the table's bookkeeping; the table's next call on that
// sequence must then throw and change nothing, not free half its pages.
TEST_P(SequencesTest, PagesFreedBehindTheTablesBackMakeCallsThrowAndChangeNothing) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  auto hc = host_cache(8);
  SequenceTable<HND> host(hc);
  const int64_t a = table.create();
  append(table, a, range(0, 8));  // 3 pages
  const int64_t b = table.create();
  append(table, b, range(20, 4));  // 2 pages
  const std::vector<int64_t> pages = table.pages(a);
  cache.free(pages.back());  // its last page: the calls meet it after the others
  {
    const Snapshot before(table, {a, b});
    const CacheSnapshot host_before(hc);
    const std::string freed = "whose page " + std::to_string(pages.back()) + " (its page 2) is free";
    expect_error([&] { table.release(a); }, {"SequenceTable<NHD>::release", "'seq'", freed});
    before.expect_same(table, "release");
    expect_error([&] { table.fork(a); }, {"SequenceTable<NHD>::fork", freed});
    before.expect_same(table, "fork");
    EXPECT_EQ(table.size(), 2);
    expect_error([&] { table.swap_out(a, host); }, {"SequenceTable<NHD>::swap_out", freed});
    before.expect_same(table, "swap_out");
    host_before.expect_same(hc, "swap_out (host side)");
    EXPECT_EQ(host.size(), 0);
    EXPECT_FALSE(table.swapped(a));
  }
  ASSERT_EQ(cache.alloc(), pages.back());  // repaired (the lowest free page): everything works again
  const int64_t c = table.fork(a);
  table.release(c);
  ASSERT_TRUE(table.swap_out(b, host));
  const std::vector<int64_t> host_pages = host.pages(0);
  hc.free(host_pages.back());
  {
    const Snapshot before(table, {a});
    const CacheSnapshot device_before(cache);
    const CacheSnapshot host_before(hc);
    expect_error([&] { table.swap_in(b, host); },
                 {"SequenceTable<NHD>::swap_in", "whose page " + std::to_string(host_pages.back()) + " (its page 1)"});
    before.expect_same(table, "swap_in");
    device_before.expect_same(cache, "swap_in");
    host_before.expect_same(hc, "swap_in (host side)");
    EXPECT_TRUE(table.swapped(b));
  }
  ASSERT_EQ(hc.alloc(), host_pages.back());
  ASSERT_TRUE(table.swap_in(b, host));
  expect_contents(table, {{a, range(0, 8)}, {b, range(20, 4)}}, "after the repairs");
  expect_refcounts_match(cache, table);
  EXPECT_NO_THROW(cache.check());
  EXPECT_NO_THROW(hc.check());
}

TEST_P(SequencesTest, SwappingASharingSequenceLeavesItsForksIntact) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  auto hc = host_cache(8);
  SequenceTable<HND> host(hc);
  const int64_t parent = table.create();
  append(table, parent, range(0, 5));
  const int64_t child = table.fork(parent);
  append(table, child, {40});
  ASSERT_TRUE(table.swap_out(parent, host));
  for (int64_t p : table.pages(child)) EXPECT_EQ(cache.ref_count(p), 1);
  append(table, child, {41, 42, 43});
  ASSERT_TRUE(table.swap_in(parent, host));
  append(table, parent, {50});
  expect_contents(table, {{parent, {0, 1, 2, 3, 4, 50}}, {child, {0, 1, 2, 3, 4, 40, 41, 42, 43}}}, "fork + swap");
  expect_refcounts_match(cache, table);
}

TEST_P(SequencesTest, EmptySequencesSwapToo) {
  auto cache = device_cache(4);
  SequenceTable<NHD> table(cache);
  auto hc = host_cache(1);
  SequenceTable<HND> host(hc);
  const int64_t s = table.create();
  ASSERT_TRUE(table.reserve(s, 3));
  ASSERT_TRUE(table.swap_out(s, host));
  EXPECT_EQ(cache.n_free(), 4);
  EXPECT_EQ(hc.n_free(), 1);
  ASSERT_TRUE(table.swap_in(s, host));
  EXPECT_EQ(table.capacity(s), 0);
  append(table, s, {1, 2});
  expect_contents(table, {{s, {1, 2}}}, "empty swap");
}

TEST_P(SequencesTest, DestroyingATableFreesItsPages) {
  auto cache = device_cache(8);
  auto hc = host_cache(8);
  {
    SequenceTable<HND> host(hc);
    {
      SequenceTable<NHD> table(cache);
      const int64_t a = table.create();
      append(table, a, range(0, 5));
      table.fork(a);
      const int64_t b = table.create();
      append(table, b, range(0, 4));
      ASSERT_TRUE(table.swap_out(b, host));
      EXPECT_LT(cache.n_free(), cache.n_pages());
    }
    EXPECT_EQ(cache.n_free(), cache.n_pages());
    EXPECT_EQ(hc.n_free(), hc.n_pages() - 2);  // b's copy stays with the host table...
  }
  EXPECT_EQ(hc.n_free(), hc.n_pages());  // ...which frees it when it goes
}

// ---- property test -------------------------------------------------------

/// Random create / reserve / fork / append (prepare, write, commit) /
/// release / swap_out / swap_in against a model of per-sequence token lists.
template <class DevLayout, class HostLayout>
void run_property(const at::TensorOptions& dev_opts, uint64_t seed, int64_t steps) {
  const int64_t page_size = 1 + static_cast<int64_t>(seed % 4);  // 1..4
  PagedCache<DevLayout> cache(kLayers, 24, page_size, kHeads, kDim, dev_opts);
  PagedCache<HostLayout> hc(kLayers, 14, page_size, kHeads, kDim, at::TensorOptions().dtype(at::kFloat));
  SequenceTable<DevLayout> table(cache);
  SequenceTable<HostLayout> host(hc);
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  std::map<int64_t, std::vector<int64_t>> model;  // every live device-table sequence
  std::set<int64_t> swapped;
  int64_t next_token = 0;
  int64_t failed = 0, cow_forks = 0, swaps = 0;
  auto pick = [&](bool resident) -> int64_t {
    std::vector<int64_t> ids;
    for (const auto& m : model)
      if (resident != (swapped.count(m.first) > 0)) ids.push_back(m.first);
    if (ids.empty()) return -1;
    return ids[static_cast<size_t>(uniform(0, static_cast<int64_t>(ids.size()) - 1))];
  };
  for (int64_t step = 0; step < steps; ++step) {
    const std::string what = "seed " + std::to_string(seed) + " step " + std::to_string(step);
    const int64_t op = uniform(0, 99);
    if (op < 10 || model.empty()) {
      const int64_t s = table.create();
      ASSERT_EQ(model.count(s), 0u) << what;
      model[s] = {};
    } else if (op < 20) {
      const int64_t s = pick(true);
      if (s < 0) continue;
      const int64_t want = table.length(s) + uniform(0, 3 * page_size);
      const int64_t free_before = cache.n_free();
      const auto pages_before = table.pages(s);
      if (!table.reserve(s, want)) {
        ++failed;
        EXPECT_EQ(cache.n_free(), free_before) << what;
        EXPECT_EQ(table.pages(s), pages_before) << what;
      } else {
        EXPECT_GE(table.capacity(s), want) << what;
      }
    } else if (op < 35) {
      const int64_t s = pick(true);
      if (s < 0) continue;
      const int64_t child = table.fork(s);
      model[child] = model[s];
      ++cow_forks;
    } else if (op < 75) {
      const int64_t s = pick(true);
      if (s < 0) continue;
      const int64_t n = uniform(1, 2 * page_size + 1);
      const int64_t free_before = cache.n_free();
      const auto pages_before = table.pages(s);
      if (!table.prepare_append(s, n)) {
        ++failed;
        EXPECT_EQ(cache.n_free(), free_before) << what;
        EXPECT_EQ(table.pages(s), pages_before) << what;
        continue;
      }
      // every page the write lands in is this sequence's own
      for (int64_t pos = table.length(s); pos < table.length(s) + n; ++pos)
        EXPECT_EQ(cache.ref_count(table.pages(s)[static_cast<size_t>(pos / page_size)]), 1) << what;
      std::vector<int64_t> ids = range(next_token, n);
      next_token += n;
      write_tokens(table, s, ids);
      model[s].insert(model[s].end(), ids.begin(), ids.end());
    } else if (op < 85) {
      const int64_t s = uniform(0, 1) ? pick(true) : pick(false);
      if (s < 0) continue;
      table.release(s);
      model.erase(s);
      swapped.erase(s);
    } else if (op < 93) {
      const int64_t s = pick(true);
      if (s < 0) continue;
      const int64_t host_free = hc.n_free();
      if (table.swap_out(s, host)) {
        swapped.insert(s);
        ++swaps;
      } else {
        ++failed;
        EXPECT_EQ(hc.n_free(), host_free) << what;
        EXPECT_FALSE(table.swapped(s)) << what;
      }
    } else {
      const int64_t s = pick(false);
      if (s < 0) continue;
      const int64_t dev_free = cache.n_free();
      if (table.swap_in(s, host)) {
        swapped.erase(s);
      } else {
        ++failed;
        EXPECT_EQ(cache.n_free(), dev_free) << what;
        EXPECT_TRUE(table.swapped(s)) << what;
      }
    }
    // invariants after every step
    expect_refcounts_match(cache, table);
    expect_refcounts_match(hc, host);
    for (const auto& m : model) {
      ASSERT_TRUE(table.contains(m.first)) << what;
      ASSERT_EQ(table.length(m.first), static_cast<int64_t>(m.second.size())) << what;
      ASSERT_EQ(table.swapped(m.first), swapped.count(m.first) > 0) << what;
    }
    ASSERT_EQ(table.size(), static_cast<int64_t>(model.size())) << what;
    ASSERT_EQ(host.size(), static_cast<int64_t>(swapped.size())) << what;
    if (step % 5 == 4 || step == steps - 1) {
      std::map<int64_t, std::vector<int64_t>> resident;
      for (const auto& m : model)
        if (!swapped.count(m.first)) resident.insert(m);
      expect_contents(table, resident, what);
      if (::testing::Test::HasFailure()) return;
    }
  }
  for (const auto& m : model) table.release(m.first);
  EXPECT_EQ(cache.n_free(), cache.n_pages()) << "seed " << seed << ": device pages leaked";
  EXPECT_EQ(hc.n_free(), hc.n_pages()) << "seed " << seed << ": host pages leaked";
  EXPECT_EQ(table.size(), 0);
  EXPECT_EQ(host.size(), 0);
  // the run exercised what it is meant to
  EXPECT_GT(failed, 0) << "seed " << seed;
  EXPECT_GT(cow_forks, 0) << "seed " << seed;
  EXPECT_GT(swaps, 0) << "seed " << seed;
}

TEST_P(SequencesTest, PropertyRandomOperationsMatchAReferenceModel) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    run_property<NHD, HND>(opts(), seed, 250);
    run_property<HND, HND>(opts(), seed + 100, 250);
    run_property<HND, NHD>(opts(), seed + 200, 150);
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, SequencesTest, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);

}  // namespace
