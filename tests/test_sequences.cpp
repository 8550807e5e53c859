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

namespace pagedkv {
struct SequenceTableTestAccess {
  template <class L>
  static std::vector<int64_t>& pages(SequenceTable<L>& table, int64_t seq) {
    return table.seqs_[static_cast<size_t>(seq)].pages;
  }
  template <class L>
  static int64_t& dropped(SequenceTable<L>& table, int64_t seq) {
    return table.seqs_[static_cast<size_t>(seq)].dropped;
  }
};
}  // namespace pagedkv

namespace {

using pagedkv::SequenceTable;
using pagedkv::SequenceTableTestAccess;
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

// ---- truncate ------------------------------------------------------------

TEST_P(SequencesTest, TruncateKeepsThePrefixAndFreesEveryPageAfterIt) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  const int64_t a = table.create();
  append(table, a, range(0, 10));  // pages {0, 1, 2, 3}; page 3 holds token 9
  ASSERT_TRUE(table.reserve(a, 15));  // + page 4, reserved
  table.truncate(a, 7);               // tokens 0..6: pages {0, 1, 2}, page 2 partly kept
  EXPECT_EQ(table.length(a), 7);
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(table.capacity(a), 9);
  EXPECT_EQ(cache.n_free(), 5);
  expect_contents(table, {{a, range(0, 7)}}, "truncated");
  append(table, a, {70, 71, 72});  // overwrites the rolled-back tokens 7, 8 in page 2, then page 3 again
  expect_contents(table, {{a, {0, 1, 2, 3, 4, 5, 6, 70, 71, 72}}}, "appended after truncate");
  table.truncate(a, 10);  // the whole length: only reserved pages could go, there are none
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{0, 1, 2, 3}));
  ASSERT_TRUE(table.reserve(a, 12));
  EXPECT_EQ(table.capacity(a), 12);
  table.truncate(a, 9);  // on a page boundary: page 3 (one token and the reserved rest) goes
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{0, 1, 2}));
  table.truncate(a, 0);
  EXPECT_TRUE(table.pages(a).empty());
  EXPECT_EQ(table.length(a), 0);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
  append(table, a, {5});
  expect_contents(table, {{a, {5}}}, "refilled");
  EXPECT_NO_THROW(table.check());
}

TEST_P(SequencesTest, TruncateLeavesSharedPagesWithTheirOtherHolders) {
  auto cache = device_cache(10);
  SequenceTable<NHD> table(cache);
  const int64_t a = table.create();
  append(table, a, range(0, 10));  // 4 pages
  const int64_t b = table.fork(a);
  table.truncate(a, 4);  // a keeps pages 0 and 1 (1 partly); pages 2 and 3 stay b's alone
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(cache.ref_count(0), 2);
  EXPECT_EQ(cache.ref_count(1), 2);
  EXPECT_EQ(cache.ref_count(2), 1);
  EXPECT_EQ(cache.ref_count(3), 1);
  expect_refcounts_match(cache, table);
  // the partly kept shared page is copied by the next write, not overwritten
  ASSERT_TRUE(table.prepare_append(a, 2));
  EXPECT_EQ(table.pages(a)[0], 0);
  EXPECT_NE(table.pages(a)[1], 1);
  EXPECT_EQ(cache.ref_count(1), 1);
  write_tokens(table, a, {40, 41});
  expect_contents(table, {{a, {0, 1, 2, 3, 40, 41}}, {b, range(0, 10)}}, "after the copy-on-write");
  table.truncate(b, 0);
  EXPECT_TRUE(table.pages(b).empty());
  expect_refcounts_match(cache, table);
  expect_contents(table, {{a, {0, 1, 2, 3, 40, 41}}, {b, {}}}, "b emptied");
  EXPECT_NO_THROW(table.check());
}

