// PrefixCache: matching (full pages only, max_tokens, salts, token
// comparison under a constant hash), peek without side effects, insert
// without duplicates, reference counts, LRU and leaves-first eviction, the
// attached table's allocations evicting just the shortfall, failure
// atomicity (stats included), and a property test against a model (a map
// from (salt, token prefix) to page) with K/V read back bit-exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace pagedkv {
struct PagePoolTestAccess {
  static std::vector<int32_t>& refs(PagePool& p) { return p.refs_; }
};
/// Tests swap the page hash for a constant one: every page then collides
/// with every other, so only the token comparison tells them apart.
struct PrefixCacheTestAccess {
  template <class L>
  static void set_page_hash(PrefixCache<L>& cache, PrefixPageHash hash) {
    ASSERT_EQ(cache.n_cached(), 0) << "set the hash before anything is cached";
    cache.hash_ = hash;
  }
};
}  // namespace pagedkv

namespace {

using pagedkv::PrefixCache;
using pagedkv::PrefixStats;
using pagedkv::SequenceTable;
using namespace pagedkv_test;

constexpr int64_t kHeads = 2;
constexpr int64_t kDim = 4;
constexpr int64_t kLayers = 2;
constexpr int64_t kPage = 3;

template <class L = NHD>
PagedCache<L> make_cache(int64_t n_pages, int64_t page_size = kPage) {
  return PagedCache<L>(kLayers, n_pages, page_size, kHeads, kDim, at::TensorOptions().dtype(at::kFloat));
}

// ---- K/V contents: a token's K/V depends on its id and position only, as a
// model's would on its prefix, so a cached page is valid for any prompt
// that starts with the same tokens ----
at::Tensor kv_of(const std::vector<int64_t>& ids, int64_t first_pos, int64_t layer, bool is_v) {
  std::vector<int64_t> key(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) key[i] = ids[i] * 256 + first_pos + static_cast<int64_t>(i);
  const at::Tensor t = at::tensor(key, at::kLong).view({-1, 1, 1});
  const at::Tensor k = (t * 32 + layer * 16 + at::arange(kHeads * kDim, at::kLong).view({1, kHeads, kDim})).to(at::kFloat);
  return is_v ? -k - 1 : k;
}

/// Writes prompt[length(seq) : end) into seq (prepare_append must succeed) and commits.
template <class L>
void extend(SequenceTable<L>& table, int64_t seq, const std::vector<int64_t>& prompt, int64_t end) {
  const int64_t from = table.length(seq);
  ASSERT_LE(from, end);
  if (from == end) return;
  ASSERT_TRUE(table.prepare_append(seq, end - from));
  const std::vector<int64_t> ids(prompt.begin() + from, prompt.begin() + end);
  const auto pt_len = table.batch({seq});
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    table.cache().write(layer, pt_len.first, from, kv_of(ids, from, layer, false).unsqueeze(0),
                        kv_of(ids, from, layer, true).unsqueeze(0));
  }
  table.commit_append(seq, end - from);
}

/// seq gathers exactly `tokens` (bit-exact K and V).
template <class L>
void expect_tokens(const SequenceTable<L>& table, int64_t seq, const std::vector<int64_t>& tokens,
                   const std::string& what) {
  ASSERT_EQ(table.length(seq), static_cast<int64_t>(tokens.size())) << what;
  if (tokens.empty()) return;
  const auto pt_len = table.batch({seq});
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    const auto kv = table.cache().gather(layer, pt_len.first, pt_len.second);
    EXPECT_TRUE(bitwise_equal(kv.first[0], kv_of(tokens, 0, layer, false))) << what << ": k, layer " << layer;
    EXPECT_TRUE(bitwise_equal(kv.second[0], kv_of(tokens, 0, layer, true))) << what << ": v, layer " << layer;
  }
}

/// A request: acquire, compute the rest of the prompt, register it. Returns {seq, matched}.
template <class L>
std::pair<int64_t, int64_t> serve(PrefixCache<L>& prefix, SequenceTable<L>& table, const std::vector<int64_t>& prompt,
                                  uint64_t salt = 0) {
  const auto hit = prefix.acquire(ints(prompt), salt);
  extend(table, hit.first, prompt, static_cast<int64_t>(prompt.size()));
  prefix.insert(hit.first, ints(prompt), salt);
  return hit;
}

std::vector<int64_t> iota_tokens(int64_t n, int64_t first = 1) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(first + i);
  return out;
}

bool same_stats(const PrefixStats& a, const PrefixStats& b) {
  return a.lookups == b.lookups && a.query_tokens == b.query_tokens && a.hit_tokens == b.hit_tokens &&
         a.inserted_pages == b.inserted_pages && a.evicted_pages == b.evicted_pages;
}

// ---- matching ----

