// The operation-script engine for PrefixCache (fuzz_prefix, the corpus
// replay test). It decodes bytes into a configuration (layout, a device
// cache of 1-16 pages, a host cache of 0-12 pages, page size 1-4, a
// vocabulary of 2-5 token ids so that prompts share prefixes, and for some
// inputs a constant page hash, so that every page collides and only the
// token comparison tells them apart) and a script of calls on a
// SequenceTable with an attached PrefixCache: requests (acquire, prefill of
// the rest of the prompt through PagedCache::write, insert), appends, fork,
// truncate (a rollback: never frees a cached page; a kept cached page is
// copied by the next append), release, reserve, swap_out / swap_in, peek,
// evict, clear, and bad calls
// (tokens of the wrong rank or dtype, max_tokens < -1, insert on unknown,
// released or swapped sequences, tokens shorter than the sequence or
// contradicting a page it shares with the cache, evict(n < 0)).
//
// The model: (salt, token prefix ending at a page boundary) -> page, with a
// use tick per entry; an eviction takes the least recently used entry that
// no sequence holds and no entry continues, repeatedly. After every call:
//
// - acquire / peek return the model's match (and acquire its pages); insert
//   registers the model's number of new pages; evict frees the model's count;
//   evictions made by the table's allocations (seen in stats) are replayed
//   on the model;
// - a bad call threw c10::Error naming pagedkv::PrefixCache and changed
//   nothing: n_free, every ref_count, stats, n_cached, n_evictable;
// - an allocation that returned false had fewer free + reclaimable pages
//   than it needed, and changed nothing;
// - PrefixCache::check() passes (tree, index, LRU order, counters, every
//   ref_count against the table and the cache), n_cached() equals the
//   model's size and every model entry still matches in full;
// - every few calls, every live resident sequence reads back its tokens'
//   K/V bit for bit;
// - at the end every sequence is released and clear() leaves n_free == n_pages.
//
// Any disagreement throws pagedkv_fuzz::Failure (script.hpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pagedkv/pagedkv.hpp"
#include "script.hpp"  // Failure, fail, Bytes

namespace pagedkv {
/// The fuzzer swaps the page hash for a constant one on some inputs.
struct PrefixCacheTestAccess {
  template <class L>
  static void set_page_hash(PrefixCache<L>& cache, PrefixPageHash hash) {
    cache.hash_ = hash;
  }
};
}  // namespace pagedkv

namespace pagedkv_fuzz {

struct PrefixOptions {
  int64_t max_ops = std::numeric_limits<int64_t>::max();
  /// The bit-exact K/V comparison every n calls (the rest runs after each).
  int64_t check_every = 4;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  bool trace = false;
};

namespace prefix_detail {

constexpr int64_t kLayers = 1;
constexpr int64_t kHeads = 1;
constexpr int64_t kDim = 2;

/// K/V of tokens `ids` at positions first_pos..: a function of (id, position)
/// only, as a model's K/V is of its prefix, so shared prefixes share pages.
inline at::Tensor kv_of(const std::vector<int64_t>& ids, int64_t first_pos, int64_t layer, bool is_v) {
  std::vector<int64_t> key(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) key[i] = ids[i] * 256 + first_pos + static_cast<int64_t>(i);
  const at::Tensor t = at::tensor(key, at::kLong).view({-1, 1, 1});
  const at::Tensor k = (t * 8 + layer * 4 + at::arange(kHeads * kDim, at::kLong).view({1, kHeads, kDim})).to(at::kFloat);
  return is_v ? -k - 1 : k;
}

inline at::Tensor ids_tensor(const std::vector<int64_t>& ids, at::ScalarType dtype = at::kLong) {
  return at::tensor(ids, at::kLong).to(dtype);
}

struct Model {
  using Key = std::pair<uint64_t, std::vector<int64_t>>;
  struct Entry {
    int64_t page;
    int64_t tick;
  };
  int64_t page_size;
  std::map<Key, Entry> cached;
  int64_t tick = 0;

