// PrefixCache<Layout>: automatic prefix caching over a SequenceTable. A new
// request reuses the pages of every full page of its prompt that an earlier
// request already computed (a shared system prompt, earlier chat turns).
//
// Semantics (docs/sequences.md, "Prefix caching")
// - A cached page is a node of a tree: its parent is the cached page that
//   holds the tokens just before it (none for a prompt's first page), its
//   key is (parent, salt, its page_size tokens). A chained 64-bit hash of
//   (salt, parent's hash, tokens) only picks candidates: the parent, salt
//   and tokens of a candidate are always compared, so a hash collision can
//   never hand one prompt another's pages, and different salts never share.
// - Only full pages are cached or matched. max_tokens caps a match; -1 means
//   tokens.size(0) - 1 (the last prompt token is recomputed for its logits).
// - The cache holds one pool reference of its own on each cached page, so
//   PagePool is unchanged and ids stay lowest-first.
// - Evictable: the cache's reference is the page's only one and no cached
//   page continues it (a leaf). evict(n) frees up to n of them, least
//   recently used first; freeing a leaf may make its parent evictable.
//   Reclaimable (what the attached table may take): cached pages that
//   repeated eviction can free, i.e. no sequence holds them nor any cached
//   page after them.
// - Use order: acquire (matched pages) and insert (every page of the chain,
//   registered or already cached) mark pages used, the first page of a
//   prompt as the most recent. So a page is always more recently used than
//   every cached page that continues it, and the LRU list is also a
//   leaves-first order: one walk from its oldest end evicts in LRU order and
//   meets each parent after its children.
// - While attached, the table tells the cache when it drops a reference on a
//   page (page_reclaimer.hpp), so n_evictable() and n_reclaimable() are
//   counters, exact at all times, and eviction never scans the pool.
// - Failure: bad input throws c10::Error naming the function, the argument,
//   what was expected and what was given; nothing changes, stats included.
// - Only over a table without a window: a windowed table frees the early
//   pages a match shares (the constructor throws naming the window).
// - Lifetime: attaches to the table in the constructor (a table has at most
//   one prefix cache), detaches and drops its references in the destructor;
//   must not outlive the table. Not copyable or movable. Not thread-safe.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_reclaimer.hpp"
#include "pagedkv/page_store.hpp"
#include "pagedkv/prefix_hash.hpp"
#include "pagedkv/sequences.hpp"

namespace pagedkv {

/// One tier's counts (PrefixStats::tiers).
struct PrefixTierStats {
  std::string tier;      // PageStore::tier()
  int64_t hit_tokens;    // tokens acquire loaded from this tier (included in PrefixStats::hit_tokens)
  int64_t loaded_pages;  // pages acquire loaded from this tier
  int64_t stored_pages;  // pages this tier took: evicted from the device, or pushed out of the tier above
};

struct PrefixStats {
  int64_t lookups;         // acquire calls that succeeded
  int64_t query_tokens;    // tokens offered to those calls (after the max_tokens cap)
  int64_t hit_tokens;      // tokens they got from the cache (the device and every tier)
  int64_t inserted_pages;  // pages newly registered by insert
  int64_t evicted_pages;   // cached pages freed by eviction
  std::vector<PrefixTierStats> tiers;  // one per tier, fastest first; the device's hits are hit_tokens less theirs
};

/// A change of what a tier holds, for routers that place requests where
/// their prefix is (set_event_listener).
struct PrefixEvent {
  enum class Type {
    stored,   // the tier now holds the page
    removed,  // the tier no longer holds the page
    cleared,  // the tier holds no page at all (after clear() emptied the device)
  };
  Type type;
  uint64_t hash;         // the page's chained hash (prefix_hash: salt seed, then every page's tokens); 0 for cleared
  uint64_t parent_hash;  // the previous page's chained hash; 0 for a prompt's first page and for cleared
  int64_t n_tokens;      // tokens from position 0 to the page's end; 0 for cleared
  std::string tier;      // "device", or the store's PageStore::tier(): "host", "disk", "remote"
};

/// The hash that picks a page's candidates: seed (the salt's seed for a
/// prompt's first page, else the parent's hash) and the page's tokens [n_tokens].
using PrefixPageHash = uint64_t (*)(uint64_t seed, const int64_t* tokens, int64_t n_tokens);

template <class Layout = NHD>
class PrefixCache final : private PageReclaimer {
 public:
  explicit PrefixCache(SequenceTable<Layout>& seqs) : PrefixCache(seqs, std::vector<std::shared_ptr<PageStore>>{}) {}

  /// With tiers below the pool, fastest first (page_store.hpp): evicted
  /// pages go down to tiers[0], and acquire continues a device match
  /// through them. The stores may be shared with other caches.
  PrefixCache(SequenceTable<Layout>& seqs, std::vector<std::shared_ptr<PageStore>> tiers)
      : seqs_(&seqs),
        page_size_(seqs.cache().page_size()),
        node_of_page_(static_cast<size_t>(seqs.cache().n_pages()), kNone),
        tiers_(checked_tiers(std::move(tiers))),
        geometry_(page_store::Geometry::of(seqs.cache())) {
    for (const auto& t : tiers_) stats_.tiers.push_back(PrefixTierStats{t->tier(), 0, 0, 0});
    checks::unwindowed_table(checks::Caller{"PrefixCache", Layout::name, nullptr}, seqs.window());
    TORCH_CHECK(seqs.reclaimer_ == nullptr, "pagedkv::PrefixCache<", Layout::name,
                ">: argument 'seqs' expected a table without a prefix cache, got one that already has one");
    grow_index(16);
    seqs.reclaimer_ = this;
  }

