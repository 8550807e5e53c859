// CacheView: what attention layers receive. It binds a page table and the
// lengths to read, so attention code never sees page tables or lengths.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "pagedkv/cuda/bound_tables.hpp"

namespace pagedkv {

/// Where bind puts the device copies of its page table and lengths (caches
/// that run the CUDA kernels; ignored elsewhere).
enum class BindBuffers {
  /// Memory of the view's own: views never disturb each other.
  fresh,
  /// The memory the cache keeps for binds of this shape (batch, max_pages,
  /// table dtype): a CUDA graph captured with an earlier view of the shape
  /// reads this bind's table and lengths when replayed. An earlier view
  /// bound into the same memory throws from then on.
  per_shape,
};


template <class Layout>
class PagedCache;


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
    cache_->write_rows(layer, page_table_, bound_.get(), nullptr, start_pos, k, v);
  }

  /// Token s of sequence b goes to logical position start_pos[b] + s.
  void write(int64_t layer, const at::Tensor& start_pos, const at::Tensor& k, const at::Tensor& v) const {
    cache_->write_rows(layer, page_table_, bound_.get(), &start_pos, 0, k, v);
  }

  /// k, v as contiguous [B, T, H, D]: T = total_len (or every mapped token
  /// when total_len is 0), or max(lengths) with zeros past each length.
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer) const {
    return cache_->gather_rows(layer, page_table_, bound_.get(), lengths_.defined() ? &lengths_ : nullptr,
                               total_len_);
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