  Key key(uint64_t salt, const std::vector<int64_t>& t, int64_t n_pages) const {
    return {salt, std::vector<int64_t>(t.begin(), t.begin() + n_pages * page_size)};
  }
  std::vector<int64_t> match(const std::vector<int64_t>& tokens, int64_t n_pages, uint64_t salt, bool use) {
    std::vector<int64_t> pages;
    for (int64_t j = 1; j <= n_pages; ++j) {
      const auto it = cached.find(key(salt, tokens, j));
      if (it == cached.end()) break;
      pages.push_back(it->second.page);
    }
    if (use) touch(tokens, static_cast<int64_t>(pages.size()), salt);
    return pages;
  }
  void touch(const std::vector<int64_t>& tokens, int64_t n_pages, uint64_t salt) {
    for (int64_t j = n_pages; j >= 1; --j) cached[key(salt, tokens, j)].tick = ++tick;
  }
  int64_t insert(const std::vector<int64_t>& tokens, const std::vector<int64_t>& pages, int64_t n_pages,
                 uint64_t salt) {
    int64_t fresh = 0;
    for (int64_t j = 1; j <= n_pages; ++j) {
      if (cached.emplace(key(salt, tokens, j), Entry{pages[static_cast<size_t>(j - 1)], 0}).second) ++fresh;
    }
    touch(tokens, n_pages, salt);
    return fresh;
  }
  bool continued(const Key& k) const {
    for (auto it = cached.upper_bound(k); it != cached.end() && it->first.first == k.first; ++it) {
      const auto& t = it->first.second;
      if (t.size() < k.second.size() || !std::equal(k.second.begin(), k.second.end(), t.begin())) break;
      if (t.size() == k.second.size() + static_cast<size_t>(page_size)) return true;
    }
    return false;
  }
  /// Evicts up to n entries; `refs(page)` is the page's ref_count as the cache saw it.
  template <class Refs>
  int64_t evict(int64_t n, Refs&& refs) {
    int64_t freed = 0;
    while (freed < n) {
      auto best = cached.end();
      for (auto it = cached.begin(); it != cached.end(); ++it) {
        if (refs(it->second.page) != 1 || continued(it->first)) continue;
        if (best == cached.end() || it->second.tick < best->second.tick) best = it;
      }
      if (best == cached.end()) break;
      cached.erase(best);
      ++freed;
    }
    return freed;
  }
};

template <class L>
class Runner {
 public:
  Runner(Bytes& in, const PrefixOptions& options)
      : in_(in),
        options_(options),
        page_size_(in.range(1, 4)),
        vocab_(in.range(2, 5)),
        cache_(kLayers, in.range(1, 16), page_size_, kHeads, kDim, at::TensorOptions().dtype(at::kFloat)),
        host_cache_(kLayers, std::max<int64_t>(1, in.range(0, 12)), page_size_, kHeads, kDim,
                    at::TensorOptions().dtype(at::kFloat)),
        table_(cache_),
        host_(host_cache_),
        prefix_(table_) {
    model_.page_size = page_size_;
    if (in.range(0, 3) == 0) {
      pagedkv::PrefixCacheTestAccess::set_page_hash(prefix_,
                                                    [](uint64_t, const int64_t*, int64_t) -> uint64_t { return 5; });
    }
  }

  void run() {
    for (int64_t op = 0; op < options_.max_ops && !in_.empty(); ++op) {
      if (std::chrono::steady_clock::now() > options_.deadline) break;
      step(op);
      verify(op % options_.check_every == 0);
    }
    for (const auto& s : tokens_) table_.release(s.first);
    tokens_.clear();
    model_.evict(std::numeric_limits<int64_t>::max(), [&](int64_t p) { return cache_.ref_count(p); });
    prefix_.clear();
    verify(false);
    if (prefix_.n_cached() != 0 || cache_.n_free() != cache_.n_pages())
      fail("after releasing everything and clear(): n_cached ", prefix_.n_cached(), ", n_free ", cache_.n_free(),
           " of ", cache_.n_pages());
  }

 private:
  std::vector<int64_t> random_tokens(int64_t n) {
    std::vector<int64_t> t;
    for (int64_t i = 0; i < n; ++i) t.push_back(in_.range(0, vocab_ - 1));
    return t;
  }

  int64_t pick_seq() {
    if (tokens_.empty()) return -1;
    auto it = tokens_.begin();
    std::advance(it, in_.range(0, static_cast<int64_t>(tokens_.size()) - 1));
    return it->first;
  }

  void trace(const std::string& what) const {
    if (options_.trace) std::fprintf(stderr, "%s\n", what.c_str());
  }

  /// The model replays the evictions the table's allocations made.
  void follow_evictions() {
    const int64_t evicted = prefix_.stats().evicted_pages;
    if (evicted == evicted_seen_) return;
    // Those pages are free now (or reallocated): the cache saw them as its own only.
    const int64_t n = model_.evict(evicted - evicted_seen_, [&](int64_t p) {
      return cache_.ref_count(p) == 0 ? 1 : cache_.ref_count(p);
    });
    if (n != evicted - evicted_seen_) fail("the table's allocation evicted ", evicted - evicted_seen_, ", model ", n);
    evicted_seen_ = evicted;
  }

