// SequenceTable<Layout>: the host-side block table an engine keeps per
// cache. Each sequence owns a list of pages (its block table row) and a
// length; the table grows it as tokens arrive, shares pages between
// sequences (fork: parallel sampling, beam search) through PagePool's
// reference counts, copies a shared page before a write lands in it
// (copy-on-write), builds the [B, max_pages] page table of a batch, and
// moves sequences to another cache (a host cache) and back.
//
// Semantics
// - Ids are small integers: create() and fork() return the lowest id not in
//   use, so a released id is handed out again (as PagePool does with pages).
// - A sequence's pages: page j holds tokens [j*page_size, (j+1)*page_size).
//   capacity = pages * page_size >= length. Pages past the length are
//   reserved, not yet written.
// - reserve(seq, n_tokens) makes capacity >= n_tokens (a total, like
//   std::vector::reserve; never shrinks). fork shares every page, reserved
//   ones included; the fork gets the parent's length.
// - prepare_append(seq, n) makes capacity >= length + n and gives the
//   sequence its own copy of every shared page among the pages tokens
//   [length, length + n) land in. A shared page that already holds tokens of
//   the sequence (the partly written last page) is copied (copy-on-write);
//   a shared page that holds none (a reserved page shared by fork) is
//   replaced by a fresh page without a copy. commit_append(seq, n) then
//   records the n tokens written (length += n; they must fit the capacity).
//   The write itself goes through the cache: batch() gives the page table.
// - swap_out(seq, host) copies the pages that hold the sequence's tokens
//   into `host`'s cache, under a sequence it creates in `host`, and frees
//   every page the sequence had here (shared pages are only unreferenced: a
//   sequence that shared pages with others gets its own pages on swap_in).
//   The sequence keeps its id here, marked swapped. swap_in(seq, host)
//   allocates pages here again (all-or-nothing), copies the tokens back,
//   and releases the host-side sequence; the capacity after swap_in is the
//   pages that hold the length. `host` must be the table it was swapped to.
// - A swapped sequence: length() answers; release() frees its host-side
//   copy too (so the host table must outlive the sequences swapped into
//   it); swap_in() brings it back; every other call (reserve, fork,
//   prepare_append, commit_append, batch, swap_out) throws c10::Error.
// - The host-side sequence that holds a swapped sequence's pages belongs to
//   the table that swapped it out: in the host table, length() and batch()
//   answer for it (read-only), every mutating call throws c10::Error.
// - Failure: a bad argument (unknown or released id, negative n, a call on a
//   swapped sequence, a commit past the capacity, a host table of another
//   geometry or dtype, or the same table/cache) throws c10::Error; a pool
//   that is short makes reserve / prepare_append / swap_out / swap_in
//   return false. Either way nothing has changed and no page has leaked.
// - The cache must outlive the table. Destroying the table frees the pages
//   its sequences hold in its own cache (never touching other tables).
//   Not copyable or movable (swapped sequences refer to their host table).
// - Not thread-safe: one scheduler thread owns a table and its cache.
// - A PrefixCache attached to the table (at most one) lends it its
//   evictable pages: when the pool is short, reserve / prepare_append /
//   swap_in (and swap_out into a host table with its own prefix cache) evict
//   exactly the shortfall first, and return false, with nothing changed,
//   only when free + evictable pages are too few (page_reclaimer.hpp).
// - truncate(seq, n) keeps the first n tokens: every page past them (reserved
//   ones included) loses this sequence's reference, so a page shared with a
//   fork or cached by the prefix cache stays with them; a kept page that is
//   partly past n stays as it is (shared or not): the next prepare_append
//   copies it if it is shared, as for any append.
// - Windowed tables (window w >= 1): after commit_append, the query at the
//   next position sees tokens [length - w + 1, length], so every page
//   wholly before length - w + 1 is freed (unreferenced when shared) and its
//   column reads -1 in pages() and batch(). Such released columns are
//   always leading: `dropped` of them, exactly
//   max(0, length - w + 1) / page_size. A sequence so holds at most
//   ceil((w - 1) / page_size) + 1 pages with tokens (plus reserved ones).
//   fork, swap and transfer carry the released columns and move only the
//   pages still held. A window cannot grow back: truncate refuses a length
//   whose window would reach a released page (n_tokens - w + 1 below the
//   first held token); to roll back unverified tokens on such a table,
//   commit only the accepted ones.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/page_copy.hpp"
#include "pagedkv/page_reclaimer.hpp"
#include "pagedkv/paged_cache.hpp"