TEST(PrefixCache, MissThenHitSharesThePagesWithRefCounts) {
  for_each_layout([](auto layout) {
    using L = decltype(layout);
    auto cache = make_cache<L>(16);
    SequenceTable<L> table(cache);
    PrefixCache<L> prefix(table);
    const auto prompt = iota_tokens(10);  // 3 full pages + 1 token
    const auto first = prefix.acquire(ints(prompt));
    EXPECT_EQ(first.second, 0);
    EXPECT_EQ(table.length(first.first), 0);
    EXPECT_TRUE(table.pages(first.first).empty());
    extend(table, first.first, prompt, 10);
    EXPECT_EQ(prefix.insert(first.first, ints(prompt)), 3);
    EXPECT_EQ(prefix.n_cached(), 3);
    EXPECT_EQ(prefix.n_evictable(), 0);  // the sequence still holds them

    const auto second = prefix.acquire(ints(prompt));
    EXPECT_EQ(second.second, 9);
    EXPECT_EQ(table.length(second.first), 9);
    const std::vector<int64_t> shared(table.pages(first.first).begin(), table.pages(first.first).begin() + 3);
    EXPECT_EQ(table.pages(second.first), shared);
    for (int64_t page : shared) EXPECT_EQ(cache.ref_count(page), 3) << "two sequences + the cache";
    extend(table, second.first, prompt, 10);
    expect_tokens(table, second.first, prompt, "the hit's own last token after the shared pages");
    EXPECT_NE(table.pages(second.first)[3], table.pages(first.first)[3]);
    prefix.check();

    const PrefixStats s = prefix.stats();
    EXPECT_EQ(s.lookups, 2);
    EXPECT_EQ(s.query_tokens, 18);
    EXPECT_EQ(s.hit_tokens, 9);
    EXPECT_EQ(s.inserted_pages, 3);
    EXPECT_EQ(s.evicted_pages, 0);
    prefix.reset_stats();
    EXPECT_TRUE(same_stats(prefix.stats(), PrefixStats{}));
  });
}

TEST(PrefixCache, OnlyFullPagesMatchAndTheLastTokenIsRecomputedByDefault) {
  auto cache = make_cache(16);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const auto prompt = iota_tokens(8);  // 2 full pages + 2 tokens: only 2 pages registered
  serve(prefix, table, prompt);
  EXPECT_EQ(prefix.n_cached(), 2);
  EXPECT_EQ(prefix.peek(ints(prompt)), 6);                     // cap 7 -> 2 pages
  EXPECT_EQ(prefix.peek(ints(prompt), 0, 8), 6);               // the partial page never matches
  EXPECT_EQ(prefix.peek(ints(iota_tokens(6))), 3);             // cap 5: the last token is recomputed
  EXPECT_EQ(prefix.peek(ints(iota_tokens(6)), 0, 6), 6);       // an explicit cap may take it all
  EXPECT_EQ(prefix.peek(ints(iota_tokens(7)), 0, 5), 3);       // max_tokens caps the match
  EXPECT_EQ(prefix.peek(ints(iota_tokens(7)), 0, 0), 0);
  EXPECT_EQ(prefix.peek(ints(iota_tokens(7)), 0, 1000), 6);    // capped at the prompt
  EXPECT_EQ(prefix.peek(ints(std::vector<int64_t>{})), 0);
  EXPECT_EQ(prefix.peek(ints({1, 2, 3, 4, 5, 99, 7})), 3);     // differs inside page 1
  EXPECT_EQ(prefix.peek(ints({9, 2, 3, 4, 5, 6, 7})), 0);      // differs in page 0: nothing after it matches
  EXPECT_EQ(prefix.peek(ints(prompt, at::kInt)), 6);           // int32 tokens are the same tokens

  const auto hit = prefix.acquire(ints(iota_tokens(7)), 0, 5);
  EXPECT_EQ(hit.second, 3);
  EXPECT_EQ(prefix.stats().query_tokens, 8 - 1 + 5);
  prefix.check();
}

TEST(PrefixCache, PeekChangesNothingNotEvenRecency) {
  auto cache = make_cache(16);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const auto a = serve(prefix, table, {1, 2, 3, 0});
  const auto b = serve(prefix, table, {4, 5, 6, 0});
  table.release(a.first);
  table.release(b.first);
  const PrefixStats before = prefix.stats();
  const CacheSnapshot snapshot(cache);
  EXPECT_EQ(prefix.peek(ints({1, 2, 3, 0})), 3);  // would make A the most recent if it counted as a use
  EXPECT_TRUE(same_stats(prefix.stats(), before));
  snapshot.expect_same(cache, "peek");
  EXPECT_EQ(prefix.evict(1), 1);
  EXPECT_EQ(prefix.peek(ints({1, 2, 3, 0})), 0) << "A is still the least recently used";
  EXPECT_EQ(prefix.peek(ints({4, 5, 6, 0})), 3);
  prefix.check();
}

TEST(PrefixCache, SaltsNeverShare) {
  auto cache = make_cache(16);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const std::vector<int64_t> prompt = {1, 2, 3, 4, 5, 6, 7};
  serve(prefix, table, prompt, /*salt=*/1);
  EXPECT_EQ(prefix.peek(ints(prompt), 1), 6);
  EXPECT_EQ(prefix.peek(ints(prompt), 2), 0);
  EXPECT_EQ(prefix.peek(ints(prompt)), 0);
  const auto other = serve(prefix, table, prompt, /*salt=*/2);
  EXPECT_EQ(other.second, 0);
  EXPECT_EQ(prefix.n_cached(), 4) << "the same tokens under another salt are other pages";
  EXPECT_EQ(prefix.acquire(ints(prompt), 2).second, 6);
  // A sequence that shares salt 1's pages cannot register them under salt 2.
  const auto salt1 = prefix.acquire(ints(prompt), 1);
  const PrefixStats before = prefix.stats();
  expect_error([&] { prefix.insert(salt1.first, ints(prompt), 2); },
               {"pagedkv::PrefixCache<NHD>::insert", "argument 'tokens'", "salt"});
  EXPECT_TRUE(same_stats(prefix.stats(), before));
  prefix.check();
}