  /// Writes tokens[length(seq):] into seq after a successful prepare_append, and commits.
  void prefill(int64_t seq, const std::vector<int64_t>& tokens) {
    const int64_t from = table_.length(seq);
    const std::vector<int64_t> ids(tokens.begin() + from, tokens.end());
    if (ids.empty()) return;
    const auto pt_len = table_.batch({seq});
    for (int64_t layer = 0; layer < kLayers; ++layer)
      cache_.write(layer, pt_len.first, from, kv_of(ids, from, layer, false).unsqueeze(0),
                   kv_of(ids, from, layer, true).unsqueeze(0));
    table_.commit_append(seq, static_cast<int64_t>(ids.size()));
  }

  /// A prepare_append / reserve that returned false must have lacked pages and changed nothing.
  void short_pool(int64_t need, int64_t available, const std::string& what) const {
    if (available >= need) fail(what, " returned false with ", available, " free + reclaimable pages for ", need);
  }

  /// Pages prepare_append(seq, n) allocates: new ones past the capacity,
  /// plus a copy of each shared page the append lands in.
  int64_t append_need(int64_t seq, int64_t n) const {
    const auto& pages = table_.pages(seq);
    const int64_t length = table_.length(seq);
    const int64_t first = length / page_size_;
    const int64_t end = (length + n + page_size_ - 1) / page_size_;
    const int64_t have = std::min<int64_t>(end, static_cast<int64_t>(pages.size()));
    int64_t need = std::max<int64_t>(0, end - static_cast<int64_t>(pages.size()));
    for (int64_t j = first; j < have; ++j) need += cache_.ref_count(pages[static_cast<size_t>(j)]) > 1 ? 1 : 0;
    return need;
  }

  void do_insert(int64_t seq) {
    const auto& t = tokens_[seq];
    const int64_t fresh = prefix_.insert(seq, ids_tensor(t), salt_[seq]);
    const int64_t want = model_.insert(t, table_.pages(seq), table_.length(seq) / page_size_, salt_[seq]);
    if (fresh != want) fail("insert(", seq, ") registered ", fresh, " pages, model ", want);
  }

  /// Runs a call that must throw c10::Error naming PrefixCache and change nothing.
  template <class F>
  void bad_call(const std::string& what, F&& f) {
    std::vector<int64_t> refs;
    for (int64_t p = 0; p < cache_.n_pages(); ++p) refs.push_back(cache_.ref_count(p));
    const auto stats = prefix_.stats();
    const int64_t n_cached = prefix_.n_cached(), n_evictable = prefix_.n_evictable(), size = table_.size();
    try {
      f();
      fail(what, ": expected c10::Error, returned");
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      if (msg.find("pagedkv::PrefixCache") == std::string::npos) fail(what, ": message without the function: ", msg);
    }
    for (int64_t p = 0; p < cache_.n_pages(); ++p)
      if (cache_.ref_count(p) != refs[static_cast<size_t>(p)]) fail(what, " threw but changed page ", p, "'s ref_count");
    const auto now = prefix_.stats();
    if (now.lookups != stats.lookups || now.query_tokens != stats.query_tokens || now.hit_tokens != stats.hit_tokens ||
        now.inserted_pages != stats.inserted_pages || now.evicted_pages != stats.evicted_pages)
      fail(what, " threw but changed the stats");
    if (prefix_.n_cached() != n_cached || prefix_.n_evictable() != n_evictable || table_.size() != size)
      fail(what, " threw but changed the cache or the table");
  }

  void request() {
    std::vector<int64_t> prompt = random_tokens(in_.range(0, 4 * page_size_ + 2));
    const uint64_t salt = static_cast<uint64_t>(in_.range(0, 2));
    const int64_t n = static_cast<int64_t>(prompt.size());
    const int64_t max_tokens = in_.flag() ? -1 : in_.range(0, n + 2);
    const int64_t cap = max_tokens == -1 ? std::max<int64_t>(n - 1, 0) : std::min(max_tokens, n);
    const auto want = model_.match(prompt, cap / page_size_, salt, /*use=*/false);
    const int64_t want_tokens = static_cast<int64_t>(want.size()) * page_size_;
    if (prefix_.peek(ids_tensor(prompt), salt, max_tokens) != want_tokens) fail("peek differs from the model");
    const auto hit = prefix_.acquire(ids_tensor(prompt, in_.flag() ? at::kInt : at::kLong), salt, max_tokens);
    model_.match(prompt, cap / page_size_, salt, /*use=*/true);
    trace("acquire " + std::to_string(n) + " tokens salt " + std::to_string(salt) + " -> seq " +
          std::to_string(hit.first) + " matched " + std::to_string(hit.second));
    if (hit.second != want_tokens || table_.pages(hit.first) != want || table_.length(hit.first) != hit.second)
      fail("acquire matched ", hit.second, " tokens, model ", want_tokens);
    tokens_[hit.first] = std::vector<int64_t>(prompt.begin(), prompt.begin() + hit.second);
    salt_[hit.first] = salt;
    const int64_t available = cache_.n_free() + prefix_.n_reclaimable();
    if (!table_.prepare_append(hit.first, n - hit.second)) {
      short_pool((n + page_size_ - 1) / page_size_ - hit.second / page_size_, available, "prepare_append of a prompt");
      return;
    }
    follow_evictions();
    prefill(hit.first, prompt);
    tokens_[hit.first] = prompt;
    if (in_.range(0, 3) != 0) do_insert(hit.first);
  }