  ~PrefixCache() {
    PagePool& pool = this->pool();
    for (const Node& x : nodes_) {
      // The cache's own reference; sequences keep theirs (a page freed
      // behind the cache's back is skipped: a destructor must not throw).
      if (x.live && pool.is_allocated(x.page)) pool.free(x.page);
    }
    seqs_->reclaimer_ = nullptr;
  }

  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  /// Tokens a match would give now (a multiple of page_size); changes nothing.
  int64_t peek(const at::Tensor& tokens, uint64_t salt = 0, int64_t max_tokens = -1) const {
    const checks::Caller caller{"PrefixCache", Layout::name, "peek"};
    const at::Tensor ids = token_ids(caller, tokens);
    const int64_t cap = capped(caller, ids, max_tokens);
    return match(ids.data_ptr<int64_t>(), cap / page_size_, salt, nullptr) * page_size_;
  }

  /// A new sequence in the table sharing the pages of the longest cached
  /// prefix of `tokens` (each ref_count + 1), with length = the matched
  /// tokens: {seq, matched_tokens}. A miss gives an empty sequence.
  std::pair<int64_t, int64_t> acquire(const at::Tensor& tokens, uint64_t salt = 0, int64_t max_tokens = -1) {
    const checks::Caller caller{"PrefixCache", Layout::name, "acquire"};
    const at::Tensor ids = token_ids(caller, tokens);
    const int64_t cap = capped(caller, ids, max_tokens);
    const int64_t* data = ids.data_ptr<int64_t>();
    const int64_t cap_pages = cap / page_size_;
    std::vector<int32_t> chain;
    const int64_t n_device = match(data, cap_pages, salt, &chain);
    std::vector<int64_t> pages(static_cast<size_t>(n_device));
    for (size_t j = 0; j < chain.size(); ++j) pages[j] = nodes_[static_cast<size_t>(chain[j])].page;
    PagePool& pool = this->pool();
    // Room for every page the tiers could add, so that nothing below throws
    // but the ref_count limit (std::bad_alloc here: nothing changed yet).
    const int64_t n_more = tiers_.empty() ? 0 : std::min(cap_pages - n_device, pool.n_pages());
    reserve_nodes(n_more);
    pages.reserve(pages.size() + static_cast<size_t>(n_more));
    chain.reserve(chain.size() + static_cast<size_t>(n_more));
    pool.retain_all(pages);  // all or nothing (throws at the ref_count limit)
    // Held, the device match cannot be evicted to make room for the loaded pages.
    for (const int32_t x : chain) set_held(x, true);
    if (n_more > 0) load_from_tiers(data, cap_pages, salt, chain, pages);
    int64_t seq = -1;
    try {
      seq = seqs_->adopt(pages, static_cast<int64_t>(pages.size()) * page_size_);
    } catch (...) {
      // Loaded pages stay cached (valid K/V); the sequence's references go.
      pool.free_all(pages);
      for (const int32_t x : chain) {
        if (pool.ref_count(nodes_[static_cast<size_t>(x)].page) == 1) set_held(x, false);
      }
      throw;
    }
    // From here on nothing throws.
    const int64_t n_matched = static_cast<int64_t>(pages.size());
    touch(chain);
    ++stats_.lookups;
    stats_.query_tokens += cap;
    stats_.hit_tokens += n_matched * page_size_;
    return {seq, n_matched * page_size_};
  }

  /// Calls `listener` on every change of what the device or a tier holds
  /// (PrefixEvent), synchronously, from the call that makes it (which may
  /// be in the middle of its work: the listener must not call the cache);
  /// an empty function stops the events. A listener that throws is warned
  /// about and ignored.
  void set_event_listener(std::function<void(const PrefixEvent&)> listener) { listener_ = std::move(listener); }

  /// The tiers, fastest first.
  const std::vector<std::shared_ptr<PageStore>>& tiers() const noexcept { return tiers_; }

  /// Registers the full pages sequence `seq` has written (pages before
  /// length(seq) / page_size) under `tokens` (at least length(seq) of them)
  /// and `salt`; a page whose prefix is already cached, by this page or
  /// another, is not registered again. Returns the pages newly cached.
  int64_t insert(int64_t seq, const at::Tensor& tokens, uint64_t salt = 0) {
    const checks::Caller caller{"PrefixCache", Layout::name, "insert"};
    const auto& s = seqs_->owned(caller, seq);
    const at::Tensor ids = token_ids(caller, tokens);
    TORCH_CHECK(ids.size(0) >= s.length, caller, ": argument 'tokens' expected at least length(seq) = ", s.length,
                " tokens (sequence ", seq, "), got ", ids.size(0));
    const int64_t n = s.length / page_size_;
    const std::vector<int64_t> held(s.pages.begin(), s.pages.begin() + static_cast<std::ptrdiff_t>(n));
    seqs_->pages_held(caller, seq, held, pool());
    const int64_t* data = ids.data_ptr<int64_t>();

    // Plan: the cached node at each position, or kNone for a page to register.
    std::vector<int32_t> chain(static_cast<size_t>(n), kNone);
    std::vector<uint64_t> hashes(static_cast<size_t>(n));
    std::vector<int64_t> fresh;  // pages to register, in position order
    int32_t prev = kNone;
    uint64_t seed = prefix_hash::salt_seed(salt);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t* page_tokens = data + j * page_size_;
      const uint64_t h = hash_(seed, page_tokens, page_size_);
      const int32_t found = (j == 0 || prev != kNone) ? find(h, prev, salt, page_tokens) : kNone;
      const int64_t page = held[static_cast<size_t>(j)];
      const int32_t cached_as = node_of_page_[static_cast<size_t>(page)];
      TORCH_CHECK(cached_as == kNone || cached_as == found, caller,
                  ": argument 'tokens' expected the tokens and salt that page ", page, " (page ", j, " of sequence ",
                  seq, ") is cached with, got tokens[0:", (j + 1) * page_size_,
                  "] or a salt that differ from them (the sequence shares that cached page)");
      if (found == kNone) fresh.push_back(page);
      chain[static_cast<size_t>(j)] = found;
      hashes[static_cast<size_t>(j)] = h;
      prev = found;
      seed = h;
    }
    const int64_t n_fresh = static_cast<int64_t>(fresh.size());
    reserve_nodes(n_fresh);    // may throw std::bad_alloc: nothing changed yet
    pool().retain_all(fresh);  // the cache's references; all or nothing
    // From here on nothing throws (capacity is reserved).
    for (int64_t j = 0; j < n; ++j) {
      // The index slots are random accesses into a table of megabytes: ask
      // for the one kPrefetch pages ahead while this one is registered.
      if (j + kPrefetch < n) prefetch_slot(hashes[static_cast<size_t>(j + kPrefetch)]);
      int32_t& x = chain[static_cast<size_t>(j)];
      if (x != kNone) continue;
      x = add_node(held[static_cast<size_t>(j)], j == 0 ? kNone : chain[static_cast<size_t>(j - 1)], salt,
                   hashes[static_cast<size_t>(j)], data + j * page_size_);
      if (listener_) emit(PrefixEvent::Type::stored, x, kDevice);
    }
    touch(chain);
    stats_.inserted_pages += n_fresh;
    return n_fresh;
  }

