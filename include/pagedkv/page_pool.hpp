// PagePool: reference-counted page allocator over a hierarchical free bitmap.
// Lowest-first and deterministic: the same calls give the same ids on every
// rank and every run, as in the reference's `_free_mask`.
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "pagedkv/bitmap.hpp"

namespace pagedkv {

class PagePool {
 public:
  explicit PagePool(int64_t n_pages) : free_(checked_size(n_pages), /*all_set=*/true),
                                       refs_(static_cast<size_t>(n_pages), 0),
                                       allocated_at_(static_cast<size_t>(n_pages), 0),
                                       n_free_(n_pages) {}

  /// Lowest-numbered free page with ref = 1; -1 when none is free.
  int64_t alloc() noexcept {
    const int64_t page = free_.find_first();
    if (page < 0) return -1;
    take(page);
    return page;
  }

  /// n pages, ascending (each the lowest free); {} and no change when fewer
  /// than n are free.
  std::vector<int64_t> alloc_n(int64_t n) {
    TORCH_CHECK(n >= 0, "pagedkv::PagePool::alloc_n: argument 'n' expected >= 0, got ", n);
    if (n > n_free_) return {};
    std::vector<int64_t> pages(static_cast<size_t>(n));
    free_.take_lowest(n, pages.data());  // the n lowest free pages, ascending: what n alloc()s give
    ++alloc_epoch_;
    for (const int64_t page : pages) {
      refs_[idx(page)] = 1;
      allocated_at_[idx(page)] = alloc_epoch_;
    }
    n_free_ -= n;
    return pages;
  }

  /// ref += 1 on an allocated page (sharing a prefix, forking a beam).
  void retain(int64_t page) {
    check_in_range("retain", page);
    TORCH_CHECK(refs_[idx(page)] > 0, "pagedkv::PagePool::retain: argument 'page' expected an allocated page, got page ",
                page, " which is free (retain of a free page)");
    TORCH_CHECK(refs_[idx(page)] < std::numeric_limits<int32_t>::max(),
                "pagedkv::PagePool::retain: argument 'page' expected ref_count < ",
                std::numeric_limits<int32_t>::max(), ", got page ", page, " at the limit");
    ++refs_[idx(page)];
  }

  /// ref -= 1; the page is free again at 0.
  void free(int64_t page) {
    check_in_range("free", page);
    TORCH_CHECK(refs_[idx(page)] > 0, "pagedkv::PagePool::free: argument 'page' expected an allocated page, got page ",
                page, " which is already free (double free)");
    if (--refs_[idx(page)] == 0) {
      free_.set(page);
      ++n_free_;
      ++free_epoch_;
    }
  }

  /// retain() of every page of a list (a page listed twice gains 2), all or
  /// nothing: on any bad id nothing changes. For forks, which share every
  /// page of a sequence: one tight pass instead of a checked call per page
  /// (bench/NOTES.md, "Bulk reference counts (issue 3, change 9)").
  void retain_all(c10::ArrayRef<int64_t> pages) {
    size_t done = 0;
    for (; done < pages.size(); ++done) {
      const int64_t page = pages[done];
      if (!in_range(page)) break;
      int32_t& ref = refs_[idx(page)];
      if (ref <= 0 || ref == std::numeric_limits<int32_t>::max()) break;
      ++ref;
    }
    if (done == pages.size()) return;
    for (size_t i = 0; i < done; ++i) --refs_[idx(pages[i])];  // undo: nothing changed
    reject_retain_all(pages, done);
  }

  /// free() of every page of a list (a page listed twice loses 2), all or
  /// nothing: on any bad id, or a page listed more times than its ref_count
  /// (a double free), nothing changes. For releasing a sequence's pages.
  void free_all(c10::ArrayRef<int64_t> pages) {
    size_t done = 0;
    const int64_t n_free_before = n_free_;
    for (; done < pages.size(); ++done) {
      const int64_t page = pages[done];
      if (!in_range(page) || refs_[idx(page)] <= 0) break;
      if (--refs_[idx(page)] == 0) {
        free_.set(page);
        ++n_free_;
      }
    }
    if (done == pages.size()) {
      if (n_free_ != n_free_before) ++free_epoch_;
      return;
    }
    for (size_t i = 0; i < done; ++i) {  // undo: nothing changed
      const int64_t page = pages[i];
      if (refs_[idx(page)]++ == 0) {
        free_.clear(page);
        --n_free_;
      }
    }
    reject_free_all(pages, done);
  }

  /// 0 for a free page.
  int64_t ref_count(int64_t page) const {
    check_in_range("ref_count", page);
    return refs_[idx(page)];
  }

  /// Whether `page` is in range and allocated (no throw: for validators).
  bool is_allocated(int64_t page) const noexcept {
    return in_range(page) && refs_[idx(page)] > 0;
  }

  int64_t n_pages() const noexcept { return static_cast<int64_t>(refs_.size()); }
  int64_t n_free() const noexcept { return n_free_; }

  // ---- epochs: what a CUDA view checks instead of re-reading its table ----

  /// Counts the calls that allocated pages; each page keeps the count of
  /// the call that last allocated it.
  uint64_t alloc_epoch() const noexcept { return alloc_epoch_; }
  /// Counts the calls that freed pages (a reference count reaching 0).
  /// While it is unchanged, every page allocated before is still allocated,
  /// by the same allocation.
  uint64_t free_epoch() const noexcept { return free_epoch_; }
  /// Whether `page` (in range) is free now, or was allocated after the pool
  /// stood at alloc_epoch() == `epoch`: freed and reallocated since (no
  /// throw: for validators).
  bool reallocated_since(int64_t page, uint64_t epoch) const noexcept {
    return refs_[idx(page)] <= 0 || allocated_at_[idx(page)] > epoch;
  }