TEST(PrefixCache, DuplicatesAreNotRegisteredTwice) {
  auto cache = make_cache(16);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const auto prompt = iota_tokens(7);
  // Two requests computed the same prompt before either was registered.
  const int64_t a = table.create();
  const int64_t b = table.create();
  extend(table, a, prompt, 7);
  extend(table, b, prompt, 7);
  EXPECT_EQ(prefix.insert(a, ints(prompt)), 2);
  EXPECT_EQ(prefix.insert(b, ints(prompt)), 0);
  EXPECT_EQ(prefix.insert(a, ints(prompt)), 0);
  EXPECT_EQ(prefix.n_cached(), 2);
  for (int64_t page : table.pages(b)) EXPECT_EQ(cache.ref_count(page), 1) << "b's own pages stay uncached";
  // b continues the prompt: its next page is registered after a's cached pages.
  auto longer = prompt;
  longer.insert(longer.end(), {8, 9, 10});
  extend(table, b, longer, 10);
  EXPECT_EQ(prefix.insert(b, ints(longer)), 1);
  const auto hit = prefix.acquire(ints(longer), 0, 9);
  EXPECT_EQ(hit.second, 9);
  EXPECT_EQ(table.pages(hit.first)[0], table.pages(a)[0]);
  EXPECT_EQ(table.pages(hit.first)[2], table.pages(b)[2]);
  expect_tokens(table, hit.first, std::vector<int64_t>(longer.begin(), longer.begin() + 9), "mixed chain");
  EXPECT_EQ(prefix.stats().inserted_pages, 3);
  prefix.check();
}

TEST(PrefixCache, AConstantHashGivesTheSameResultsBecauseTokensAreCompared) {
  const std::vector<std::vector<int64_t>> prompts = {
      {1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5, 9, 7}, {1, 2, 4, 4, 5, 6, 7}, {3, 2, 1, 4, 5, 6, 7}, {1, 2, 3, 0}};
  std::vector<std::vector<int64_t>> results[2];
  for (int constant = 0; constant < 2; ++constant) {
    auto cache = make_cache(32);
    SequenceTable<NHD> table(cache);
    PrefixCache<NHD> prefix(table);
    if (constant == 1) {
      pagedkv::PrefixCacheTestAccess::set_page_hash(
          prefix, [](uint64_t, const int64_t*, int64_t) -> uint64_t { return 42; });
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto hit = serve(prefix, table, prompts[i], /*salt=*/i % 2);
      std::vector<int64_t> row = {hit.second};
      for (const auto& p : prompts) {
        row.push_back(prefix.peek(ints(p), 0, 7));
        row.push_back(prefix.peek(ints(p), 1, 7));
      }
      results[constant].push_back(row);
      expect_tokens(table, hit.first, prompts[i], "prompt " + std::to_string(i));
      prefix.check();
    }
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[1][2][0], 0) << "prompt 2 (salt 0) differs from prompt 0 inside page 0";
  EXPECT_EQ(results[1][4][0], 3) << "prompt 4 (salt 0) shares prompt 0's page 0";
}

// ---- reference counts and eviction ----

TEST(PrefixCache, EvictsLeavesOnlyLeastRecentlyUsedFirst) {
  auto cache = make_cache(32);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  // A tree: root [1 2 3] with children [4 5 6] (prompt P) and [7 8 9] (prompt Q, later).
  const std::vector<int64_t> p = {1, 2, 3, 4, 5, 6, 0};
  const std::vector<int64_t> q = {1, 2, 3, 7, 8, 9, 0};
  const auto sp = serve(prefix, table, p);
  const auto sq = serve(prefix, table, q);
  EXPECT_EQ(sq.second, 3);
  EXPECT_EQ(prefix.n_cached(), 3);
  const int64_t root = table.pages(sp.first)[0];
  const int64_t p_leaf = table.pages(sp.first)[1];
  const int64_t q_leaf = table.pages(sq.first)[1];
  EXPECT_EQ(cache.ref_count(root), 3);
  EXPECT_EQ(prefix.n_evictable(), 0);
  EXPECT_EQ(prefix.evict(10), 0) << "every cached page is held";

  table.release(sp.first);
  EXPECT_EQ(cache.ref_count(p_leaf), 1);
  EXPECT_EQ(cache.ref_count(root), 2);
  EXPECT_EQ(prefix.n_evictable(), 1);
  EXPECT_EQ(prefix.n_reclaimable(), 1);
  table.release(sq.first);
  EXPECT_EQ(prefix.n_evictable(), 2) << "the two leaves; the root is continued";
  EXPECT_EQ(prefix.n_reclaimable(), 3);
  prefix.check();

  EXPECT_EQ(prefix.evict(1), 1);
  EXPECT_EQ(cache.ref_count(p_leaf), 0) << "P's leaf is the least recently used";
  EXPECT_EQ(cache.ref_count(q_leaf), 1);
  EXPECT_EQ(cache.ref_count(root), 1) << "the root is used more recently than any leaf";
  // A use of P's root (acquire) makes Q's leaf the oldest page.
  const auto again = prefix.acquire(ints({1, 2, 3, 4}));
  EXPECT_EQ(again.second, 3);
  EXPECT_EQ(prefix.n_evictable(), 1);
  EXPECT_EQ(prefix.evict(5), 1) << "only Q's leaf: the root is held again";
  table.release(again.first);
  EXPECT_EQ(prefix.n_evictable(), 1);
  EXPECT_EQ(prefix.evict(0), 0);
  EXPECT_EQ(prefix.evict(5), 1);
  EXPECT_EQ(prefix.n_cached(), 0);
  EXPECT_EQ(cache.n_free(), 32);
  EXPECT_EQ(prefix.stats().evicted_pages, 3);
  prefix.check();
}