namespace pagedkv {

template <class Layout>
class PrefixCache;

namespace detail {
struct SequenceAccess;
}

template <class Layout = NHD>
class SequenceTable {
 public:
  /// window = 0: every token stays; w >= 1: only the last w tokens of
  /// each sequence (what attention with a window <= w reads) keep pages.
  explicit SequenceTable(PagedCache<Layout>& cache, int64_t window = 0) : cache_(&cache), window_(window) {
    checks::non_negative(checks::Caller{"SequenceTable", Layout::name, "SequenceTable"}, "window", window);
  }

  ~SequenceTable() {
    // Only this cache's pages; swapped sequences' host copies stay with the
    // host table (which frees them when it goes).
    PagePool& pool = cache_->pool();
    for (const Seq& s : seqs_) {
      for (int64_t page : held(s)) {
        if (pool.is_allocated(page)) pool.free(page);
      }
    }
  }

  SequenceTable(const SequenceTable&) = delete;
  SequenceTable& operator=(const SequenceTable&) = delete;

  /// A new, empty sequence (no pages, length 0); the lowest unused id.
  int64_t create() {
    const int64_t seq = new_id();
    seqs_[static_cast<size_t>(seq)].live = true;
    ++n_live_;
    return seq;
  }

  /// Grows the capacity to at least n_tokens tokens (a total; never
  /// shrinks). All-or-nothing: false, and nothing changed, if the pool has
  /// fewer free pages than needed.
  bool reserve(int64_t seq, int64_t n_tokens) {
    const checks::Caller caller{"SequenceTable", Layout::name, "reserve"};
    Seq& s = owned(caller, seq);
    checks::non_negative(caller, "n_tokens", n_tokens);
    const int64_t need = pages_for(n_tokens) - n_pages(s);
    if (need <= 0) return true;
    if (!make_room(need)) return false;
    std::vector<int64_t> fresh = cache_->pool().alloc_n(need);
    if (static_cast<int64_t>(fresh.size()) != need) return false;
    s.pages.insert(s.pages.end(), fresh.begin(), fresh.end());
    return true;
  }

  /// A new sequence sharing every page of `seq` (each ref_count + 1), with
  /// the same length.
  int64_t fork(int64_t seq) {
    const checks::Caller caller{"SequenceTable", Layout::name, "fork"};
    owned(caller, seq);
    const int64_t child = new_id();  // may reallocate seqs_
    Seq& parent = seqs_[static_cast<size_t>(seq)];
    Seq& c = seqs_[static_cast<size_t>(child)];
    try {
      c.pages.assign(parent.pages.begin(), parent.pages.end());
      cache_->pool().retain_all(held(parent));  // all or nothing
    } catch (...) {  // a page at the ref_count limit or freed behind the table's back (or no memory): undo
      c.pages.clear();
      free_ids_.push_back(child);
      std::push_heap(free_ids_.begin(), free_ids_.end(), std::greater<int64_t>());
      pages_held(caller, seq, held(parent), cache_->pool(), parent.dropped);
      throw;
    }
    c.dropped = parent.dropped;
    c.length = parent.length;
    c.live = true;
    ++n_live_;
    return child;
  }

  /// Frees every page of `seq` (and, for a swapped sequence, its host-side
  /// copy); the id may be handed out again.
  void release(int64_t seq) {
    const checks::Caller caller{"SequenceTable", Layout::name, "release"};
    Seq& s = live(caller, seq);
    not_holder(caller, seq, s);
    if (s.swapped) {
      s.host_release(s.host, s.host_seq);
    } else {
      try {
        cache_->pool().free_all(held(s));  // all or nothing
      } catch (const c10::Error&) {
        pages_held(caller, seq, held(s), cache_->pool(), s.dropped);
        throw;
      }
      unreferenced(held(s));
    }
    retire(seq);
  }

