// CacheView: what attention layers receive. It binds a page table and the
// lengths to read, so attention code never sees page tables or lengths.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace pagedkv {

template <class Layout>
class PagedCache;

/// A batch's window onto a PagedCache: cheap to copy (a pointer and two
/// tensor handles). Get one from PagedCache::bind; it must not outlive the
/// cache. The page table and lengths are shared, not copied: changes the
/// engine makes to them in place are seen by the next call.
template <class Layout>
class CacheView {
 public:
  /// Token s of every sequence goes to logical position start_pos + s.
  void write(int64_t layer, int64_t start_pos, const at::Tensor& k, const at::Tensor& v) const {
    cache_->write(layer, page_table_, start_pos, k, v);
  }

  /// Token s of sequence b goes to logical position start_pos[b] + s.
  void write(int64_t layer, const at::Tensor& start_pos, const at::Tensor& k, const at::Tensor& v) const {
    cache_->write(layer, page_table_, start_pos, k, v);
  }

  /// k, v as contiguous [B, T, H, D]: T = total_len (or every mapped token
  /// when total_len is 0), or max(lengths) with zeros past each length.
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer) const {
    if (lengths_.defined()) return cache_->gather(layer, page_table_, lengths_);
    if (total_len_ > 0) return cache_->gather_prefix(layer, page_table_, total_len_);
    return cache_->gather(layer, page_table_);
  }

  PagedCache<Layout>& cache() const noexcept { return *cache_; }
  /// [B, max_pages], int32 or int64.
  const at::Tensor& page_table() const noexcept { return page_table_; }
  /// [B] when bound with per-sequence lengths; undefined otherwise.
  const at::Tensor& lengths() const noexcept { return lengths_; }
  /// Tokens read when bound with a total length (0 = every mapped token).
  int64_t total_len() const noexcept { return total_len_; }

 private:
  friend class PagedCache<Layout>;

  CacheView(PagedCache<Layout>* cache, at::Tensor page_table, int64_t total_len)
      : cache_(cache), page_table_(std::move(page_table)), total_len_(total_len) {}
  CacheView(PagedCache<Layout>* cache, at::Tensor page_table, at::Tensor lengths)
      : cache_(cache), page_table_(std::move(page_table)), lengths_(std::move(lengths)) {}

  PagedCache<Layout>* cache_;
  at::Tensor page_table_;  // [B, max_pages]
  at::Tensor lengths_;     // [B] or undefined
  int64_t total_len_ = 0;
};

}  // namespace pagedkv