TEST(PrefixCache, LaterPagesOfOneCallCountAsLessRecentlyUsed) {
  auto cache = make_cache(32);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const auto a = serve(prefix, table, iota_tokens(10));  // a chain of 3 pages
  const auto b = serve(prefix, table, {50, 51, 52, 0});  // one page, more recent
  table.release(a.first);
  table.release(b.first);
  EXPECT_EQ(prefix.n_evictable(), 2);
  EXPECT_EQ(prefix.n_reclaimable(), 4);
  // The chain's pages go first, leaf to root (one walk frees parents it freed the children of).
  EXPECT_EQ(prefix.evict(3), 3);
  EXPECT_EQ(prefix.peek(ints({50, 51, 52, 0})), 3);
  EXPECT_EQ(prefix.peek(ints(iota_tokens(10))), 0);
  prefix.clear();
  EXPECT_EQ(prefix.n_cached(), 0);
  EXPECT_EQ(cache.n_free(), 32);
  prefix.check();
}

TEST(PrefixCache, ClearFreesEverythingNoSequenceHoldsAndTheDestructorDropsTheRest) {
  auto cache = make_cache(32);
  SequenceTable<NHD> table(cache);
  {
    PrefixCache<NHD> prefix(table);
    const auto a = serve(prefix, table, iota_tokens(10));
    const auto b = serve(prefix, table, iota_tokens(7, 20));
    table.release(a.first);
    prefix.clear();
    EXPECT_EQ(prefix.n_cached(), 2) << "b's pages are held";
    EXPECT_EQ(cache.n_free(), 32 - 3);
    prefix.check();
    (void)b;
  }
  EXPECT_EQ(cache.n_free(), 32 - 3) << "b keeps its pages";
  for (int64_t page : table.pages(1)) EXPECT_EQ(cache.ref_count(page), 1);
  PrefixCache<NHD> again(table);  // detached: a new cache may attach
  EXPECT_EQ(again.n_cached(), 0);
}

// ---- the attached table ----

TEST(PrefixCache, AttachedAllocationsEvictJustTheShortfall) {
  auto cache = make_cache(8);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const auto a = serve(prefix, table, iota_tokens(10));      // 4 pages, 3 cached
  const auto b = serve(prefix, table, iota_tokens(7, 20));   // 3 pages, 2 cached
  EXPECT_EQ(cache.n_free(), 1);
  table.release(a.first);
  table.release(b.first);
  EXPECT_EQ(cache.n_free(), 3);
  EXPECT_EQ(prefix.n_reclaimable(), 5);
  prefix.check();

  const int64_t s = table.create();
  ASSERT_TRUE(table.reserve(s, 4 * kPage));  // 4 pages: 3 free + 1 evicted
  EXPECT_EQ(prefix.n_cached(), 4);
  EXPECT_EQ(prefix.stats().evicted_pages, 1);
  EXPECT_EQ(prefix.peek(ints(iota_tokens(10))), 6) << "the least recently used page went: a's leaf";
  EXPECT_EQ(cache.n_free(), 0);
  prefix.check();

  // Short by more than free + reclaimable: false, nothing changed (stats included).
  const PrefixStats before = prefix.stats();
  const CacheSnapshot snapshot(cache);
  EXPECT_FALSE(table.reserve(s, 9 * kPage));
  EXPECT_FALSE(table.prepare_append(s, 9 * kPage));
  snapshot.expect_same(cache, "failed reserve / prepare_append");
  EXPECT_TRUE(same_stats(prefix.stats(), before));
  EXPECT_EQ(prefix.n_cached(), 4);
  EXPECT_EQ(table.capacity(s), 4 * kPage);

  // Exactly free + reclaimable: everything goes, chains leaf first.
  ASSERT_TRUE(table.prepare_append(s, 8 * kPage));
  EXPECT_EQ(prefix.n_cached(), 0);
  EXPECT_EQ(prefix.stats().evicted_pages, 5);
  EXPECT_EQ(cache.n_free(), 0);
  prefix.check();
}

TEST(PrefixCache, SwapInAndSwapOutIntoAHostWithItsOwnCacheEvict) {
  auto cache = make_cache(6);
  auto host_cache = make_cache<HND>(4);
  SequenceTable<NHD> table(cache);
  SequenceTable<HND> host(host_cache);
  PrefixCache<NHD> prefix(table);
  PrefixCache<HND> host_prefix(host);
  // The host's cache holds 3 reclaimable pages of its own.
  const int64_t h = host.create();
  extend(host, h, iota_tokens(10, 30), 9);
  EXPECT_EQ(host_prefix.insert(h, ints(iota_tokens(10, 30))), 3);
  host.release(h);
  EXPECT_EQ(host_cache.n_free(), 1);

  const auto a = serve(prefix, table, iota_tokens(7));  // 3 pages, 2 cached
  ASSERT_TRUE(table.swap_out(a.first, host));           // 3 host pages: 1 free + 2 evicted
  EXPECT_EQ(host_prefix.stats().evicted_pages, 2);
  EXPECT_EQ(prefix.n_reclaimable(), 2) << "a's pages are only the cache's now";
  // Fill this cache so that swap_in must evict.
  const int64_t filler = table.create();
  ASSERT_TRUE(table.reserve(filler, 3 * kPage));
  EXPECT_EQ(cache.n_free(), 1);
  ASSERT_TRUE(table.swap_in(a.first, host));
  EXPECT_EQ(prefix.stats().evicted_pages, 2);
  expect_tokens(table, a.first, iota_tokens(7), "after the round trip");
  prefix.check();
  host_prefix.check();
  // Registering the swapped-in copy: its pages' prefixes are gone, so they are cached again.
  EXPECT_EQ(prefix.insert(a.first, ints(iota_tokens(7))), 2);
  prefix.check();
}