TEST_P(SequencesTest, TruncateBadInputThrowsAndChangesNothing) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache);
  auto hc = host_cache(8);
  SequenceTable<HND> host(hc);
  const int64_t a = table.create();
  append(table, a, range(0, 5));
  ASSERT_TRUE(table.reserve(a, 9));
  const int64_t swapped = table.create();
  append(table, swapped, range(20, 4));
  ASSERT_TRUE(table.swap_out(swapped, host));
  const int64_t gone = table.create();
  table.release(gone);
  const Snapshot before(table, {a, swapped});
  const Snapshot host_before(host, {0});
  expect_error([&] { table.truncate(a, 6); },
               {"pagedkv::SequenceTable<NHD>::truncate", "argument 'n_tokens'", "expected in [0, 5]", "got 6"});
  expect_error([&] { table.truncate(a, -1); }, {"SequenceTable<NHD>::truncate", "'n_tokens'", "[0, 5]", "got -1"});
  expect_error([&] { table.truncate(a, std::numeric_limits<int64_t>::max()); }, {"truncate", "'n_tokens'"});
  expect_error([&] { table.truncate(gone, 0); }, {"SequenceTable<NHD>::truncate", "'seq'", "live sequence id",
                                                  "got " + std::to_string(gone), "(released)"});
  expect_error([&] { table.truncate(9, 0); }, {"truncate", "'seq'", "got 9", "(unknown)"});
  expect_error([&] { table.truncate(swapped, 2); }, {"SequenceTable<NHD>::truncate", "'seq'", "swapped out"});
  expect_error([&] { host.truncate(0, 2); },
               {"SequenceTable<HND>::truncate", "'seq'", "holds another table's swapped-out sequence"});
  before.expect_same(table, "truncate bad input");
  host_before.expect_same(host, "truncate bad input (host side)");
  EXPECT_EQ(table.capacity(a), 9);
  EXPECT_EQ(table.length(swapped), 4);
  // a page freed behind the table's back: throws before freeing any other
  const std::vector<int64_t> pages = table.pages(a);  // {p0, p1, p2}; tokens in p0, p1
  cache.free(pages[2]);
  {
    const Snapshot freed(table, {a});
    expect_error([&] { table.truncate(a, 2); },
                 {"SequenceTable<NHD>::truncate", "whose page " + std::to_string(pages[2]) + " (its page 2) is free"});
    freed.expect_same(table, "truncate over a page freed behind its back");
  }
  ASSERT_EQ(cache.alloc(), pages[2]);
  table.truncate(a, 2);
  expect_contents(table, {{a, {0, 1}}}, "after the repair");
  EXPECT_NO_THROW(table.check());
}

// ---- windowed tables ------------------------------------------------------

/// A one-row page table.
at::Tensor table_tensor(const std::vector<int64_t>& row) { return pagedkv_test::table({row}); }

/// Every sequence in `expected` (all the tokens it has seen) keeps exactly
/// its window: released columns read -1 in pages() and batch(), the held
/// ones gather the tokens from the first held column on.
template <class L>
void expect_window_contents(const SequenceTable<L>& table, const std::map<int64_t, std::vector<int64_t>>& expected,
                            const std::string& what) {
  const PagedCache<L>& cache = table.cache();
  const int64_t page_size = cache.page_size(), w = table.window();
  for (const auto& e : expected) {
    const auto n = static_cast<int64_t>(e.second.size());
    ASSERT_EQ(table.length(e.first), n) << what;
    const std::vector<int64_t>& pages = table.pages(e.first);
    const int64_t dropped = w == 0 || n < w ? 0 : (n - w + 1) / page_size;
    ASSERT_GE(static_cast<int64_t>(pages.size()), dropped) << what;
    for (int64_t j = 0; j < static_cast<int64_t>(pages.size()); ++j)
      EXPECT_EQ(pages[static_cast<size_t>(j)] < 0, j < dropped) << what << ": column " << j << " of " << e.first;
    const std::pair<at::Tensor, at::Tensor> pt_len = table.batch({e.first});
    EXPECT_EQ(pt_len.first.size(1), static_cast<int64_t>(pages.size())) << what;
    for (int64_t j = 0; j < pt_len.first.size(1); ++j)
      EXPECT_EQ(pt_len.first[0][j].item<int64_t>(), pages[static_cast<size_t>(j)]) << what;
    const int64_t held_tokens = n - dropped * page_size;
    if (held_tokens <= 0) continue;
    const at::Tensor held =
        table_tensor(std::vector<int64_t>(pages.begin() + static_cast<std::ptrdiff_t>(dropped), pages.end()));
    const std::vector<int64_t> ids(e.second.begin() + static_cast<std::ptrdiff_t>(dropped * page_size),
                                   e.second.end());
    for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
      const auto kv = cache.gather(layer, held, ints({held_tokens}));
      EXPECT_TRUE(bitwise_equal(kv.first[0].cpu(), token_k(ids, layer))) << what << ": k of " << e.first;
      EXPECT_TRUE(bitwise_equal(kv.second[0].cpu(), token_v(ids, layer))) << what << ": v of " << e.first;
    }
  }
}