  void step(int64_t op) {
    const int kind = static_cast<int>(in_.range(0, 11));
    const int64_t seq = pick_seq();
    if (kind <= 2 || seq < 0) return request();
    const bool swapped = table_.swapped(seq);
    switch (kind) {
      case 3: {  // append, maybe register
        if (swapped) return;
        auto all = tokens_[seq];
        const auto more = random_tokens(in_.range(1, 2 * page_size_));
        all.insert(all.end(), more.begin(), more.end());
        const int64_t available = cache_.n_free() + prefix_.n_reclaimable();
        const int64_t need = append_need(seq, static_cast<int64_t>(more.size()));
        if (!table_.prepare_append(seq, static_cast<int64_t>(more.size()))) {
          short_pool(need, available, "prepare_append");
          return;
        }
        follow_evictions();
        prefill(seq, all);
        tokens_[seq] = all;
        if (in_.flag()) do_insert(seq);
        return;
      }
      case 4: {  // fork
        if (swapped) return;
        const int64_t child = table_.fork(seq);
        tokens_[child] = tokens_[seq];
        salt_[child] = salt_[seq];
        return;
      }
      case 5:
        table_.release(seq);
        tokens_.erase(seq);
        return;
      case 6: {  // evict
        const int64_t n = in_.range(0, 4);
        const int64_t want = model_.evict(n, [&](int64_t p) { return cache_.ref_count(p); });
        const int64_t freed = prefix_.evict(n);
        evicted_seen_ = prefix_.stats().evicted_pages;
        if (freed != want) fail("evict(", n, ") freed ", freed, ", model ", want);
        return;
      }
      case 7:  // swap
        if (swapped) {
          const int64_t available = cache_.n_free() + prefix_.n_reclaimable();
          if (table_.swap_in(seq, host_)) {
            follow_evictions();
          } else {
            short_pool((static_cast<int64_t>(tokens_[seq].size()) + page_size_ - 1) / page_size_, available, "swap_in");
          }
        } else {
          table_.swap_out(seq, host_);
        }
        return;
      case 8: {  // reserve: an allocation that may evict
        if (swapped) return;
        const int64_t pages = in_.range(0, 6);
        const int64_t need = std::max<int64_t>(0, pages - table_.capacity(seq) / page_size_);
        const int64_t available = cache_.n_free() + prefix_.n_reclaimable();
        if (table_.reserve(seq, pages * page_size_)) {
          follow_evictions();
        } else {
          short_pool(need, available, "reserve");
        }
        return;
      }
      case 9: {
        const int64_t which = in_.range(0, 3);
        if (which == 0) {
          model_.evict(std::numeric_limits<int64_t>::max(), [&](int64_t p) { return cache_.ref_count(p); });
          prefix_.clear();
          evicted_seen_ = prefix_.stats().evicted_pages;
          if (prefix_.n_evictable() != 0 || prefix_.n_reclaimable() != 0) fail("clear() left evictable pages");
        } else if (which == 1 && !swapped) {  // truncate: the cache keeps every page it caches
          const auto length = static_cast<int64_t>(tokens_[seq].size());
          const int64_t n = in_.range(0, length);
          const int64_t n_cached = prefix_.n_cached();
          trace("truncate " + std::to_string(seq) + " to " + std::to_string(n));
          table_.truncate(seq, n);
          tokens_[seq].resize(static_cast<size_t>(n));
          if (table_.length(seq) != n || table_.capacity(seq) != (n + page_size_ - 1) / page_size_ * page_size_)
            fail("truncate(", seq, ", ", n, ") left length ", table_.length(seq), ", capacity ", table_.capacity(seq));
          if (prefix_.n_cached() != n_cached) fail("truncate changed n_cached from ", n_cached, " to ", prefix_.n_cached());
        }
        return;
      }
      case 10:
        if (!swapped && in_.flag()) do_insert(seq);
        return;
      default:
        return bad(seq, swapped, op);
    }
  }