TEST(PrefixCache, ForkCopyOnWriteSwapAndReleaseOnSharedCachedPages) {
  for_each_layout([](auto layout) {
    using L = decltype(layout);
    auto cache = make_cache<L>(24);
    auto host_cache = make_cache<NHD>(24);
    SequenceTable<L> table(cache);
    SequenceTable<NHD> host(host_cache);
    PrefixCache<L> prefix(table);
    const auto prompt = iota_tokens(8);
    const auto a = serve(prefix, table, prompt);
    const auto b = prefix.acquire(ints(prompt));  // shares 2 cached pages
    EXPECT_EQ(b.second, 6);
    const int64_t c = table.fork(b.first);
    extend(table, b.first, prompt, 8);
    auto c_tokens = std::vector<int64_t>(prompt.begin(), prompt.begin() + 6);
    c_tokens.insert(c_tokens.end(), {40, 41, 42, 43});
    extend(table, c, c_tokens, 10);
    ASSERT_TRUE(table.swap_out(a.first, host));
    prefix.check();
    table.release(b.first);
    EXPECT_EQ(prefix.insert(c, ints(c_tokens)), 1);
    prefix.check();
    ASSERT_TRUE(table.swap_in(a.first, host));
    expect_tokens(table, a.first, prompt, "a");
    expect_tokens(table, c, c_tokens, "c");
    table.release(c);
    table.release(a.first);
    EXPECT_EQ(prefix.n_reclaimable(), 3);
    prefix.check();
    prefix.clear();
    EXPECT_EQ(cache.n_free(), 24);
  });
}

// Speculative decoding's rollback on a sequence whose pages are cached:
// truncate drops only the sequence's references, and a kept cached page is
// copied before the next write lands in it.
TEST(PrefixCache, TruncateNeverFreesOrOverwritesACachedPage) {
  for_each_layout([](auto layout) {
    using L = decltype(layout);
    auto cache = make_cache<L>(12);
    SequenceTable<L> table(cache);
    PrefixCache<L> prefix(table);
    const auto prompt = iota_tokens(10);
    const auto a = serve(prefix, table, prompt);  // 3 cached pages + page 3 with token 10
    const std::vector<int64_t> pages = table.pages(a.first);
    EXPECT_EQ(prefix.n_evictable(), 0);
    table.truncate(a.first, 4);  // keeps pages 0 and 1 (1 partly): pages 2 and 3 lose a's reference
    EXPECT_EQ(table.pages(a.first), std::vector<int64_t>(pages.begin(), pages.begin() + 2));
    EXPECT_EQ(cache.ref_count(pages[2]), 1);  // the cache's own
    EXPECT_EQ(cache.ref_count(pages[3]), 0);  // not cached: back to the pool
    EXPECT_EQ(prefix.n_cached(), 3);
    EXPECT_EQ(prefix.n_evictable(), 1);  // page 2: a leaf nobody holds
    prefix.check();
    auto rewritten = std::vector<int64_t>(prompt.begin(), prompt.begin() + 4);
    rewritten.insert(rewritten.end(), {90, 91, 92});
    extend(table, a.first, rewritten, 7);  // lands in cached page 1: a copy first
    EXPECT_NE(table.pages(a.first)[1], pages[1]);
    EXPECT_EQ(cache.ref_count(pages[1]), 1);
    expect_tokens(table, a.first, rewritten, "the rolled-back sequence");
    const auto hit = prefix.acquire(ints(prompt));  // the cached prompt is intact
    EXPECT_EQ(hit.second, 9);
    extend(table, hit.first, prompt, 10);
    expect_tokens(table, hit.first, prompt, "a later request on the cached pages");
    table.truncate(hit.first, 0);
    EXPECT_EQ(prefix.n_cached(), 3);
    prefix.check();
    table.release(a.first);
    table.release(hit.first);
    prefix.clear();
    EXPECT_EQ(cache.n_free(), 12);
  });
}

// A windowed table's sequence swapped out into a table with a prefix
// cache: its host-side copy keeps the released columns as -1, which the
// prefix cache's audit and its eviction accounting skip.
TEST(PrefixCache, AHostTableHoldsAWindowedSequencesCopy) {
  auto cache = make_cache(8);
  auto host_cache = make_cache(8);
  SequenceTable<NHD> table(cache, /*window=*/2);
  SequenceTable<NHD> host(host_cache);
  PrefixCache<NHD> prefix(host);
  serve(prefix, host, iota_tokens(4));  // one cached page in the host cache
  const int64_t s = table.create();
  extend(table, s, iota_tokens(8), 8);  // the next query sees [7, 8]: columns 0 and 1 released
  ASSERT_EQ(table.pages(s)[1], -1);
  ASSERT_TRUE(table.swap_out(s, host));
  const int64_t holder = host.size() - 1;
  EXPECT_EQ(host.pages(holder)[0], -1);
  EXPECT_NO_THROW(prefix.check());
  EXPECT_NO_THROW(host.check());
  ASSERT_TRUE(table.swap_in(s, host));
  EXPECT_NO_THROW(prefix.check());
  EXPECT_EQ(table.pages(s)[1], -1);
  EXPECT_EQ(host_cache.n_free(), 8 - 2);  // the served request's two pages
}