TEST_P(SequencesTest, WindowedTableReleasesThePagesNoLaterQuerySees) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache, /*window=*/5);
  EXPECT_EQ(table.window(), 5);
  const int64_t a = table.create();
  std::vector<int64_t> seen;
  for (int64_t t = 0; t < 40; ++t) {  // one token a step: pages fall out after each commit
    ASSERT_TRUE(table.prepare_append(a, 1)) << t;
    write_tokens(table, a, {t});
    seen.push_back(t);
    // the next query, at position t + 1, sees [t - 3, t + 1]
    const int64_t dropped = std::max<int64_t>(0, t + 1 - 5 + 1) / 3;
    EXPECT_EQ(std::count(table.pages(a).begin(), table.pages(a).end(), int64_t{-1}), dropped) << t;
    EXPECT_LE(cache.n_pages() - cache.n_free(), 3) << t;  // ceil(4 / 3) + 1 pages at most
    if (t % 7 == 0) expect_window_contents(table, {{a, seen}}, "step " + std::to_string(t));
  }
  EXPECT_EQ(table.length(a), 40);  // positions keep counting
  expect_window_contents(table, {{a, seen}}, "after 40 tokens");
  EXPECT_NO_THROW(table.check());
  table.release(a);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
}

// A chunk's queries see the window of its first token: its pages stay
// until commit_append, then everything older than the last window goes.
TEST_P(SequencesTest, WindowedPrefillHoldsItsPagesUntilTheCommit) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache, /*window=*/4);
  const int64_t a = table.create();
  ASSERT_TRUE(table.prepare_append(a, 10));
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{0, 1, 2, 3}));
  const auto pt_len = table.batch({a});
  const auto view = cache.bind(pt_len.first, pt_len.second + 10);
  const at::TensorOptions o = cache.k_cache().options();
  for (int64_t layer = 0; layer < kLayers; ++layer)
    view.write(layer, 0, token_k(range(0, 10), layer).unsqueeze(0).to(o), token_v(range(0, 10), layer).unsqueeze(0).to(o));
  EXPECT_EQ(view.gather(0).first.size(1), 10);  // every page is still there for the chunk's attention
  table.commit_append(a, 10);  // the next query (position 10) sees [7, 10]: pages 0 and 1 go
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{-1, -1, 2, 3}));
  EXPECT_EQ(cache.n_free(), 6);
  expect_window_contents(table, {{a, range(0, 10)}}, "after the chunk");
  // window 1: after each commit no held page but the next token's
  SequenceTable<NHD> one(cache, /*window=*/1);
  const int64_t b = one.create();
  append(one, b, range(0, 6));  // the next query (position 6) sees only itself
  EXPECT_EQ(one.pages(b), (std::vector<int64_t>{-1, -1}));
  append(one, b, {6, 7});
  EXPECT_EQ(one.pages(b).size(), 3u);
  EXPECT_EQ(std::count(one.pages(b).begin(), one.pages(b).end(), int64_t{-1}), 2);
  expect_window_contents(one, {{b, range(0, 8)}}, "window 1");
  EXPECT_NO_THROW(one.check());
}