  /// Audits every invariant with a full scan (O(n_pages): for tests and
  /// debugging, not hot paths): the free bitmap and its summary levels agree
  /// (HierarchicalBitmap::audit), a page is free in the bitmap iff its
  /// ref_count is 0, no ref_count is negative, and n_free() is the number of
  /// free pages. Throws c10::Error naming the first violation; changes nothing.
  void check() const {
    TORCH_CHECK(free_.size() == n_pages(), "pagedkv::PagePool::check: the free bitmap has ", free_.size(),
                " bits, expected n_pages = ", n_pages());
    const std::string bitmap_error = free_.audit();
    TORCH_CHECK(bitmap_error.empty(), "pagedkv::PagePool::check: the free bitmap is inconsistent: ", bitmap_error);
    int64_t n_zero = 0;
    for (int64_t page = 0; page < n_pages(); ++page) {
      const int32_t ref = refs_[idx(page)];
      TORCH_CHECK(ref >= 0, "pagedkv::PagePool::check: page ", page, " has ref_count ", ref, ", expected >= 0");
      TORCH_CHECK(free_.test(page) == (ref == 0), "pagedkv::PagePool::check: page ", page, " has ref_count ", ref,
                  " but the free bitmap marks it ", free_.test(page) ? "free" : "allocated");
      n_zero += ref == 0 ? 1 : 0;
    }
    TORCH_CHECK(n_free_ == n_zero, "pagedkv::PagePool::check: n_free() is ", n_free_, " but ", n_zero,
                " pages have ref_count 0");
  }

 private:
  static int64_t checked_size(int64_t n_pages) {
    TORCH_CHECK(n_pages >= 1, "pagedkv::PagePool: argument 'n_pages' expected >= 1, got ", n_pages);
    TORCH_CHECK(n_pages <= std::numeric_limits<int32_t>::max(),
                "pagedkv::PagePool: argument 'n_pages' expected <= ", std::numeric_limits<int32_t>::max(), ", got ",
                n_pages);
    return n_pages;
  }

  static size_t idx(int64_t page) noexcept { return static_cast<size_t>(page); }

  void check_in_range(const char* fn, int64_t page) const {
    TORCH_CHECK_INDEX(in_range(page), "pagedkv::PagePool::", fn,
                      ": argument 'page' expected in [0, ", n_pages(), "), got ", page);
  }

  /// 0 <= page < n_pages (a negative id wraps past the end).
  bool in_range(int64_t page) const noexcept { return static_cast<uint64_t>(page) < refs_.size(); }

  // Why retain_all / free_all stopped at pages[i] (after undoing their
  // work): out of line, so that their loops stay small.

  [[noreturn]] C10_NOINLINE void reject_retain_all(c10::ArrayRef<int64_t> pages, size_t i) const {
    const int64_t page = check_listed_in_range("retain_all", pages, i);
    TORCH_CHECK(refs_[idx(page)] == 0, "pagedkv::PagePool::retain_all: argument 'pages' expected ref_counts < ",
                std::numeric_limits<int32_t>::max(), ", got page ", page, " at pages[", i, "] at the limit");
    TORCH_CHECK(false, "pagedkv::PagePool::retain_all: argument 'pages' expected allocated pages, got page ", page,
                " at pages[", i, "] which is free (retain of a free page)");
  }

  [[noreturn]] C10_NOINLINE void reject_free_all(c10::ArrayRef<int64_t> pages, size_t i) const {
    const int64_t page = check_listed_in_range("free_all", pages, i);
    const auto listed_before = std::count(pages.begin(), pages.begin() + static_cast<std::ptrdiff_t>(i), page);
    TORCH_CHECK(listed_before == 0, "pagedkv::PagePool::free_all: argument 'pages' expected each page at most ",
                "ref_count times, got page ", page, " at pages[", i, "] listed ", listed_before + 1,
                " times with ref_count ", refs_[idx(page)], " (double free)");
    TORCH_CHECK(false, "pagedkv::PagePool::free_all: argument 'pages' expected allocated pages, got page ", page,
                " at pages[", i, "] which is already free (double free)");
  }

  int64_t check_listed_in_range(const char* fn, c10::ArrayRef<int64_t> pages, size_t i) const {
    TORCH_CHECK_INDEX(in_range(pages[i]), "pagedkv::PagePool::", fn, ": argument 'pages' expected ids in [0, ",
                      n_pages(), "), got ", pages[i], " at pages[", i, "]");
    return pages[i];
  }

  void take(int64_t page) noexcept {
    free_.clear(page);
    refs_[idx(page)] = 1;
    allocated_at_[idx(page)] = ++alloc_epoch_;
    --n_free_;
  }

  friend struct PagePoolTestAccess;  // tests corrupt the state to prove check() sees it

  HierarchicalBitmap free_;             // bit set = page free
  std::vector<int32_t> refs_;            // [n_pages]
  std::vector<uint64_t> allocated_at_;   // [n_pages]: alloc_epoch_ of the page's last allocation
  int64_t n_free_;
  uint64_t alloc_epoch_ = 0;
  uint64_t free_epoch_ = 0;
};

}  // namespace pagedkv