// ---- bad input ----

TEST(PrefixCache, BadInputThrowsNamingTheArgumentAndChangesNothing) {
  auto cache = make_cache(16);
  auto host_cache = make_cache<NHD>(16);
  SequenceTable<NHD> table(cache);
  SequenceTable<NHD> host(host_cache);
  PrefixCache<NHD> prefix(table);
  const auto prompt = iota_tokens(8);
  const auto a = serve(prefix, table, prompt);
  const auto b = serve(prefix, table, iota_tokens(5, 60));
  ASSERT_TRUE(table.swap_out(b.first, host));
  const int64_t released = table.create();
  table.release(released);
  const PrefixStats before = prefix.stats();
  const CacheSnapshot snapshot(cache);
  const int64_t cached = prefix.n_cached();
  const auto fn = [](const char* f) { return std::string("pagedkv::PrefixCache<NHD>::") + f; };

  const at::Tensor bad_tokens[] = {ints(prompt).view({2, 4}), ints(prompt).to(at::kFloat), at::Tensor(),
                                   at::empty({8}, at::TensorOptions().dtype(at::kLong).device(at::kMeta))};
  const char* bad_what[] = {"expected 1-D", "expected dtype int32 or int64", "expected a tensor", "expected on cpu"};
  for (size_t i = 0; i < 4; ++i) {
    expect_error([&] { prefix.peek(bad_tokens[i]); }, {fn("peek"), "argument 'tokens'", bad_what[i]});
    expect_error([&] { prefix.acquire(bad_tokens[i]); }, {fn("acquire"), "argument 'tokens'", bad_what[i]});
    expect_error([&] { prefix.insert(a.first, bad_tokens[i]); }, {fn("insert"), "argument 'tokens'", bad_what[i]});
  }
  expect_error([&] { prefix.acquire(ints(prompt), 0, -2); }, {fn("acquire"), "argument 'max_tokens'", ">= -1", "-2"});
  expect_error([&] { prefix.peek(ints(prompt), 0, -5); }, {fn("peek"), "argument 'max_tokens'", "-5"});
  expect_error([&] { prefix.insert(a.first, ints(iota_tokens(7))); },
               {fn("insert"), "argument 'tokens'", "at least length(seq) = 8", "got 7"});
  expect_error([&] { prefix.insert(99, ints(prompt)); }, {fn("insert"), "argument 'seq'", "99"});
  expect_error([&] { prefix.insert(released, ints(prompt)); }, {fn("insert"), "argument 'seq'", "released"});
  expect_error([&] { prefix.insert(b.first, ints(iota_tokens(5, 60))); },
               {fn("insert"), "argument 'seq'", "swapped out"});
  auto wrong = prompt;
  wrong[4] = 77;  // a's page 1 is cached with 4, 5, 6
  expect_error([&] { prefix.insert(a.first, ints(wrong)); }, {fn("insert"), "argument 'tokens'", "page 1 of sequence"});
  expect_error([&] { prefix.evict(-1); }, {fn("evict"), "argument 'n_pages'", ">= 0", "-1"});
  expect_error([&] { PrefixCache<NHD> second(table); },
               {"pagedkv::PrefixCache<NHD>", "argument 'seqs'", "already has one"});

  snapshot.expect_same(cache, "bad input");
  EXPECT_TRUE(same_stats(prefix.stats(), before));
  EXPECT_EQ(prefix.n_cached(), cached);
  prefix.check();
}

TEST(PrefixCache, AcquireAtTheRefCountLimitChangesNothing) {
  auto cache = make_cache(8);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const auto a = serve(prefix, table, iota_tokens(7));
  const int64_t page1 = table.pages(a.first)[1];
  // Page 1's ref_count at the int32 limit (set directly, then restored).
  int32_t& ref = pagedkv::PagePoolTestAccess::refs(cache.pool())[static_cast<size_t>(page1)];
  const int32_t saved = ref;
  ref = std::numeric_limits<int32_t>::max();
  const PrefixStats before = prefix.stats();
  const int64_t size = table.size();
  const CacheSnapshot snapshot(cache);
  expect_error([&] { prefix.acquire(ints(iota_tokens(7))); }, {"retain_all", "at the limit"});
  snapshot.expect_same(cache, "acquire at the limit");
  EXPECT_EQ(table.size(), size);
  EXPECT_TRUE(same_stats(prefix.stats(), before));
  ref = saved;
  prefix.check();
}

TEST(PrefixCache, CheckFindsAReferenceTakenBehindItsBack) {
  auto cache = make_cache(8);
  SequenceTable<NHD> table(cache);
  PrefixCache<NHD> prefix(table);
  const auto a = serve(prefix, table, iota_tokens(4));  // page 0 cached, page 1 (one token) not
  ASSERT_EQ(table.pages(a.first), (std::vector<int64_t>{0, 1}));
  cache.pool().retain(1);  // a reference nobody accounts for: a leak
  expect_error([&] { prefix.check(); }, {"pagedkv::PrefixCache<NHD>::check", "page 1", "a leak or a miscount"});
  cache.pool().free(1);
  table.release(a.first);
  cache.pool().retain(0);  // the cached page is held now, but nothing told the cache
  expect_error([&] { prefix.check(); }, {"pagedkv::PrefixCache<NHD>::check", "page 0", "not held"});
  cache.pool().free(0);
  prefix.check();
}