TEST_P(SequencesTest, BindAcceptsAWindowedRowAndReadsWithoutAWindowStillRefuseIt) {
  auto cache = device_cache(8);
  SequenceTable<NHD> table(cache, /*window=*/4);
  const int64_t a = table.create();
  append(table, a, range(0, 10));  // {-1, -1, p, p}
  ASSERT_TRUE(table.prepare_append(a, 1));
  const auto pt_len = table.batch({a});
  const at::Tensor lengths = pt_len.second + 1;
  const auto view = cache.bind(pt_len.first, lengths);  // leading -1 columns are fine
  const at::TensorOptions o = cache.k_cache().options();
  const at::Tensor k1 = token_k({10}, 0).unsqueeze(0).to(o), v1 = token_v({10}, 0).unsqueeze(0).to(o);
  view.write(0, pt_len.second, k1, v1);  // a write into the held pages is fine
  const CacheSnapshot before(cache);
  expect_error([&] { view.gather(0); }, {"gather", "'lengths'", "first -1 at column 0"});
  expect_error([&] { cache.gather(0, pt_len.first, lengths); }, {"gather", "'lengths'", "first -1 at column 0"});
  expect_error([&] { view.write(0, 0, k1, v1); }, {"write", "'page_table'", "(unmapped)"});
  const at::Tensor q = at::zeros({1, 1, kHeads, kDim}, o);
  expect_error([&] { pagedkv::paged_attention(view, 0, q); }, {"paged_attention", "'lengths'", "first -1 at column 0"});
  before.expect_same(cache, "reads of a windowed row without a window");
  // bind itself refuses -1 anywhere but in leading columns, and at the last token
  const int64_t p = table.pages(a)[2];
  expect_error([&] { cache.bind(table_tensor({p, -1, p}), ints({9})); },
               {"PagedCache<NHD>::bind", "'lengths'", "lengths[0] <= 3", "first -1 at column 1", "got 9"});
  const int64_t q_page = table.pages(a)[3];
  expect_error([&] { cache.bind(table_tensor({-1, p, -1, q_page}), ints({12})); },
               {"PagedCache<NHD>::bind", "'page_table'", "page_table[0][2]", "position lengths[0] - 1 = 11", "got -1"});
  expect_error([&] { cache.bind(table_tensor({-1, -1, p}), ints({6})); },
               {"bind", "'page_table'", "page_table[0][1]", "position lengths[0] - 1 = 5", "got -1"});
  expect_error([&] { cache.bind(table_tensor({-1, p}), ints({7})); }, {"bind", "'lengths'", "<= 6"});
  EXPECT_NO_THROW(cache.bind(table_tensor({-1, -1}), ints({0})));
  EXPECT_NO_THROW(cache.bind(table_tensor({-1, -1, p}), ints({9})));
  EXPECT_NO_THROW(cache.bind(table_tensor({-1, p, q_page}), ints({9})));
  const int64_t freed = cache.alloc();
  cache.free(freed);
  expect_error([&] { cache.bind(table_tensor({-1, freed}), ints({5})); }, {"bind", "page_table[0][1]", "which is free"});
}