  void bad(int64_t seq, bool swapped, int64_t op) {
    const auto& t = tokens_[seq];
    switch (in_.range(0, 7)) {
      case 0:
        return bad_call("peek of 2-D tokens", [&] { prefix_.peek(ids_tensor({1, 2}).view({1, 2})); });
      case 1:
        return bad_call("acquire of float tokens", [&] { prefix_.acquire(ids_tensor({1, 2}).to(at::kFloat)); });
      case 2:
        return bad_call("acquire with max_tokens < -1",
                        [&] { prefix_.acquire(ids_tensor(t), 0, -2 - in_.range(0, 100)); });
      case 3:
        return bad_call("evict(n < 0)", [&] { prefix_.evict(-1 - in_.range(0, 100)); });
      case 4:
        return bad_call("insert of an unknown sequence", [&] { prefix_.insert(1000 + op, ids_tensor(t)); });
      case 5:
        if (t.empty()) return;
        return bad_call("insert with too few tokens", [&] {
          prefix_.insert(seq, ids_tensor(std::vector<int64_t>(t.begin(), t.end() - 1)), salt_[seq]);
        });
      case 6:
        if (!swapped) return;
        return bad_call("insert of a swapped sequence", [&] { prefix_.insert(seq, ids_tensor(t), salt_[seq]); });
      default: {
        // Tokens that contradict a cached page the sequence shares (another salt).
        if (swapped || table_.length(seq) < page_size_) return;
        const auto& pages = table_.pages(seq);
        bool shares = false;
        for (int64_t j = 0; j < table_.length(seq) / page_size_; ++j) shares = shares || cache_.ref_count(pages[static_cast<size_t>(j)]) > 1;
        const uint64_t other = salt_[seq] + 1;
        if (!shares || model_.cached.count(model_.key(salt_[seq], t, 1)) == 0 ||
            model_.cached.at(model_.key(salt_[seq], t, 1)).page != pages[0])
          return;
        return bad_call("insert under another salt", [&] { prefix_.insert(seq, ids_tensor(t), other); });
      }
    }
  }

  void verify(bool data) {
    try {
      prefix_.check();
    } catch (const c10::Error& e) {
      fail("check(): ", e.what_without_backtrace());
    }
    if (prefix_.n_cached() != static_cast<int64_t>(model_.cached.size()))
      fail("n_cached ", prefix_.n_cached(), ", model ", model_.cached.size());
    for (const auto& e : model_.cached) {
      const auto& t = e.first.second;
      if (prefix_.peek(ids_tensor(t), e.first.first, static_cast<int64_t>(t.size())) != static_cast<int64_t>(t.size()))
        fail("a prefix of ", t.size(), " tokens (salt ", e.first.first, ") the model caches does not match");
    }
    if (!data) return;
    for (const auto& s : tokens_) {
      if (table_.swapped(s.first) || s.second.empty()) continue;
      const auto pt_len = table_.batch({s.first});
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        const auto kv = cache_.gather(layer, pt_len.first, pt_len.second);
        if (!at::equal(kv.first[0], kv_of(s.second, 0, layer, false)) ||
            !at::equal(kv.second[0], kv_of(s.second, 0, layer, true)))
          fail("sequence ", s.first, " reads back other K/V than its tokens'");
      }
    }
  }

  Bytes& in_;
  PrefixOptions options_;
  int64_t page_size_;
  int64_t vocab_;
  pagedkv::PagedCache<L> cache_;
  pagedkv::PagedCache<L> host_cache_;
  pagedkv::SequenceTable<L> table_;
  pagedkv::SequenceTable<L> host_;
  pagedkv::PrefixCache<L> prefix_;  // declared last: destroyed before the table
  Model model_;
  std::map<int64_t, std::vector<int64_t>> tokens_;  // every live sequence of table_
  std::map<int64_t, uint64_t> salt_;
  int64_t evicted_seen_ = 0;
};

}  // namespace prefix_detail

/// Runs one script; throws Failure when the cache disagrees with the model.
inline void run_prefix_script(const uint8_t* data, size_t size, const PrefixOptions& options = {}) {
  Bytes in(data, size);
  if (in.flag()) {
    prefix_detail::Runner<pagedkv::NHD>(in, options).run();
  } else {
    prefix_detail::Runner<pagedkv::HND>(in, options).run();
  }
}

}  // namespace pagedkv_fuzz