// ---- property test: random calls against a model ----

/// The model: (salt, token prefix ending at a page boundary) -> page, with a
/// use tick per entry; evictions free the least recently used entry that no
/// sequence holds and no entry continues, repeatedly.
struct Model {
  struct Entry {
    int64_t page;
    int64_t tick;
  };
  std::map<std::pair<uint64_t, std::vector<int64_t>>, Entry> cached;
  int64_t tick = 0;

  static std::vector<int64_t> prefix(const std::vector<int64_t>& t, int64_t n) { return {t.begin(), t.begin() + n}; }

  /// Matched pages of `tokens` (first n_pages at most), each touched if `use`.
  std::vector<int64_t> match(const std::vector<int64_t>& tokens, int64_t n_pages, uint64_t salt, bool use) {
    std::vector<int64_t> pages;
    for (int64_t j = 0; j < n_pages; ++j) {
      auto it = cached.find({salt, prefix(tokens, (j + 1) * kPage)});
      if (it == cached.end()) break;
      pages.push_back(it->second.page);
    }
    if (use) touch(tokens, static_cast<int64_t>(pages.size()), salt);
    return pages;
  }
  void touch(const std::vector<int64_t>& tokens, int64_t n_pages, uint64_t salt) {
    for (int64_t j = n_pages - 1; j >= 0; --j) cached[{salt, prefix(tokens, (j + 1) * kPage)}].tick = ++tick;
  }
  int64_t insert(const std::vector<int64_t>& tokens, const std::vector<int64_t>& pages, int64_t n_pages,
                 uint64_t salt) {
    int64_t fresh = 0;
    for (int64_t j = 0; j < n_pages; ++j) {
      const auto key = std::make_pair(salt, prefix(tokens, (j + 1) * kPage));
      if (cached.count(key) == 0) {
        cached[key] = Entry{pages[static_cast<size_t>(j)], 0};
        ++fresh;
      }
    }
    touch(tokens, n_pages, salt);
    return fresh;
  }
  bool continued(const std::pair<uint64_t, std::vector<int64_t>>& key) const {
    for (const auto& e : cached)
      if (e.first.first == key.first && e.first.second.size() == key.second.size() + kPage &&
          std::equal(key.second.begin(), key.second.end(), e.first.second.begin()))
        return true;
    return false;
  }
  /// Evicts up to n entries; returns their pages in order.
  template <class Pool>
  std::vector<int64_t> evict(int64_t n, const Pool& pool) {
    std::vector<int64_t> freed;
    while (static_cast<int64_t>(freed.size()) < n) {
      auto best = cached.end();
      for (auto it = cached.begin(); it != cached.end(); ++it) {
        if (pool.ref_count(it->second.page) != 1) continue;
        if (continued(it->first)) continue;
        if (best == cached.end() || it->second.tick < best->second.tick) best = it;
      }
      if (best == cached.end()) break;
      freed.push_back(best->second.page);
      cached.erase(best);
    }
    return freed;
  }
};