  /// Frees up to n_pages evictable pages, least recently used first;
  /// returns how many it freed.
  int64_t evict(int64_t n_pages) {
    checks::non_negative(checks::Caller{"PrefixCache", Layout::name, "evict"}, "n_pages", n_pages);
    return evict_lru(n_pages);
  }

  /// Frees every evictable page, repeatedly, until none is left (each goes
  /// down to the tiers as any evicted page does).
  void clear() {
    evict_lru(std::numeric_limits<int64_t>::max());
    if (n_live_ == 0 && listener_) notify(PrefixEvent{PrefixEvent::Type::cleared, 0, 0, 0, kDevice});
  }

  /// Before the process ends (or the tiers are handed to another engine):
  /// evicts every evictable page, as clear() does, then moves every entry
  /// of a tier whose memory dies with the process (PageStore::drain: host
  /// memory) down to the next tier, so that a later process, or another
  /// engine on the same disk or server, finds them. The last tier keeps
  /// its entries. Returns the entries moved from one tier to the next.
  int64_t persist() {
    clear();
    int64_t moved = 0;
    for (size_t t = 0; t + 1 < tiers_.size(); ++t) {
      std::vector<StoredPage> drained;
      try {
        drained = tiers_[t]->drain();
      } catch (const std::exception& ex) {
        warn("tier '", stats_.tiers[t].tier, "' threw on drain (", ex.what(), "): its entries stay there");
        continue;
      }
      for (StoredPage& page : drained) {
        if (listener_) emit_entry(PrefixEvent::Type::removed, page.entry, t);
        put_down(t + 1, std::move(page));
        ++moved;
      }
    }
    return moved;
  }

  /// Pages the cache holds a reference on.
  int64_t n_cached() const noexcept { return n_live_; }
  /// Cached pages nothing else references and no cached page continues.
  int64_t n_evictable() const noexcept { return n_evictable_; }
  /// Cached pages repeated eviction can free now (>= n_evictable()): what the attached table may take.
  int64_t n_reclaimable() const noexcept override { return n_reclaimable_; }

  PrefixStats stats() const { return stats_; }
  void reset_stats() noexcept {
    std::vector<PrefixTierStats> tiers = std::move(stats_.tiers);
    for (PrefixTierStats& t : tiers) t.hit_tokens = t.loaded_pages = t.stored_pages = 0;
    stats_ = PrefixStats{};
    stats_.tiers = std::move(tiers);
  }

