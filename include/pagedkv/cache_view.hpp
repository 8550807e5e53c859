// CacheView: what attention layers receive. It binds a page table and the
// lengths to read, so attention code never sees page tables or lengths.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <utility>

namespace pagedkv {

template <class Layout>
class PagedCache;

namespace cuda {
struct BoundTables;
}

/// A batch's window onto a PagedCache: cheap to copy (a pointer and three
/// handles). Get one from PagedCache::bind; it must not outlive the cache.
/// On the CPU (and the ATen path) the page table and lengths are shared,
/// not copied: changes the engine makes to them in place are seen by the
/// next call. On a cache that runs the CUDA kernels the view is a snapshot
/// of bind: bind validates the table and lengths once and copies them to
/// the device, and the per-layer calls read those copies (docs/gpu.md).
template <class Layout>
class CacheView {
 public:
  using layout_type = Layout;

  /// Token s of every sequence goes to logical position start_pos + s.
  void write(int64_t layer, int64_t start_pos, const at::Tensor& k, const at::Tensor& v) const {
    if (bound_ != nullptr) return cache_->write_bound(*this, layer, at::Tensor(), start_pos, k, v);
    cache_->write(layer, page_table_, start_pos, k, v);
  }

  /// Token s of sequence b goes to logical position start_pos[b] + s.
  void write(int64_t layer, const at::Tensor& start_pos, const at::Tensor& k, const at::Tensor& v) const {
    if (bound_ != nullptr) return cache_->write_bound(*this, layer, start_pos, 0, k, v);
    cache_->write(layer, page_table_, start_pos, k, v);
  }

  /// k, v as contiguous [B, T, H, D]: T = total_len (or every mapped token
  /// when total_len is 0), or max(lengths) with zeros past each length.
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer) const {
    if (bound_ != nullptr) return cache_->gather_bound(*this, layer);
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
  /// What bind made for the CUDA kernels (host snapshots, device copies);
  /// null for a view of a cache that does not run them.
  const cuda::BoundTables* bound_tables() const noexcept { return bound_.get(); }

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
  std::shared_ptr<const cuda::BoundTables> bound_;  // CUDA kernels: bind's snapshot and device copies
};

}  // namespace pagedkv