TEST_P(SequencesTest, WindowedForkCopyOnWriteAndSwapMoveOnlyTheHeldPages) {
  auto cache = device_cache(10);
  SequenceTable<NHD> table(cache, /*window=*/5);
  auto hc = host_cache(10);
  SequenceTable<HND> host(hc);
  const int64_t a = table.create();
  append(table, a, range(0, 11));  // the next query sees [7, 11]: {-1, -1, p2, p3}
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{-1, -1, 2, 3}));
  const int64_t b = table.fork(a);  // shares only the held pages
  EXPECT_EQ(table.pages(b), table.pages(a));
  EXPECT_EQ(cache.ref_count(2), 2);
  EXPECT_EQ(cache.ref_count(3), 2);
  EXPECT_EQ(cache.n_free(), 8);
  append(table, b, {50});  // page 3 holds tokens 9, 10: copied
  EXPECT_NE(table.pages(b)[3], 3);
  std::vector<int64_t> b_tokens = range(0, 11);
  b_tokens.push_back(50);
  expect_window_contents(table, {{a, range(0, 11)}, {b, b_tokens}}, "fork + cow");
  expect_refcounts_match(cache, table);
  // swap_out moves the held pages that hold tokens; the host row keeps the released columns
  ASSERT_TRUE(table.reserve(a, 15));  // + 1 reserved page, not swapped
  const int64_t host_free = hc.n_free();
  ASSERT_TRUE(table.swap_out(a, host));
  EXPECT_EQ(hc.n_free(), host_free - 2);
  EXPECT_EQ(host.pages(0).size(), 4u);
  EXPECT_EQ(host.pages(0)[0], -1);
  EXPECT_EQ(host.pages(0)[1], -1);
  EXPECT_EQ(host.length(0), 11);
  append(table, b, {51, 52});
  b_tokens.push_back(51);
  b_tokens.push_back(52);
  ASSERT_TRUE(table.swap_in(a, host));
  EXPECT_EQ(hc.n_free(), hc.n_pages());
  EXPECT_EQ(table.pages(a)[0], -1);
  EXPECT_EQ(table.pages(a)[1], -1);
  EXPECT_EQ(table.capacity(a), 12);
  append(table, a, {60, 61});
  std::vector<int64_t> a_tokens = range(0, 11);
  a_tokens.push_back(60);
  a_tokens.push_back(61);
  expect_window_contents(table, {{a, a_tokens}, {b, b_tokens}}, "after the swap");
  expect_refcounts_match(cache, table);
  EXPECT_NO_THROW(table.check());
  EXPECT_NO_THROW(host.check());
  table.release(a);
  table.release(b);
  EXPECT_EQ(cache.n_free(), cache.n_pages());
}

// A window cannot grow back: truncate keeps a length only while the next
// query's window starts at or after the first held token.
TEST_P(SequencesTest, WindowedTruncateStaysInsideTheHeldWindow) {
  auto cache = device_cache(10);
  SequenceTable<NHD> table(cache, /*window=*/5);
  const int64_t a = table.create();
  append(table, a, range(0, 14));  // the next query sees [10, 14]: columns 0-2 released, tokens from 9 held
  ASSERT_EQ(table.pages(a), (std::vector<int64_t>{-1, -1, -1, 3, 4}));
  const Snapshot before(table, {a});
  expect_error([&] { table.truncate(a, 12); },
               {"pagedkv::SequenceTable<NHD>::truncate", "argument 'n_tokens'", "expected >= 13",
                "window is 5 tokens", "before position 9", "got 12"});
  expect_error([&] { table.truncate(a, 0); }, {"truncate", "'n_tokens'", ">= 13", "got 0"});
  before.expect_same(table, "truncate below the window");
  table.truncate(a, 13);  // the next query sees [9, 13]: nothing more to release
  EXPECT_EQ(table.pages(a), (std::vector<int64_t>{-1, -1, -1, 3, 4}));
  expect_window_contents(table, {{a, range(0, 13)}}, "truncated in the window");
  append(table, a, {70, 71});
  std::vector<int64_t> tokens = range(0, 13);
  tokens.push_back(70);
  tokens.push_back(71);
  expect_window_contents(table, {{a, tokens}}, "appended after truncate");
  // before anything is released, any length may be kept
  const int64_t b = table.create();
  append(table, b, range(0, 6));  // the next query sees [2, 6]: nothing released
  table.truncate(b, 0);
  EXPECT_TRUE(table.pages(b).empty());
  EXPECT_NO_THROW(table.check());
  // A page freed behind the table's back: the commit that would release it throws, changing nothing.
  const int64_t c = table.create();
  append(table, c, range(0, 6));  // the next query sees [2, 6]: nothing released yet
  ASSERT_TRUE(table.prepare_append(c, 1));
  const int64_t first = table.pages(c)[0];
  cache.free(first);
  {
    const Snapshot freed(table, {a, c});
    expect_error([&] { table.commit_append(c, 1); },
                 {"SequenceTable<NHD>::commit_append", "whose page " + std::to_string(first) + " (its page 0) is free"});
    freed.expect_same(table, "commit_append over a page freed behind its back");
  }
  ASSERT_EQ(cache.alloc(), first);
  table.commit_append(c, 1);  // the next query sees [3, 7]: page 0 goes
  EXPECT_EQ(table.pages(c)[0], -1);
  expect_window_contents(table, {{c, range(0, 7)}}, "after the repair");
  EXPECT_NO_THROW(table.check());
}