  /// Audits the whole structure against the pool and the table with full
  /// scans (for tests and debugging): every cached page is allocated and
  /// mapped to its node; the tree's parent links, child counts and keys; the
  /// hash index finds every node by its recomputed hash; the LRU list holds
  /// every node once, each parent more recent than its children; the held /
  /// evictable / reclaimable flags and counters; and every page's ref_count
  /// equals the references the table's sequences and the cache hold on it
  /// (so n_free + cached pages no sequence holds + pages sequences hold =
  /// n_pages: nothing leaked). Assumes every page of the pool is held through
  /// the table or this cache. Throws c10::Error naming the first violation.
  void check() const {
    const char* const where = Layout::name;
    const PagePool& pool = this->pool();
    pool.check();
    const auto fail = [&](auto&&... parts) {
      TORCH_CHECK(false, "pagedkv::PrefixCache<", where, ">::check: ", parts...);
    };
    std::vector<int64_t> refs(static_cast<size_t>(pool.n_pages()), 0);  // expected ref_counts
    for (const auto& s : seqs_->seqs_) {
      if (!s.live || s.swapped) continue;
      for (const int64_t page : s.pages) {
        // -1: a column a windowed table released (a host-side copy of one of its sequences).
        if (page != kUnmappedPage) ++refs[static_cast<size_t>(page)];
      }
    }
    std::vector<int32_t> children(nodes_.size(), 0);
    std::vector<int32_t> blocking(nodes_.size(), 0);
    int64_t live = 0;
    int64_t evictable = 0;
    int64_t reclaimable = 0;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const Node& x = nodes_[i];
      if (!x.live) continue;
      ++live;
      if (!pool.is_allocated(x.page)) fail("node ", i, " caches page ", x.page, " which is free");
      if (node_of_page_[static_cast<size_t>(x.page)] != static_cast<int32_t>(i))
        fail("node ", i, " caches page ", x.page, " but the page maps to node ",
             node_of_page_[static_cast<size_t>(x.page)]);
      ++refs[static_cast<size_t>(x.page)];
      if (x.parent != kNone) {
        if (x.parent < 0 || static_cast<size_t>(x.parent) >= nodes_.size() ||
            !nodes_[static_cast<size_t>(x.parent)].live)
          fail("node ", i, " has parent ", x.parent, " which is not a cached node");
        if (nodes_[static_cast<size_t>(x.parent)].salt != x.salt)
          fail("node ", i, " has salt ", x.salt, " but its parent has salt ", nodes_[static_cast<size_t>(x.parent)].salt);
        ++children[static_cast<size_t>(x.parent)];
        if (!x.reclaimable) ++blocking[static_cast<size_t>(x.parent)];
      }
      const uint64_t seed = x.parent == kNone ? prefix_hash::salt_seed(x.salt) : nodes_[static_cast<size_t>(x.parent)].hash;
      if (hash_(seed, tokens_of(static_cast<int32_t>(i)), page_size_) != x.hash)
        fail("node ", i, " (page ", x.page, ") has a stale hash");
      if (find(x.hash, x.parent, x.salt, tokens_of(static_cast<int32_t>(i))) != static_cast<int32_t>(i))
        fail("node ", i, " (page ", x.page, ") is not the one the index finds for its key (missing or duplicated)");
      const bool held = pool.ref_count(x.page) > 1;
      if (x.held != held) fail("node ", i, " (page ", x.page, ") is marked ", x.held ? "held" : "not held",
                               " but has ref_count ", pool.ref_count(x.page));
      evictable += x.evictable ? 1 : 0;
      reclaimable += x.reclaimable ? 1 : 0;
    }
    if (live != n_live_) fail(live, " live nodes, but n_cached() is ", n_live_);
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const Node& x = nodes_[i];
      if (!x.live) continue;
      if (x.n_children != children[i]) fail("node ", i, " counts ", x.n_children, " children, has ", children[i]);
      if (x.n_blocking != blocking[i])
        fail("node ", i, " counts ", x.n_blocking, " unreclaimable children, has ", blocking[i]);
      const bool reclaimable_now = !x.held && blocking[i] == 0;
      if (x.reclaimable != reclaimable_now) fail("node ", i, " (page ", x.page, ") has a wrong reclaimable flag");
      if (x.evictable != (reclaimable_now && children[i] == 0))
        fail("node ", i, " (page ", x.page, ") has a wrong evictable flag");
    }
    if (evictable != n_evictable_) fail(evictable, " evictable nodes, but n_evictable() is ", n_evictable_);
    if (reclaimable != n_reclaimable_) fail(reclaimable, " reclaimable nodes, but n_reclaimable() is ", n_reclaimable_);
    int64_t index_entries = 0;
    for (const Slot& slot : slots_) index_entries += slot.node != kNone ? 1 : 0;
    if (index_entries != n_live_) fail("the index has ", index_entries, " entries for ", n_live_, " nodes");
    // LRU list: every node once, consistent links, each node older than its parent.
    std::vector<int64_t> rank(nodes_.size(), -1);
    int64_t r = 0;
    int32_t before = kNone;
    for (int32_t x = oldest_; x != kNone; x = nodes_[static_cast<size_t>(x)].newer) {
      if (x < 0 || static_cast<size_t>(x) >= nodes_.size() || !nodes_[static_cast<size_t>(x)].live ||
          rank[static_cast<size_t>(x)] != -1 || r >= n_live_)
        fail("the LRU list is broken at node ", x);
      if (nodes_[static_cast<size_t>(x)].older != before) fail("the LRU list's back link of node ", x, " is wrong");
      rank[static_cast<size_t>(x)] = r++;
      before = x;
    }
    if (before != newest_ || r != n_live_) fail("the LRU list holds ", r, " of ", n_live_, " nodes");
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const Node& x = nodes_[i];
      if (x.live && x.parent != kNone && rank[static_cast<size_t>(x.parent)] < rank[i])
        fail("node ", i, " is more recently used than its parent ", x.parent);
    }
    for (int64_t page = 0; page < pool.n_pages(); ++page) {
      const int32_t x = node_of_page_[static_cast<size_t>(page)];
      if (x != kNone && (static_cast<size_t>(x) >= nodes_.size() || !nodes_[static_cast<size_t>(x)].live ||
                         nodes_[static_cast<size_t>(x)].page != page))
        fail("page ", page, " maps to node ", x, " which does not cache it");
      if (pool.ref_count(page) != refs[static_cast<size_t>(page)])
        fail("page ", page, " has ref_count ", pool.ref_count(page), " but the table's sequences and the cache hold ",
             refs[static_cast<size_t>(page)], " references on it (a leak or a miscount)");
    }
  }

 private:
  friend struct PrefixCacheTestAccess;  // tests inject a constant hash to prove tokens are compared

  static constexpr int32_t kNone = -1;
  static constexpr int kPrefetch = 8;  // pages ahead: hides a slot's miss (bench/NOTES.md, "PrefixCache (issue 10)")

  struct Node {
    uint64_t hash = 0;
    uint64_t store_key = 0;  // PageKey::hash in the tiers (computed only when there are tiers)
    uint64_t salt = 0;
    int64_t page = -1;
    int32_t parent = kNone;   // the cached page before this one; kNone for a prompt's first page
    int32_t n_children = 0;   // cached pages that continue this one
    int32_t n_blocking = 0;   // of those, the ones not reclaimable
    int32_t older = kNone;    // LRU list links
    int32_t newer = kNone;
    int32_t depth = 0;        // pages from the prompt's first to this one, both included
    bool live = false;
    bool held = false;         // ref_count > 1: a sequence holds the page too
    bool reclaimable = false;  // !held and every child reclaimable
    bool evictable = false;    // reclaimable and no children
  };

  struct Slot {  // open-addressing index entry: linear probing, backward-shift deletion
    uint64_t hash;
    int32_t node;  // kNone: empty
  };

  PagePool& pool() const noexcept { return seqs_->cache().pool(); }

  /// tokens as contiguous int64 (a view when they already are).
  static at::Tensor token_ids(const checks::Caller& caller, const at::Tensor& tokens) {
    checks::token_ids(caller, tokens);
    return tokens.to(at::kLong).contiguous();
  }

  /// The tokens a match may use: max_tokens (>= -1) capped at the prompt.
  static int64_t capped(const checks::Caller& caller, const at::Tensor& ids, int64_t max_tokens) {
    TORCH_CHECK(max_tokens >= -1, caller,
                ": argument 'max_tokens' expected >= -1 (-1: all but the last token), got ", max_tokens);
    const int64_t n = ids.size(0);
    return max_tokens == -1 ? std::max<int64_t>(n - 1, 0) : std::min(max_tokens, n);
  }

  const int64_t* tokens_of(int32_t x) const noexcept { return tokens_.data() + static_cast<size_t>(x) * page_size_; }

  /// The cached node with key (parent, salt, tokens [page_size]) and hash h, or kNone.
  int32_t find(uint64_t h, int32_t parent, uint64_t salt, const int64_t* tokens) const noexcept {
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.node == kNone) return kNone;
      if (slot.hash != h) continue;
      const Node& x = nodes_[static_cast<size_t>(slot.node)];
      if (x.parent == parent && x.salt == salt &&
          std::memcmp(tokens_of(slot.node), tokens, static_cast<size_t>(page_size_) * sizeof(int64_t)) == 0)
        return slot.node;
    }
  }

  /// Matches the first n_pages full pages of `tokens`; returns how many
  /// match and, when `chain` is given, their nodes in order.
  int64_t match(const int64_t* tokens, int64_t n_pages, uint64_t salt, std::vector<int32_t>* chain) const {
    int32_t prev = kNone;
    uint64_t seed = prefix_hash::salt_seed(salt);
    int64_t j = 0;
    for (; j < n_pages; ++j) {
      const int64_t* page_tokens = tokens + j * page_size_;
      const uint64_t h = hash_(seed, page_tokens, page_size_);
      const int32_t x = find(h, prev, salt, page_tokens);
      if (x == kNone) break;
      if (chain != nullptr) chain->push_back(x);
      prev = x;
      seed = h;
    }
    return j;
  }

  /// Room for n_more nodes and their index entries, so that add_node cannot throw.
  void reserve_nodes(int64_t n_more) {
    const size_t extra = static_cast<size_t>(std::max<int64_t>(0, n_more - static_cast<int64_t>(free_nodes_.size())));
    const size_t n_nodes = nodes_.size() + extra;
    if (n_nodes > nodes_.capacity()) {
      const size_t cap = std::max(n_nodes, 2 * nodes_.capacity());
      nodes_.reserve(cap);
      tokens_.reserve(cap * static_cast<size_t>(page_size_));
      free_nodes_.reserve(cap);
    }
    grow_index(static_cast<size_t>(n_live_ + n_more));
  }

  /// An index with at most half its slots used once it holds n_entries.
  void grow_index(size_t n_entries) {
    if (2 * n_entries <= slots_.size()) return;
    size_t size = std::max<size_t>(16, slots_.size());
    while (size < 2 * n_entries) size *= 2;
    std::vector<Slot> slots(size, Slot{0, kNone});
    const size_t mask = size - 1;
    for (const Slot& slot : slots_) {
      if (slot.node == kNone) continue;
      size_t i = slot.hash & mask;
      while (slots[i].node != kNone) i = (i + 1) & mask;
      slots[i] = slot;
    }
    slots_.swap(slots);
    mask_ = mask;
  }

  void prefetch_slot(uint64_t h) const noexcept { __builtin_prefetch(&slots_[h & mask_]); }

  void index_insert(uint64_t h, int32_t x) noexcept {
    size_t i = h & mask_;
    while (slots_[i].node != kNone) i = (i + 1) & mask_;
    slots_[i] = Slot{h, x};
  }

  void index_erase(uint64_t h, int32_t x) noexcept {
    size_t i = h & mask_;
    while (slots_[i].node != x) i = (i + 1) & mask_;
    // Backward shift: move later entries of the cluster into the hole when
    // the hole lies between their home slot and where they are.
    for (size_t j = (i + 1) & mask_; slots_[j].node != kNone; j = (j + 1) & mask_) {
      const size_t home = slots_[j].hash & mask_;
      const bool movable = i <= j ? (home <= i || home > j) : (home <= i && home > j);
      if (movable) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].node = kNone;
  }

  /// Registers `page` (its cache reference already taken; a sequence holds
  /// it too) after `parent`. Capacity must be reserved.
  int32_t add_node(int64_t page, int32_t parent, uint64_t salt, uint64_t h, const int64_t* tokens) noexcept {
    int32_t x;
    if (!free_nodes_.empty()) {
      x = free_nodes_.back();
      free_nodes_.pop_back();
    } else {
      x = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
      tokens_.resize(tokens_.size() + static_cast<size_t>(page_size_));
    }
    Node& n = nodes_[static_cast<size_t>(x)];
    n = Node{};
    n.hash = h;
    if (!tiers_.empty()) {
      const uint64_t previous = parent == kNone ? page_store::key_seed(geometry_, salt)
                                                : nodes_[static_cast<size_t>(parent)].store_key;
      n.store_key = page_store::next_key(previous, tokens, page_size_).hash;
    }
    n.salt = salt;
    n.page = page;
    n.parent = parent;
    n.depth = parent == kNone ? 1 : nodes_[static_cast<size_t>(parent)].depth + 1;
    n.live = true;
    n.held = true;
    std::memcpy(tokens_.data() + static_cast<size_t>(x) * page_size_, tokens,
                static_cast<size_t>(page_size_) * sizeof(int64_t));
    node_of_page_[static_cast<size_t>(page)] = x;
    index_insert(h, x);
    link_newest(x);
    ++n_live_;
    if (parent != kNone) {
      Node& p = nodes_[static_cast<size_t>(parent)];
      ++p.n_children;
      ++p.n_blocking;  // the new node is held, so not reclaimable
      refresh(parent);
    }
    return x;
  }

  /// Evicts node x (evictable: a reclaimable leaf).
  void remove(int32_t x) noexcept {
    Node& n = nodes_[static_cast<size_t>(x)];
    if (!tiers_.empty() || listener_) note_eviction(x);
    pool().free(n.page);  // the only reference: the page is free again
    node_of_page_[static_cast<size_t>(n.page)] = kNone;
    index_erase(n.hash, x);
    unlink(x);
    n.live = false;
    --n_live_;
    --n_evictable_;
    --n_reclaimable_;
    free_nodes_.push_back(x);  // capacity reserved with nodes_
    ++stats_.evicted_pages;
    if (n.parent != kNone) {
      --nodes_[static_cast<size_t>(n.parent)].n_children;  // x was reclaimable: n_blocking unchanged
      refresh(n.parent);
    }
  }

  /// One walk from the least recently used end: evicting a leaf may make
  /// its parent evictable, and the parent is more recent, so the walk meets it.
  int64_t evict_lru(int64_t n_pages) noexcept {
    int64_t freed = 0;
    int32_t ahead = oldest_;  // kPrefetch nodes ahead of x: its index slot is fetched early
    for (int i = 0; i < kPrefetch && ahead != kNone; ++i) ahead = nodes_[static_cast<size_t>(ahead)].newer;
    for (int32_t x = oldest_; x != kNone && freed < n_pages;) {
      if (ahead != kNone) {
        prefetch_slot(nodes_[static_cast<size_t>(ahead)].hash);
        ahead = nodes_[static_cast<size_t>(ahead)].newer;
      }
      const int32_t next = nodes_[static_cast<size_t>(x)].newer;
      if (nodes_[static_cast<size_t>(x)].evictable) {
        remove(x);
        ++freed;
      }
      x = next;
    }
    if (!evicted_.empty()) write_down();
    return freed;
  }

  /// Recomputes x's flags and counters after its held flag or children
  /// changed, and carries a change of reclaimability up to its ancestors.
  void refresh(int32_t x) noexcept {
    while (x != kNone) {
      Node& n = nodes_[static_cast<size_t>(x)];
      const bool reclaimable = !n.held && n.n_blocking == 0;
      const bool evictable = reclaimable && n.n_children == 0;
      if (evictable != n.evictable) {
        n.evictable = evictable;
        n_evictable_ += evictable ? 1 : -1;
      }
      if (reclaimable == n.reclaimable) return;
      n.reclaimable = reclaimable;
      n_reclaimable_ += reclaimable ? 1 : -1;
      if (n.parent == kNone) return;
      nodes_[static_cast<size_t>(n.parent)].n_blocking += reclaimable ? -1 : 1;
      x = n.parent;
    }
  }

  void set_held(int32_t x, bool held) noexcept {
    Node& n = nodes_[static_cast<size_t>(x)];
    if (n.held == held) return;
    n.held = held;
    refresh(x);
  }

  void unlink(int32_t x) noexcept {
    Node& n = nodes_[static_cast<size_t>(x)];
    (n.older == kNone ? oldest_ : nodes_[static_cast<size_t>(n.older)].newer) = n.newer;
    (n.newer == kNone ? newest_ : nodes_[static_cast<size_t>(n.newer)].older) = n.older;
    n.older = n.newer = kNone;
  }

  void link_newest(int32_t x) noexcept {
    Node& n = nodes_[static_cast<size_t>(x)];
    n.older = newest_;
    n.newer = kNone;
    (newest_ == kNone ? oldest_ : nodes_[static_cast<size_t>(newest_)].newer) = x;
    newest_ = x;
  }

  /// Marks a prompt's chain used: the first page ends up the most recent.
  void touch(const std::vector<int32_t>& chain) noexcept {
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      if (*it == newest_) continue;
      unlink(*it);
      link_newest(*it);
    }
  }


  // ---- tiers and events ----

  static constexpr const char* kDevice = "device";

  static std::vector<std::shared_ptr<PageStore>> checked_tiers(std::vector<std::shared_ptr<PageStore>> tiers) {
    const checks::Caller caller{"PrefixCache", Layout::name, "PrefixCache"};
    for (size_t i = 0; i < tiers.size(); ++i) {
      TORCH_CHECK(tiers[i] != nullptr, caller, ": argument 'tiers' expected stores, got a null pointer at index ", i);
      for (size_t j = 0; j < i; ++j) {
        TORCH_CHECK(tiers[j] != tiers[i], caller, ": argument 'tiers' expected distinct stores, got one store at ",
                    "indices ", j, " and ", i);
      }
    }
    return tiers;
  }

  /// A warning that cannot throw (a warning handler may turn warnings into errors).
  template <class... Args>
  static void warn(const Args&... parts) noexcept {
    try {
      TORCH_WARN("pagedkv::PrefixCache<", Layout::name, ">: ", parts...);
    } catch (...) {
    }
  }

  void notify(const PrefixEvent& event) noexcept {
    try {
      listener_(event);
    } catch (const std::exception& e) {
      warn("the event listener threw (ignored): ", e.what());
    } catch (...) {
      warn("the event listener threw (ignored)");
    }
  }

  /// An event about cached node x.
  void emit(PrefixEvent::Type type, int32_t x, const std::string& tier) noexcept {
    const Node& n = nodes_[static_cast<size_t>(x)];
    try {
      notify(PrefixEvent{type, n.hash, n.parent == kNone ? 0 : nodes_[static_cast<size_t>(n.parent)].hash,
                         static_cast<int64_t>(n.depth) * page_size_, tier});
    } catch (...) {  // the tier's name could not be copied
    }
  }

  /// An event about a tier's entry, from its header (nothing for an entry without one).
  void emit_entry(PrefixEvent::Type type, const at::Tensor& entry, size_t t) noexcept {
    try {
      page_store::Header h{};
      if (!page_store::read_header(entry, &h)) return;
      notify(PrefixEvent{type, h.page_hash, h.parent_hash, h.n_tokens, stats_.tiers[t].tier});
    } catch (...) {
    }
  }

  /// A page that eviction freed, described before its node went, so that
  /// write_down can store it once the walk is over.
  struct Evicted {
    int64_t page;
    uint64_t hash;
    uint64_t parent_hash;
    uint64_t salt;
    uint64_t store_key;
    int64_t n_tokens;
    std::vector<int64_t> tokens;  // [n_tokens] when there are tiers
  };

  void note_eviction(int32_t x) noexcept {
    const Node& n = nodes_[static_cast<size_t>(x)];
    try {
      Evicted e{n.page, n.hash, n.parent == kNone ? 0 : nodes_[static_cast<size_t>(n.parent)].hash, n.salt,
                n.store_key, static_cast<int64_t>(n.depth) * page_size_, {}};
      if (!tiers_.empty()) {
        e.tokens.resize(static_cast<size_t>(e.n_tokens));
        // Its ancestors are still cached: a parent is evicted after its children.
        for (int32_t a = x; a != kNone; a = nodes_[static_cast<size_t>(a)].parent) {
          const int64_t at = static_cast<int64_t>(nodes_[static_cast<size_t>(a)].depth - 1) * page_size_;
          std::memcpy(e.tokens.data() + at, tokens_of(a), static_cast<size_t>(page_size_) * sizeof(int64_t));
        }
      }
      evicted_.push_back(std::move(e));
    } catch (...) {
      warn("out of memory describing evicted page ", n.page, ": it is dropped, not stored in a tier");
    }
  }

  /// Announces the pages eviction just freed and stores them in the first
  /// tier. Their K/V are still in the pool's storage: nothing has been
  /// allocated since they were freed.
  void write_down() noexcept {
    std::vector<Evicted> evicted;
    evicted.swap(evicted_);
    for (const Evicted& e : evicted) {
      if (listener_) {
        try {
          notify(PrefixEvent{PrefixEvent::Type::removed, e.hash, e.parent_hash, e.n_tokens, kDevice});
        } catch (...) {
        }
      }
      if (tiers_.empty() || static_cast<int64_t>(e.tokens.size()) != e.n_tokens) continue;
      StoredPage stored{PageKey{e.store_key}, at::Tensor()};
      try {
        stored.entry = page_store::encode(seqs_->cache(), e.page,
                                          page_store::Identity{stored.key, e.hash, e.parent_hash, e.salt,
                                                               e.tokens.data(), e.n_tokens});
      } catch (const std::exception& ex) {
        warn("could not copy evicted page ", e.page, " out of the pool (", ex.what(), "): not stored in a tier");
        continue;
      }
      put_down(0, std::move(stored));
    }
  }

  /// Puts an entry into tier t; what it pushes out (or refuses) goes to the
  /// next tier, and the last tier's push-outs are dropped.
  void put_down(size_t t, StoredPage page) noexcept {
    std::vector<StoredPage> pushed;
    const bool want = t + 1 < tiers_.size() || static_cast<bool>(listener_);
    bool ok = false;
    try {
      ok = tiers_[t]->put(page.key, page.entry, want ? &pushed : nullptr);
    } catch (const std::exception& ex) {
      warn("tier '", stats_.tiers[t].tier, "' threw on put (", ex.what(), "): the entry is not stored there");
    } catch (...) {
      warn("tier '", stats_.tiers[t].tier, "' threw on put: the entry is not stored there");
    }
    if (ok) {
      ++stats_.tiers[t].stored_pages;
      if (listener_) emit_entry(PrefixEvent::Type::stored, page.entry, t);
    } else if (t + 1 < tiers_.size()) {
      put_down(t + 1, std::move(page));
    }
    for (StoredPage& p : pushed) {
      if (listener_) emit_entry(PrefixEvent::Type::removed, p.entry, t);
      if (t + 1 < tiers_.size()) put_down(t + 1, std::move(p));
    }
  }

  /// Page j of `tokens` (key, chained hash h), loaded into a newly
  /// allocated page from the fastest tier whose entry verifies: {page, tier},
  /// or page -1 when no tier has one or the copy failed (warned). An entry
  /// that fails verification (corrupt, truncated, foreign) is removed from its
  /// tier with a warning, and the next tier is asked; a store that throws is a
  /// miss there. An entry in memory is read in place; one a store reads
  /// (EntryReader: a file) is read whole into read_buffer_, which the next
  /// entry reuses. The size, header, geometry, salt and tokens are checked
  /// first. The checksum is then checked during the copy into the new page
  /// (one read of the entry for both: page_store::CheckedLoad), the page
  /// given back when it fails; or before the allocation, when that must evict
  /// (the eviction would be for nothing), or for a cache that does not copy
  /// on the CPU. Either way a corrupt entry reaches no sequence and changes
  /// nothing on the device.
  std::pair<int64_t, size_t> tier_load(const int64_t* tokens, int64_t j, uint64_t salt, uint64_t key, uint64_t h,
                                       uint64_t parent_hash) {
    PagePool& pool = this->pool();
    const int64_t n_tokens = (j + 1) * page_size_;
    for (size_t t = 0; t < tiers_.size(); ++t) {
      const std::string& name = stats_.tiers[t].tier;
      std::unique_ptr<EntryReader> reader;
      bool check_sum = true;
      try {
        reader = tiers_[t]->open(PageKey{key});
        check_sum = !tiers_[t]->in_process();
      } catch (const std::exception& ex) {
        warn("tier '", name, "' threw on get (", ex.what(), "): a miss");
        continue;
      }
      if (reader == nullptr) continue;
      const bool sum_in_copy = check_sum && pool.n_free() > 0 && ops::use_cpu_kernels(seqs_->cache().device());
      std::string why;
      const at::Tensor entry = reader->whole();
      const uint8_t* data = nullptr;
      size_t size = 0;
      page_store::Verdict verdict = page_store::Verdict::corrupt;
      if (entry.defined()) {
        verdict = page_store::verify(entry, geometry_, PageKey{key}, salt, tokens, n_tokens, &why,
                                     check_sum && !sum_in_copy);
        if (verdict == page_store::Verdict::ok) {
          data = entry.data_ptr<uint8_t>();
          size = static_cast<size_t>(entry.numel());
        }
      } else {
        // Read to where the payload (after the header and the tokens) is
        // 64-byte aligned, the entry starting in the middle of a 4 KiB page:
        // the copy into the pool ran at half the speed from a payload 40
        // bytes past a line (bench/NOTES.md, "Verifying while copying"), and
        // the kernel's copy of read() at half its speed or worse into an
        // entry 8-24 bytes past a page ("Where in a page a disk entry is
        // read to").
        const size_t head = sizeof(page_store::Header) + static_cast<size_t>(n_tokens) * sizeof(int64_t);
        uint8_t* buffer = nullptr;
        bool whole_read = false;
        try {
          size = reader->size();
          if (read_buffer_.size() < size + 4096 + 64) read_buffer_.resize(size + 4096 + 64);
          const uintptr_t start = reinterpret_cast<uintptr_t>(read_buffer_.data());
          const uintptr_t target = 2048 + (64 - head % 64) % 64;  // the entry's offset in its page
          buffer = read_buffer_.data() + (target - start % 4096 + 4096) % 4096;
          whole_read = reader->read(buffer, size) == size;
        } catch (const std::exception& ex) {
          warn("tier '", name, "' threw on read (", ex.what(), "): a miss");
          continue;
        }
        if (!whole_read) {
          why = "it reads shorter than its size (truncated)";
        } else {
          data = buffer;
          verdict = page_store::verify_bytes(data, size, geometry_, PageKey{key}, salt, tokens, n_tokens, &why,
                                             check_sum && !sum_in_copy);
        }
      }
      reader.reset();
      if (verdict != page_store::Verdict::ok) {
        reject(t, j, key, h, parent_hash, why);
        continue;
      }
      if (pool.n_free() == 0) evict_lru(1);
      const int64_t page = pool.alloc();
      bool intact = true;
      try {
        if (sum_in_copy) {
          intact = page_store::load_checked(seqs_->cache(), page, data, size);
        } else {
          page_store::load(seqs_->cache(), page, data);
        }
      } catch (const std::exception& ex) {
        pool.free(page);
        warn("could not copy a tier entry into page ", page, " (", ex.what(), "): a miss");
        return {-1, 0};
      }
      if (intact) return {page, t};
      pool.free(page);  // never seen: it held nothing before and holds nothing now
      reject(t, j, key, h, parent_hash, "its checksum does not match its contents (corrupt)");
    }
    return {-1, 0};
  }

  /// Tier t's entry of page j (key, chained hash h) failed verification:
  /// warned about, removed from the tier, announced.
  void reject(size_t t, int64_t j, uint64_t key, uint64_t h, uint64_t parent_hash, const std::string& why) {
    const std::string& name = stats_.tiers[t].tier;
    warn("tier '", name, "' entry ", PageKey{key}.name(), " is not used: ", why, "; removed (a miss)");
    try {
      tiers_[t]->erase(PageKey{key});
    } catch (...) {
    }
    if (listener_) notify(PrefixEvent{PrefixEvent::Type::removed, h, j == 0 ? 0 : parent_hash, (j + 1) * page_size_, name});
  }

  /// Continues a device match (chain, pages; held) through the tiers, page
  /// by page, fastest tier first, while the pool has room (free pages, or
  /// evictable ones: eviction makes room as for any allocation, and never
  /// takes the match, which is held). Each page found is allocated, gets its
  /// K/V and is cached after the previous one, held by the acquiring
  /// sequence (ref_count 2); its node and page are appended to chain and
  /// pages. One page at a time, so that one entry at a time is in memory.
  /// Node capacity is reserved.
  void load_from_tiers(const int64_t* tokens, int64_t n_pages, uint64_t salt, std::vector<int32_t>& chain,
                       std::vector<int64_t>& pages) noexcept {
    PagePool& pool = this->pool();
    const bool first = chain.empty();
    uint64_t h = first ? prefix_hash::salt_seed(salt) : nodes_[static_cast<size_t>(chain.back())].hash;
    uint64_t key = first ? page_store::key_seed(geometry_, salt) : nodes_[static_cast<size_t>(chain.back())].store_key;
    for (int64_t j = static_cast<int64_t>(chain.size()); j < n_pages; ++j) {
      if (pool.n_free() + n_reclaimable_ == 0) return;  // the pool is short: the match stops here
      const int64_t* page_tokens = tokens + j * page_size_;
      const uint64_t parent_hash = h;
      h = hash_(h, page_tokens, page_size_);
      key = page_store::next_key(key, page_tokens, page_size_).hash;
      int64_t page = -1;
      size_t tier = 0;
      try {
        std::tie(page, tier) = tier_load(tokens, j, salt, key, h, parent_hash);
      } catch (const std::exception& ex) {  // out of memory reading an entry
        warn("could not read a tier entry (", ex.what(), "): a miss");
        return;
      }
      if (page < 0) return;
      pool.retain(page);  // the cache's reference; the allocation's is the sequence's
      const int32_t x = add_node(page, chain.empty() ? kNone : chain.back(), salt, h, page_tokens);
      chain.push_back(x);
      pages.push_back(page);
      PrefixTierStats& st = stats_.tiers[tier];
      st.hit_tokens += page_size_;
      ++st.loaded_pages;
      if (listener_) emit(PrefixEvent::Type::stored, x, kDevice);
    }
  }

  // ---- PageReclaimer: the attached table's hook ----

  void reclaim(int64_t n_pages) noexcept override { evict_lru(n_pages); }

  void unreferenced(const int64_t* pages, int64_t n) noexcept override {
    const PagePool& pool = this->pool();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t page = pages[i];
      const int32_t x = node_of_page_[static_cast<size_t>(page)];
      if (x != kNone && pool.ref_count(page) == 1) set_held(x, false);
    }
  }

  SequenceTable<Layout>* seqs_;
  int64_t page_size_;
  PrefixPageHash hash_ = &prefix_hash::page;
  std::vector<Node> nodes_;           // slots; !live ones are listed in free_nodes_
  std::vector<int64_t> tokens_;       // [nodes_.size(), page_size]: each node's tokens
  std::vector<int32_t> free_nodes_;
  std::vector<int32_t> node_of_page_;  // [n_pages]: the node caching each page, or kNone
  std::vector<Slot> slots_;            // hash index, a power of two long
  size_t mask_ = 0;
  int32_t oldest_ = kNone;  // LRU list ends
  int32_t newest_ = kNone;
  int64_t n_live_ = 0;
  int64_t n_evictable_ = 0;
  int64_t n_reclaimable_ = 0;
  PrefixStats stats_{};
  std::vector<std::shared_ptr<PageStore>> tiers_;  // fastest first
  page_store::Geometry geometry_;                  // what the tiers' entries must match
  std::function<void(const PrefixEvent&)> listener_;
  std::vector<Evicted> evicted_;  // freed by the eviction in progress, for write_down
  std::vector<uint8_t> read_buffer_;  // the last entry a store read (EntryReader): reused, as large as the largest
};

}  // namespace pagedkv