  /// Tokens written so far (committed).
  int64_t length(int64_t seq) const {
    return live(checks::Caller{"SequenceTable", Layout::name, "length"}, seq).length;
  }

  /// Before writing n_tokens at the end of `seq`: reserves the pages and
  /// gives the sequence its own copy of any shared page the write lands in
  /// (copy-on-write). All-or-nothing: false, and nothing changed, if the
  /// pool is short.
  bool prepare_append(int64_t seq, int64_t n_tokens) {
    const checks::Caller caller{"SequenceTable", Layout::name, "prepare_append"};
    Seq& s = owned(caller, seq);
    checks::non_negative(caller, "n_tokens", n_tokens);
    if (n_tokens == 0) return true;
    PagePool& pool = cache_->pool();
    const int64_t page_size = cache_->page_size();
    // A sequence's pages are distinct, so it never holds more than the whole
    // pool (this also keeps length + n_tokens from overflowing, but for a
    // windowed sequence whose length is already near INT64_MAX).
    if (n_tokens > cache_->n_pages() * page_size - (s.length - s.dropped * page_size)) return false;
    if (n_tokens > std::numeric_limits<int64_t>::max() - s.length) return false;
    const int64_t first = s.length / page_size;
    const int64_t end = pages_for(s.length + n_tokens);
    const int64_t have = std::min(end, n_pages(s));
    int64_t shared = 0;
    for (int64_t j = first; j < have; ++j) shared += pool.ref_count(s.pages[static_cast<size_t>(j)]) > 1 ? 1 : 0;
    const int64_t grow = std::max<int64_t>(0, end - n_pages(s));
    if (shared + grow == 0) return true;
    if (!make_room(shared + grow)) return false;
    s.pages.reserve(static_cast<size_t>(end));  // the only allocation: before any change
    // From here on each alloc() succeeds. Only column `first` can hold
    // tokens of this sequence (when the length is mid-page): it is copied
    // before anything else changes, so that a failing copy (a device
    // error) can be undone.
    for (int64_t j = first; j < have; ++j) {
      int64_t& page = s.pages[static_cast<size_t>(j)];
      if (pool.ref_count(page) <= 1) continue;
      const int64_t mine = pool.alloc();
      if (j * page_size < s.length) copy_or_undo(*cache_, *cache_, &page, &mine, 1, &mine);
      pool.free(page);  // ref >= 2: only unreferenced
      unreferenced(&page, 1);
      page = mine;
    }
    for (int64_t j = 0; j < grow; ++j) s.pages.push_back(pool.alloc());
    return true;
  }

  /// Records n_tokens written at the end of `seq` (length += n_tokens).
  /// They must fit the capacity (call prepare_append first).
  void commit_append(int64_t seq, int64_t n_tokens) {
    const checks::Caller caller{"SequenceTable", Layout::name, "commit_append"};
    Seq& s = owned(caller, seq);
    checks::non_negative(caller, "n_tokens", n_tokens);
    const int64_t capacity = n_pages(s) * cache_->page_size();
    TORCH_CHECK(n_tokens <= capacity - s.length, caller, ": argument 'n_tokens' expected <= ", capacity - s.length,
                " (sequence ", seq, " has length ", s.length, " and capacity ", capacity,
                "; call prepare_append first), got ", n_tokens);
    // The pages that fall out of the window: freed only now, since the
    // step's queries (written after prepare_append) still read them.
    const int64_t drop = dropped_for(s.length + n_tokens);
    const c10::ArrayRef<int64_t> gone(s.pages.data() + s.dropped, static_cast<size_t>(drop - s.dropped));
    pages_held(caller, seq, gone, cache_->pool(), s.dropped);  // so that free_all cannot fail
    cache_->pool().free_all(gone);
    unreferenced(gone);
    std::fill(s.pages.begin() + static_cast<std::ptrdiff_t>(s.dropped),
              s.pages.begin() + static_cast<std::ptrdiff_t>(drop), kUnmappedPage);
    s.dropped = drop;
    s.length += n_tokens;
  }