TEST_P(SequencesTest, WindowAndPrefixCacheBadInputThrow) {
  auto cache = device_cache(4);
  expect_error([&] { SequenceTable<NHD> bad(cache, -1); },
               {"pagedkv::SequenceTable<NHD>::SequenceTable", "argument 'window'", ">= 0", "got -1"});
  SequenceTable<NHD> windowed(cache, /*window=*/8);
  expect_error([&] { pagedkv::PrefixCache<NHD> prefix(windowed); },
               {"pagedkv::PrefixCache<NHD>", "argument 'seqs'", "without a window", "window 8"});
  // the refusal left the table free for a later prefix cache... of an unwindowed table
  SequenceTable<NHD> plain(cache);
  EXPECT_EQ(plain.window(), 0);
  EXPECT_NO_THROW(pagedkv::PrefixCache<NHD> prefix(plain));
  const int64_t s = windowed.create();
  append(windowed, s, range(0, 3));
  EXPECT_EQ(cache.n_free(), 3);
}

TEST_P(SequencesTest, CheckNamesTheFirstBrokenInvariant) {
  auto cache = device_cache(10);
  SequenceTable<NHD> table(cache, /*window=*/4);
  const int64_t a = table.create();
  append(table, a, range(0, 10));  // {-1, -1, p2, p3}
  const std::vector<int64_t> pages = table.pages(a);
  EXPECT_NO_THROW(table.check());
  const std::vector<int64_t> released = cache.alloc_n(2);  // the window's pages 0 and 1: the lowest free
  ASSERT_EQ(released, (std::vector<int64_t>{0, 1}));
  EXPECT_NO_THROW(table.check());  // pages held outside the table are fine
  cache.free(pages[2]);
  expect_error([&] { table.check(); }, {"pagedkv::SequenceTable<NHD>::check", "sequence 0 holds page " +
                                        std::to_string(pages[2]) + " in column 2", "not an allocated page"});
  ASSERT_EQ(cache.alloc(), pages[2]);
  const int64_t b = table.fork(a);
  cache.free(pages[3]);  // one of its two references
  expect_error([&] { table.check(); }, {"check", "page " + std::to_string(pages[3]) + " has ref_count 1",
                                        "the table holds 2 references"});
  cache.retain(pages[3]);
  SequenceTableTestAccess::dropped(table, b) = 1;
  expect_error([&] { table.check(); }, {"check", "sequence 1 of length 10 has 1 released pages, expected 2",
                                        "window 4"});
  SequenceTableTestAccess::dropped(table, b) = 2;
  SequenceTableTestAccess::pages(table, b)[1] = pages[2];
  expect_error([&] { table.check(); }, {"check", "sequence 1 holds page " + std::to_string(pages[2]),
                                        "in released column 1"});
  SequenceTableTestAccess::pages(table, b)[1] = -1;
  SequenceTableTestAccess::pages(table, b)[3] = pages[2];
  expect_error([&] { table.check(); }, {"check", "sequence 1 holds page " + std::to_string(pages[2]) + " twice"});
  SequenceTableTestAccess::pages(table, b)[3] = pages[3];
  SequenceTableTestAccess::pages(table, b).pop_back();
  expect_error([&] { table.check(); }, {"check", "sequence 1 has length 10 but 3 pages"});
  SequenceTableTestAccess::pages(table, b).push_back(pages[3]);
  EXPECT_NO_THROW(table.check());
  for (int64_t page : released) cache.free(page);
}