TEST(PrefixCacheProperty, RandomCallsMatchTheModelAndKeepEveryTokenBitExact) {
  PrefixStats total{};  // so that the test proves it exercised hits and evictions
  int64_t table_evictions = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    std::mt19937 rng(seed);
    auto cache = make_cache(20);
    auto host_cache = make_cache<HND>(12);
    SequenceTable<NHD> table(cache);
    SequenceTable<HND> host(host_cache);
    PrefixCache<NHD> prefix(table);
    if (seed % 3 == 0) {
      pagedkv::PrefixCacheTestAccess::set_page_hash(prefix,
                                                    [](uint64_t, const int64_t*, int64_t) -> uint64_t { return 7; });
    }
    Model model;
    std::map<int64_t, std::vector<int64_t>> tokens;  // every live sequence of ours
    std::map<int64_t, uint64_t> salt_of;
    const std::vector<std::vector<int64_t>> stems = {{1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 2, 3, 9, 9, 9}, {5, 5, 5, 5}};
    auto pick = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint32_t>(n)); };
    auto random_seq = [&]() {
      auto it = tokens.begin();
      std::advance(it, pick(static_cast<int64_t>(tokens.size())));
      return it->first;
    };
    // The model follows evictions the table's allocations made (counted by the stats).
    int64_t evicted_seen = 0;
    auto follow_evictions = [&](const std::string& what) {
      const int64_t evicted = prefix.stats().evicted_pages;
      if (evicted == evicted_seen) return;
      // The pages were evicted already (and may be reallocated): the model
      // sees them as only the cache's.
      struct FreedPool {
        const PagedCache<NHD>* c;
        int64_t ref_count(int64_t p) const { return c->ref_count(p) == 0 ? 1 : c->ref_count(p); }
      } view{&cache};
      const auto freed = model.evict(evicted - evicted_seen, view);
      table_evictions += evicted - evicted_seen;
      EXPECT_EQ(static_cast<int64_t>(freed.size()), evicted - evicted_seen) << what;
      evicted_seen = evicted;
    };
    for (int step = 0; step < 300; ++step) {
      const std::string what = "seed " + std::to_string(seed) + " step " + std::to_string(step);
      const int op = static_cast<int>(pick(10));
      if (op <= 2 || tokens.empty()) {  // a request
        auto prompt = stems[static_cast<size_t>(pick(3))];
        prompt.resize(static_cast<size_t>(pick(static_cast<int64_t>(prompt.size())) + 1));
        for (int64_t k = pick(5); k > 0; --k) prompt.push_back(pick(4));
        const uint64_t salt = static_cast<uint64_t>(pick(2));
        const int64_t max_tokens = pick(4) == 0 ? pick(static_cast<int64_t>(prompt.size()) + 2) : -1;
        const int64_t cap = max_tokens == -1 ? static_cast<int64_t>(prompt.size()) - 1
                                             : std::min<int64_t>(max_tokens, static_cast<int64_t>(prompt.size()));
        const auto want = model.match(prompt, cap / kPage, salt, true);
        EXPECT_EQ(prefix.peek(ints(prompt), salt, max_tokens), static_cast<int64_t>(want.size()) * kPage) << what;
        const auto hit = prefix.acquire(ints(prompt, pick(2) == 0 ? at::kInt : at::kLong), salt, max_tokens);
        ASSERT_EQ(hit.second, static_cast<int64_t>(want.size()) * kPage) << what;
        EXPECT_EQ(table.pages(hit.first), want) << what;
        tokens[hit.first] = std::vector<int64_t>(prompt.begin(), prompt.begin() + hit.second);
        salt_of[hit.first] = salt;
        const int64_t n = static_cast<int64_t>(prompt.size());
        const int64_t free_before = cache.n_free() + prefix.n_reclaimable();
        if (table.prepare_append(hit.first, n - hit.second)) {
          follow_evictions(what);
          const auto ids = std::vector<int64_t>(prompt.begin() + hit.second, prompt.end());
          const auto pt_len = table.batch({hit.first});
          for (int64_t layer = 0; layer < kLayers; ++layer)
            cache.write(layer, pt_len.first, hit.second, kv_of(ids, hit.second, layer, false).unsqueeze(0),
                        kv_of(ids, hit.second, layer, true).unsqueeze(0));
          table.commit_append(hit.first, n - hit.second);
          tokens[hit.first] = prompt;
          if (pick(4) != 0) {
            const int64_t fresh = prefix.insert(hit.first, ints(prompt), salt);
            EXPECT_EQ(fresh, model.insert(prompt, table.pages(hit.first), n / kPage, salt)) << what;
          }
        } else {
          EXPECT_LT(free_before, n - hit.second) << what << ": false although free + reclaimable pages sufficed";
        }
      } else if (op == 3) {  // append to a sequence, maybe register it
        const int64_t s = random_seq();
        if (table.swapped(s)) continue;
        std::vector<int64_t> more;
        for (int64_t k = pick(4) + 1; k > 0; --k) more.push_back(pick(4));
        if (table.prepare_append(s, static_cast<int64_t>(more.size()))) {
          follow_evictions(what);
          auto all = tokens[s];
          all.insert(all.end(), more.begin(), more.end());
          extend(table, s, all, static_cast<int64_t>(all.size()));
          tokens[s] = all;
          if (pick(2) == 0) {
            const int64_t fresh = prefix.insert(s, ints(all), salt_of[s]);
            EXPECT_EQ(fresh, model.insert(all, table.pages(s), static_cast<int64_t>(all.size()) / kPage, salt_of[s]))
                << what;
          }
        }
      } else if (op == 4) {  // fork
        const int64_t s = random_seq();
        if (table.swapped(s)) continue;
        const int64_t child = table.fork(s);
        tokens[child] = tokens[s];
        salt_of[child] = salt_of[s];
      } else if (op <= 6) {  // release
        const int64_t s = random_seq();
        table.release(s);
        tokens.erase(s);
      } else if (op == 7) {  // evict
        const int64_t n = pick(4);
        const auto want = model.evict(n, cache);
        EXPECT_EQ(prefix.evict(n), static_cast<int64_t>(want.size())) << what;
        for (int64_t p : want) EXPECT_EQ(cache.ref_count(p), 0) << what << ": page " << p;
        evicted_seen = prefix.stats().evicted_pages;
      } else if (op == 8) {  // swap out or in
        const int64_t s = random_seq();
        if (table.swapped(s)) {
          if (table.swap_in(s, host)) follow_evictions(what);
        } else {
          table.swap_out(s, host);
        }
      } else {  // clear now and then
        if (pick(5) == 0) {
          model.evict(1 << 20, cache);
          prefix.clear();
          EXPECT_EQ(prefix.n_evictable(), 0) << what;
          EXPECT_EQ(prefix.n_reclaimable(), 0) << what;
          evicted_seen = prefix.stats().evicted_pages;
        }
      }
      ASSERT_NO_THROW(prefix.check()) << what;
      ASSERT_EQ(prefix.n_cached(), static_cast<int64_t>(model.cached.size())) << what;
      for (const auto& e : model.cached) {
        auto probe = e.first.second;
        ASSERT_EQ(prefix.peek(ints(probe), e.first.first, static_cast<int64_t>(probe.size())),
                  static_cast<int64_t>(probe.size()))
            << what << ": a model entry the cache lost";
      }
      for (const auto& t : tokens) {
        if (!table.swapped(t.first)) expect_tokens(table, t.first, t.second, what);
      }
      if (HasFatalFailure()) return;
    }
    total.hit_tokens += prefix.stats().hit_tokens;
    total.inserted_pages += prefix.stats().inserted_pages;
    total.evicted_pages += prefix.stats().evicted_pages;
  }
  EXPECT_GT(total.hit_tokens, 100);
  EXPECT_GT(total.inserted_pages, 50);
  EXPECT_GT(total.evicted_pages, table_evictions);
  EXPECT_GT(table_evictions, 10) << "allocations of the attached table evicted";
}

}  // namespace
