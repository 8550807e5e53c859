// PageReclaimer: the one hook through which a SequenceTable's allocations
// reach pages that something else holds only for reuse (PrefixCache's
// cached pages). A table has at most one; without one it behaves exactly as
// if this header did not exist.
//
// The table calls, on its own cache's pool:
// - n_reclaimable() before an allocation the free pages cannot satisfy: if
//   free + reclaimable pages are enough, reclaim(shortfall) frees exactly
//   the shortfall first, otherwise the call fails with nothing changed;
// - unreferenced(pages) after it dropped one reference on each of `pages`
//   (release, swap_out, copy-on-write), so that the reclaimer learns which
//   of its pages nobody else holds any more.
#pragma once

#include <cstdint>

namespace pagedkv {

class PageReclaimer {
 public:
  /// Pages reclaim() could free now (repeatedly: freeing some may make others reclaimable).
  virtual int64_t n_reclaimable() const noexcept = 0;
  /// Frees exactly n_pages pages; 0 <= n_pages <= n_reclaimable().
  virtual void reclaim(int64_t n_pages) noexcept = 0;
  /// pages: [n], distinct; the table just dropped one reference on each.
  virtual void unreferenced(const int64_t* pages, int64_t n) noexcept = 0;

 protected:
  PageReclaimer() = default;
  PageReclaimer(const PageReclaimer&) = default;
  PageReclaimer& operator=(const PageReclaimer&) = default;
  ~PageReclaimer() = default;  // never deleted through this interface
};

}  // namespace pagedkv