// ---- property test -------------------------------------------------------

/// Random create / reserve / fork / append (prepare, write, commit) /
/// truncate / release / swap_out / swap_in against a model of per-sequence
/// token lists; with a window, each sequence must hold exactly its window.
template <class DevLayout, class HostLayout>
void run_property(const at::TensorOptions& dev_opts, uint64_t seed, int64_t steps, int64_t window = 0) {
  const int64_t page_size = 1 + static_cast<int64_t>(seed % 4);  // 1..4
  PagedCache<DevLayout> cache(kLayers, 24, page_size, kHeads, kDim, dev_opts);
  PagedCache<HostLayout> hc(kLayers, 14, page_size, kHeads, kDim, at::TensorOptions().dtype(at::kFloat));
  SequenceTable<DevLayout> table(cache, window);
  SequenceTable<HostLayout> host(hc);
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  std::map<int64_t, std::vector<int64_t>> model;  // every live device-table sequence
  std::set<int64_t> swapped;
  int64_t next_token = 0;
  int64_t failed = 0, cow_forks = 0, swaps = 0, truncates = 0, refused_truncates = 0;
  // The first token the next query of a sequence of n tokens sees lies in column dropped(n).
  auto dropped = [&](int64_t n) { return window == 0 || n < window ? 0 : (n - window + 1) / page_size; };
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
    } else if (op < 33) {
      const int64_t s = pick(true);
      if (s < 0) continue;
      const int64_t child = table.fork(s);
      model[child] = model[s];
      ++cow_forks;
    } else if (op < 43) {
      const int64_t s = pick(true);
      if (s < 0) continue;
      const auto length = static_cast<int64_t>(model[s].size());
      const int64_t n = uniform(0, 2) == 0 ? uniform(0, length) : std::max<int64_t>(0, length - uniform(0, 3));
      const int64_t first_held = dropped(length) * page_size;
      if (first_held > 0 && n - first_held < window - 1) {  // the window would reach released pages
        const auto pages_before = table.pages(s);
        const int64_t free_before = cache.n_free();
        EXPECT_THROW(table.truncate(s, n), c10::Error) << what;
        EXPECT_EQ(table.pages(s), pages_before) << what;
        EXPECT_EQ(cache.n_free(), free_before) << what;
        ++refused_truncates;
      } else {
        table.truncate(s, n);
        model[s].resize(static_cast<size_t>(n));
        EXPECT_EQ(table.capacity(s), (n + page_size - 1) / page_size * page_size) << what;
        ++truncates;
      }
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
      if (window > 0) {  // the pages that hold tokens: the window's and the next token's
        const int64_t length = table.length(s);
        const int64_t holding = (length + page_size - 1) / page_size - dropped(length);
        EXPECT_LE(holding, (window - 1 + page_size - 1) / page_size + 1) << what;
      }
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
    ASSERT_NO_THROW(table.check()) << what;
    ASSERT_NO_THROW(host.check()) << what;
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
      if (window == 0) {
        expect_contents(table, resident, what);
      } else {
        expect_window_contents(table, resident, what);
      }
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
  EXPECT_GT(truncates, 0) << "seed " << seed;
  if (window > 0) {
    EXPECT_GT(refused_truncates, 0) << "seed " << seed;
  }
}

TEST_P(SequencesTest, PropertyRandomOperationsMatchAReferenceModel) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    run_property<NHD, HND>(opts(), seed, 250);
    run_property<HND, HND>(opts(), seed + 100, 250);
    run_property<HND, NHD>(opts(), seed + 200, 150);
    if (HasFailure()) return;
  }
}

TEST_P(SequencesTest, PropertyWindowedTablesMatchAReferenceModel) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    run_property<NHD, HND>(opts(), seed + 300, 250, /*window=*/1 + static_cast<int64_t>(seed % 3) * 3);  // 1, 4, 7
    run_property<HND, NHD>(opts(), seed + 400, 200, /*window=*/static_cast<int64_t>(seed) + 1);
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, SequencesTest, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);

}  // namespace