  /// Keeps the first n_tokens tokens of `seq` (0 <= n_tokens <= length):
  /// every page past them, reserved ones included, loses this sequence's
  /// reference (a page shared with a fork or cached by a prefix cache
  /// stays with them). Speculative decoding's rollback.
  void truncate(int64_t seq, int64_t n_tokens) {
    const checks::Caller caller{"SequenceTable", Layout::name, "truncate"};
    Seq& s = owned(caller, seq);
    checks::kept_tokens(caller, seq, n_tokens, s.length);
    checks::window_reachable(caller, seq, n_tokens, window_, s.dropped * cache_->page_size());
    const int64_t keep = pages_for(n_tokens);  // >= s.dropped: the window check above
    const c10::ArrayRef<int64_t> gone(s.pages.data() + keep, static_cast<size_t>(n_pages(s) - keep));
    pages_held(caller, seq, gone, cache_->pool(), keep);  // so that free_all cannot fail
    cache_->pool().free_all(gone);
    unreferenced(gone);
    s.pages.resize(static_cast<size_t>(keep));
    s.length = n_tokens;
  }

  /// The page table [B, max_pages] (int32, -1 padded; max_pages = the
  /// largest page count in the batch, reserved pages included) and the
  /// lengths [B] (int64), both on the cpu: ready for
  /// PagedCache::bind(page_table, lengths) and for writes at the lengths.
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& seqs) const {
    const checks::Caller caller{"SequenceTable", Layout::name, "batch"};
    int64_t max_pages = 0;
    for (int64_t seq : seqs) {
      const Seq& s = live(caller, seq);
      TORCH_CHECK(!s.swapped, caller, ": argument 'seqs' expected resident sequences, got sequence ", seq,
                  " which is swapped out (call swap_in first)");
      max_pages = std::max(max_pages, n_pages(s));
    }
    const int64_t rows = static_cast<int64_t>(seqs.size());
    at::Tensor table = at::empty({rows, max_pages}, at::kInt);
    at::Tensor lengths = at::empty({rows}, at::kLong);
    int32_t* t = table.data_ptr<int32_t>();
    int64_t* l = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      const Seq& s = seqs_[static_cast<size_t>(seqs[static_cast<size_t>(b)])];
      int32_t* row = t + b * max_pages;
      const int64_t n = n_pages(s);
      for (int64_t j = 0; j < n; ++j) row[j] = static_cast<int32_t>(s.pages[static_cast<size_t>(j)]);
      std::fill(row + n, row + max_pages, static_cast<int32_t>(kUnmappedPage));
      l[b] = s.length;
    }
    return {table, lengths};
  }

  /// Moves `seq`'s tokens to `host`'s cache under a sequence created there,
  /// and frees its pages here; `seq` keeps its id, marked swapped. False,
  /// and nothing changed, if `host`'s pool is short.
  template <class OL>
  bool swap_out(int64_t seq, SequenceTable<OL>& host) {
    const checks::Caller caller{"SequenceTable", Layout::name, "swap_out"};
    Seq& s = owned(caller, seq);
    other_table(caller, host);
    pages_held(caller, seq, held(s), cache_->pool(), s.dropped);  // so that the frees below cannot fail
    // Only the pages that hold tokens and are still held; the host row keeps
    // the released columns as -1, so that host.batch() maps positions as here.
    const int64_t n = pages_for(s.length) - s.dropped;
    std::vector<int64_t> host_row(static_cast<size_t>(s.dropped + n), kUnmappedPage);
    if (!host.make_room(n)) return false;
    const std::vector<int64_t> host_pages = host.cache_->pool().alloc_n(n);
    if (static_cast<int64_t>(host_pages.size()) != n) return false;
    const int64_t* mine = s.pages.data() + s.dropped;
    copy_or_undo(*host.cache_, *cache_, mine, host_pages.data(), n, host_pages.data(), n);
    cache_->pool().free_all(held(s));
    unreferenced(held(s));
    std::copy(host_pages.begin(), host_pages.end(), host_row.begin() + static_cast<std::ptrdiff_t>(s.dropped));
    const int64_t host_seq = host.new_id();
    auto& h = host.seqs_[static_cast<size_t>(host_seq)];
    h.live = true;
    h.holder = true;
    h.pages = std::move(host_row);
    h.dropped = s.dropped;
    h.length = s.length;
    ++host.n_live_;
    s.pages.clear();
    s.dropped = 0;
    s.swapped = true;
    s.host = &host;
    s.host_seq = host_seq;
    s.host_release = &SequenceTable<OL>::release_holder;
    return true;
  }

  /// Brings a swapped `seq` back from `host` (the table it was swapped out
  /// to): allocates its pages here, copies its tokens, releases the
  /// host-side sequence. False, and nothing changed, if this pool is short.
  template <class OL>
  bool swap_in(int64_t seq, SequenceTable<OL>& host) {
    const checks::Caller caller{"SequenceTable", Layout::name, "swap_in"};
    Seq& s = live(caller, seq);
    not_holder(caller, seq, s);
    TORCH_CHECK(s.swapped, caller, ": argument 'seq' expected a swapped-out sequence, got sequence ", seq,
                " which is resident");
    TORCH_CHECK(s.host == static_cast<const void*>(&host), caller,
                ": argument 'host' expected the table sequence ", seq, " was swapped out to, got another table");
    const auto& h = host.seqs_[static_cast<size_t>(s.host_seq)];
    const c10::ArrayRef<int64_t> host_pages = SequenceTable<OL>::held(h);
    pages_held(caller, seq, host_pages, host.cache_->pool(), h.dropped);  // so that release_holder cannot fail
    const auto n = static_cast<int64_t>(host_pages.size());
    std::vector<int64_t> row(h.pages.size(), kUnmappedPage);  // released columns stay -1
    if (!make_room(n)) return false;
    const std::vector<int64_t> pages = cache_->pool().alloc_n(n);
    if (static_cast<int64_t>(pages.size()) != n) return false;
    copy_or_undo(*cache_, *host.cache_, host_pages.data(), pages.data(), n, pages.data(), n);
    std::copy(pages.begin(), pages.end(), row.begin() + static_cast<std::ptrdiff_t>(h.dropped));
    s.length = h.length;
    s.dropped = h.dropped;
    s.pages = std::move(row);
    SequenceTable<OL>::release_holder(&host, s.host_seq);
    s.swapped = false;
    s.host = nullptr;
    s.host_seq = -1;
    s.host_release = nullptr;
    return true;
  }

  // ---- inspection (not part of the core contract) ----

  /// The pages of `seq`, in token order (capacity / page_size of them;
  /// -1 for the leading ones a windowed table released).
  const std::vector<int64_t>& pages(int64_t seq) const {
    return live(checks::Caller{"SequenceTable", Layout::name, "pages"}, seq).pages;
  }
  /// Tokens `seq` can hold without new pages.
  int64_t capacity(int64_t seq) const {
    const Seq& s = live(checks::Caller{"SequenceTable", Layout::name, "capacity"}, seq);
    return n_pages(s) * cache_->page_size();
  }
  /// Whether `seq` is swapped out.
  bool swapped(int64_t seq) const { return live(checks::Caller{"SequenceTable", Layout::name, "swapped"}, seq).swapped; }
  /// Whether `seq` is a live id of this table.
  bool contains(int64_t seq) const noexcept {
    return seq >= 0 && seq < static_cast<int64_t>(seqs_.size()) && seqs_[static_cast<size_t>(seq)].live;
  }
  /// Live sequences (host-side holders of swapped sequences included).
  int64_t size() const noexcept { return n_live_; }
  PagedCache<Layout>& cache() const noexcept { return *cache_; }
  /// Tokens each sequence keeps pages for (0: all of them).
  int64_t window() const noexcept { return window_; }

  /// Audits every sequence with full scans (tests, debugging): ids and the
  /// live count; each resident sequence holds allocated, distinct pages
  /// covering its length, -1 exactly in the columns its window released
  /// (none without a window); a swapped one holds no pages here; no page's
  /// ref_count is below the references the table holds on it. Throws
  /// c10::Error naming the first violation.
  void check() const {
    const auto fail = [&](auto&&... parts) {
      TORCH_CHECK(false, "pagedkv::SequenceTable<", Layout::name, ">::check: ", parts...);
    };
    const PagePool& pool = cache_->pool();
    std::vector<int64_t> refs(static_cast<size_t>(pool.n_pages()), 0);
    std::vector<int64_t> last_seen(static_cast<size_t>(pool.n_pages()), -1);
    int64_t live = 0;
    for (size_t i = 0; i < seqs_.size(); ++i) {
      const Seq& s = seqs_[i];
      if (!s.live) continue;
      ++live;
      if (s.swapped) {
        if (!s.pages.empty() || s.dropped != 0) fail("sequence ", i, " is swapped out but holds pages here");
        continue;
      }
      if (s.length < 0 || pages_for(s.length) > n_pages(s))
        fail("sequence ", i, " has length ", s.length, " but ", n_pages(s), " pages of ", cache_->page_size(),
             " tokens");
      // A holder mirrors the released columns of the sequence it holds, whatever this table's window.
      if (!s.holder && s.dropped != dropped_for(s.length))
        fail("sequence ", i, " of length ", s.length, " has ", s.dropped, " released pages, expected ",
             dropped_for(s.length), " (window ", window_, ")");
      if (s.dropped < 0 || s.dropped > n_pages(s)) fail("sequence ", i, " has ", s.dropped, " released pages");
      for (int64_t j = 0; j < n_pages(s); ++j) {
        const int64_t page = s.pages[static_cast<size_t>(j)];
        if (j < s.dropped) {
          if (page != kUnmappedPage) fail("sequence ", i, " holds page ", page, " in released column ", j);
          continue;
        }
        if (page < 0 || page >= pool.n_pages() || !pool.is_allocated(page))
          fail("sequence ", i, " holds page ", page, " in column ", j, ", which is not an allocated page");
        if (last_seen[static_cast<size_t>(page)] == static_cast<int64_t>(i))
          fail("sequence ", i, " holds page ", page, " twice");
        last_seen[static_cast<size_t>(page)] = static_cast<int64_t>(i);
        ++refs[static_cast<size_t>(page)];
      }
    }
    if (live != n_live_) fail(live, " live sequences, but size() is ", n_live_);
    for (int64_t page = 0; page < pool.n_pages(); ++page) {
      if (pool.ref_count(page) < refs[static_cast<size_t>(page)])
        fail("page ", page, " has ref_count ", pool.ref_count(page), " but the table holds ",
             refs[static_cast<size_t>(page)], " references on it");
    }
  }

 private:
  template <class>
  friend class SequenceTable;
  template <class>
  friend class PrefixCache;  // attaches itself as the reclaimer; adopts matched pages into new sequences
  friend struct SequenceTableTestAccess;  // tests corrupt a sequence to prove check() sees it
  friend struct detail::SequenceAccess;  // recv_sequence installs a windowed sequence's pages

  struct Seq {
    std::vector<int64_t> pages;  // [dropped, size): held; [0, dropped): kUnmappedPage (released by the window)
    int64_t dropped = 0;
    int64_t length = 0;
    bool live = false;
    bool swapped = false;  // its tokens are in `host`
    bool holder = false;   // holds another table's swapped sequence
    void* host = nullptr;  // SequenceTable<OL>* it was swapped out to
    int64_t host_seq = -1;
    void (*host_release)(void*, int64_t) = nullptr;
  };

  /// to[dst] <- from[src] (n validated pages, no overlap); if the copy
  /// throws (a device error), frees the n_fresh just-allocated pages `fresh`
  /// of `to` and rethrows, so that nothing leaks.
  template <class ToLayout, class FromLayout>
  static void copy_or_undo(PagedCache<ToLayout>& to, const PagedCache<FromLayout>& from, const int64_t* src,
                           const int64_t* dst, int64_t n, const int64_t* fresh, int64_t n_fresh = 1) {
    try {
      ops::copy_pages(to.storage(), from.storage(), src, dst, n, /*overlap=*/false);
    } catch (...) {
      for (int64_t i = 0; i < n_fresh; ++i) to.pool().free(fresh[i]);
      throw;
    }
  }

  static int64_t n_pages(const Seq& s) noexcept { return static_cast<int64_t>(s.pages.size()); }

  /// The pages `s` holds a reference on (those its window did not release).
  static c10::ArrayRef<int64_t> held(const Seq& s) noexcept {
    return c10::ArrayRef<int64_t>(s.pages.data() + s.dropped, s.pages.size() - static_cast<size_t>(s.dropped));
  }

  /// Leading columns a sequence of `length` tokens no longer needs: those
  /// wholly before the next query's window [length - w + 1, length].
  int64_t dropped_for(int64_t length) const noexcept {
    if (window_ == 0 || length < window_) return 0;
    return (length - window_ + 1) / cache_->page_size();
  }

  /// Pages that hold n_tokens >= 0 tokens (no overflow near INT64_MAX).
  int64_t pages_for(int64_t n_tokens) const noexcept {
    const int64_t page_size = cache_->page_size();
    return n_tokens / page_size + (n_tokens % page_size != 0 ? 1 : 0);
  }

  int64_t new_id() {
    if (!free_ids_.empty()) {
      std::pop_heap(free_ids_.begin(), free_ids_.end(), std::greater<int64_t>());
      const int64_t seq = free_ids_.back();
      free_ids_.pop_back();
      return seq;
    }
    seqs_.emplace_back();
    return static_cast<int64_t>(seqs_.size()) - 1;
  }

  /// Marks `seq` unused; keeps its page vector's memory for the next user.
  void retire(int64_t seq) {
    Seq& s = seqs_[static_cast<size_t>(seq)];
    std::vector<int64_t> pages = std::move(s.pages);
    pages.clear();
    s = Seq{};
    s.pages = std::move(pages);
    free_ids_.push_back(seq);
    std::push_heap(free_ids_.begin(), free_ids_.end(), std::greater<int64_t>());
    --n_live_;
  }

  /// Frees a holder sequence's pages (called by the table that swapped it out).
  static void release_holder(void* table, int64_t seq) {
    auto* self = static_cast<SequenceTable*>(table);
    const c10::ArrayRef<int64_t> pages = held(self->seqs_[static_cast<size_t>(seq)]);
    self->cache_->pool().free_all(pages);
    self->unreferenced(pages.data(), static_cast<int64_t>(pages.size()));
    self->retire(seq);
  }

  const Seq& live(const checks::Caller& caller, int64_t seq) const {
    TORCH_CHECK_INDEX(contains(seq), caller, ": argument 'seq' expected a live sequence id of this table, got ", seq,
                      seq >= 0 && seq < static_cast<int64_t>(seqs_.size()) ? " (released)" : " (unknown)");
    return seqs_[static_cast<size_t>(seq)];
  }
  Seq& live(const checks::Caller& caller, int64_t seq) {
    return const_cast<Seq&>(static_cast<const SequenceTable&>(*this).live(caller, seq));
  }

  void not_holder(const checks::Caller& caller, int64_t seq, const Seq& s) const {
    TORCH_CHECK(!s.holder, caller, ": argument 'seq' expected a sequence this table owns, got sequence ", seq,
                " which holds another table's swapped-out sequence (use swap_in or release on that table)");
  }

  /// A live, resident sequence this table owns: what every mutating call needs.
  Seq& owned(const checks::Caller& caller, int64_t seq) {
    Seq& s = live(caller, seq);
    not_holder(caller, seq, s);
    TORCH_CHECK(!s.swapped, caller, ": argument 'seq' expected a resident sequence, got sequence ", seq,
                " which is swapped out (call swap_in first)");
    return s;
  }

  /// Throws unless every page in `pages` (sequence `seq`'s, from its
  /// column `first` on, in `pool`) is allocated: an engine that frees a
  /// page through the cache while a sequence holds it breaks the table's
  /// bookkeeping.
  void pages_held(const checks::Caller& caller, int64_t seq, c10::ArrayRef<int64_t> pages, const PagePool& pool,
                  int64_t first = 0) const {
    for (size_t j = 0; j < pages.size(); ++j) {
      TORCH_CHECK(pool.is_allocated(pages[j]), caller,
                  ": argument 'seq' expected a sequence whose pages are all allocated, got sequence ", seq,
                  " whose page ", pages[j], " (its page ", first + static_cast<int64_t>(j),
                  ") is free: it was freed through the cache while the table held it");
    }
  }

  template <class OL>
  void other_table(const checks::Caller& caller, const SequenceTable<OL>& host) const {
    TORCH_CHECK(static_cast<const void*>(&host) != static_cast<const void*>(this), caller,
                ": argument 'host' expected another table, got this one");
    TORCH_CHECK(static_cast<const void*>(host.cache_) != static_cast<const void*>(cache_), caller,
                ": argument 'host' expected a table over another cache, got one over this table's cache");
    checks::same_geometry(caller, *host.cache_, *cache_);
  }

  /// Whether n_needed pages can be allocated now: they are free, or the
  /// reclaimer frees exactly the shortfall (only when it can: a false
  /// return has changed nothing).
  bool make_room(int64_t n_needed) noexcept {
    const int64_t shortfall = n_needed - cache_->pool().n_free();
    if (shortfall <= 0) return true;
    if (reclaimer_ == nullptr || reclaimer_->n_reclaimable() < shortfall) return false;
    reclaimer_->reclaim(shortfall);
    return true;
  }

  /// Tells the reclaimer that the table dropped a reference on each of `pages`.
  void unreferenced(c10::ArrayRef<int64_t> pages) noexcept {
    if (reclaimer_ != nullptr) reclaimer_->unreferenced(pages.data(), static_cast<int64_t>(pages.size()));
  }
  void unreferenced(const int64_t* pages, int64_t n) noexcept {
    if (reclaimer_ != nullptr) reclaimer_->unreferenced(pages, n);
  }

  /// A new live sequence that holds `pages` (their references already
  /// taken by the caller) and `length` tokens. Throws only std::bad_alloc,
  /// before any change.
  int64_t adopt(const std::vector<int64_t>& pages, int64_t length) {
    const int64_t seq = new_id();
    Seq& s = seqs_[static_cast<size_t>(seq)];
    try {
      s.pages.assign(pages.begin(), pages.end());
    } catch (...) {
      free_ids_.push_back(seq);
      std::push_heap(free_ids_.begin(), free_ids_.end(), std::greater<int64_t>());
      throw;
    }
    s.length = length;
    s.live = true;
    ++n_live_;
    return seq;
  }

  /// Gives the empty, resident sequence `seq` the pages of columns
  /// [first, first + pages.size()) (their references already taken, the
  /// columns before them released) and `length` tokens, then releases what
  /// this table's window does not keep: first <= dropped_for(length), and
  /// the pages cover the length. Throws only std::bad_alloc, before any change.
  void install(int64_t seq, int64_t first, const std::vector<int64_t>& pages, int64_t length) {
    std::vector<int64_t> row(static_cast<size_t>(first) + pages.size(), kUnmappedPage);
    std::copy(pages.begin(), pages.end(), row.begin() + static_cast<std::ptrdiff_t>(first));
    Seq& s = seqs_[static_cast<size_t>(seq)];
    const int64_t drop = dropped_for(length);
    const c10::ArrayRef<int64_t> gone(row.data() + first, static_cast<size_t>(drop - first));
    cache_->pool().free_all(gone);
    unreferenced(gone);
    std::fill(row.begin() + static_cast<std::ptrdiff_t>(first), row.begin() + static_cast<std::ptrdiff_t>(drop),
              kUnmappedPage);
    s.pages = std::move(row);
    s.dropped = drop;
    s.length = length;
  }

  PagedCache<Layout>* cache_;
  int64_t window_;
  PageReclaimer* reclaimer_ = nullptr;  // the attached PrefixCache, if any
  std::vector<Seq> seqs_;       // indexed by id
  std::vector<int64_t> free_ids_;  // released ids below seqs_.size(): a min-heap
  int64_t n_live_ = 0;
};

}  // namespace pagedkv
