// PagedCache<Layout>: a PagePool plus K/V storage [n_layers, n_pages, <page>]
// with page-table-indirected write and gather. Every public call validates
// all of its input before it changes anything.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "pagedkv/cache_view.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/cpu/storage.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/cuda/executor.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/ops/bind.hpp"
#include "pagedkv/ops/page_copy.hpp"
#include "pagedkv/ops/storage.hpp"
#include "pagedkv/ops/write_gather.hpp"
#include "pagedkv/page_pool.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {

/// Which kernels a thread's calls use (ops/backend.hpp).
using ops::Backend;
using ops::ScopedBackend;

template <class Layout = NHD>
class PagedCache {
 public:
  PagedCache(int64_t n_layers, int64_t n_pages, int64_t page_size, int64_t n_kv_heads, int64_t head_dim,
             at::TensorOptions options = at::TensorOptions().dtype(at::kHalf))
      : PagedCache(n_layers, n_pages, page_size, n_kv_heads, head_dim, options, KVQuant{}) {}

  /// Pages of K and/or V quantized to one byte per element with a float32
  /// scale per (token, head) (kv_format.hpp). options.dtype() stays the
  /// dtype write accepts and gather returns (float32, float16 or bfloat16
  /// when a side is quantized).
  PagedCache(int64_t n_layers, int64_t n_pages, int64_t page_size, int64_t n_kv_heads, int64_t head_dim,
             at::TensorOptions options, KVQuant quant)
      : geometry_(checked_geometry(n_layers, n_pages, page_size, n_kv_heads, head_dim, options, quant)),
        n_layers_(n_layers),
        pool_(n_pages),
        quant_(quant),
        dtype_(options.dtype().toScalarType()),
        k_cache_(cpu::zeroed_storage(storage_shape(n_layers, n_pages),
                                         options.dtype(storage_dtype(quant.k, dtype_)).requires_grad(false))),
        v_cache_(cpu::zeroed_storage(storage_shape(n_layers, n_pages),
                                         options.dtype(storage_dtype(quant.v, dtype_)).requires_grad(false))),
        k_scales_(scales_storage(quant.k, n_layers, n_pages, options)),
        v_scales_(scales_storage(quant.v, n_layers, n_pages, options)) {}

  /// Not copyable: a copy would share the storage tensors but not the pool,
  /// and two pools handing out the same pages overwrite each other's data.
  PagedCache(const PagedCache&) = delete;
  PagedCache& operator=(const PagedCache&) = delete;
  /// Movable; views bound to the moved-from cache must not be used after.
  PagedCache(PagedCache&&) noexcept = default;
  PagedCache& operator=(PagedCache&&) noexcept = default;
  ~PagedCache() = default;

  // ---- pool, forwarded to the owned PagePool ----
  int64_t alloc() { return pool_.alloc(); }
  std::vector<int64_t> alloc_n(int64_t n) { return pool_.alloc_n(n); }
  void free(int64_t page) { pool_.free(page); }
  void retain(int64_t page) { pool_.retain(page); }
  int64_t ref_count(int64_t page) const { return pool_.ref_count(page); }
  int64_t n_free() const { return pool_.n_free(); }
  PagePool& pool() { return pool_; }
  const PagePool& pool() const { return pool_; }

  // ---- page-table-indirected kernels ----

  /// Token s of every sequence goes to logical position start_pos + s.
  void write(int64_t layer,
             const at::Tensor& page_table,  // [B, max_pages] int32/int64
             int64_t start_pos,
             const at::Tensor& k,  // [B, S, H, D], any strides
             const at::Tensor& v)  // [B, S, H, D], any strides
  {
    write_rows(layer, page_table, nullptr, nullptr, start_pos, k, v);
  }

  /// Token s of sequence b goes to logical position start_pos[b] + s.
  void write(int64_t layer,
             const at::Tensor& page_table,  // [B, max_pages] int32/int64
             const at::Tensor& start_pos,   // [B] int32/int64
             const at::Tensor& k,           // [B, S, H, D], any strides
             const at::Tensor& v)           // [B, S, H, D], any strides
  {
    write_rows(layer, page_table, nullptr, &start_pos, 0, k, v);
  }

  /// k, v as contiguous [B, T, H, D], T = page_size x the leading columns
  /// that map a page in some row; unmapped (-1) pages read as zeros.
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer,
                                           const at::Tensor& page_table)  // [B, max_pages]
      const {
    return gather_rows(layer, page_table, nullptr, nullptr, 0);
  }

  /// k, v as contiguous [B, max(lengths), H, D]; positions at or beyond a
  /// sequence's length are zeros.
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer,
                                           const at::Tensor& page_table,  // [B, max_pages]
                                           const at::Tensor& lengths)     // [B]
      const {
    return gather_rows(layer, page_table, nullptr, &lengths, 0);
  }

  /// A view whose gather returns the first total_len tokens (0 = all).
  CacheView<Layout> bind(const at::Tensor& page_table, int64_t total_len = 0) {
    const checks::Caller caller{"PagedCache", Layout::name, "bind"};
    checks::page_table(caller, page_table, device());
    checks::non_negative(caller, "total_len", total_len);
    const at::Tensor host_table = on_host(page_table);
    check_total_len(caller, host_table, total_len);
    CacheView<Layout> view(this, page_table, total_len);
    const ops::Storage s = storage();
    if (ops::bind_copies_tables(s)) {
      checks::not_capturing(caller, cuda::capturing(device()));
      view.bound_ = ops::bind_tables(s, pool_.alloc_epoch(), pool_.free_epoch(), *bind_buffers_, host_table, nullptr,
                                     /*per_shape=*/false);
    }
    return view;
  }

  /// A view whose gather uses per-sequence lengths [B].
  CacheView<Layout> bind(const at::Tensor& page_table, const at::Tensor& lengths) {
    return bind(page_table, lengths, BindBuffers::fresh);
  }

  /// bind(page_table, lengths), with the device copies the CUDA kernels
  /// read put in `buffers`: the view's own (fresh), or the memory the cache
  /// keeps for this shape (per_shape), which a captured CUDA graph reads
  /// (docs/gpu.md). Ignored by caches that do not run the CUDA kernels.
  CacheView<Layout> bind(const at::Tensor& page_table, const at::Tensor& lengths, BindBuffers buffers) {
    const checks::Caller caller{"PagedCache", Layout::name, "bind"};
    checks::page_table(caller, page_table, device());
    const std::vector<int64_t> lens = checks::per_sequence(caller, "lengths", lengths, page_table.size(0), device());
    const at::Tensor host_table = on_host(page_table);
    // Leading -1 columns are a windowed SequenceTable's released pages;
    // gather, writes and attention without a window still refuse them.
    bool leading_unmapped = false;
    visit_page_table(host_table, [&](const auto& table) {
      for (int64_t row = 0; row < table.rows; ++row) {
        const int64_t length = lens[static_cast<size_t>(row)];
        checks::mapped_window(caller, table, row, length, page_size(), pool_);
        leading_unmapped = leading_unmapped || (length > 0 && table(row, 0) == kUnmappedPage);
      }
    });
    CacheView<Layout> view(this, page_table, lengths);
    const ops::Storage s = storage();
    if (ops::bind_copies_tables(s)) {
      checks::not_capturing(caller, cuda::capturing(device()));
      std::shared_ptr<cuda::BoundTables> bound = ops::bind_tables(
          s, pool_.alloc_epoch(), pool_.free_epoch(), *bind_buffers_, host_table, &lens, buffers == BindBuffers::per_shape);
      bound->leading_unmapped = leading_unmapped;
      view.bound_ = std::move(bound);
    }
    return view;
  }

  // ---- whole-page copies (page_copy.hpp) ----

  /// dst[i] <- src[i] for every layer, k and v. src, dst: 1-D int32/int64 of
  /// equal length, on cpu or the cache's device. src pages allocated; dst
  /// pages allocated, distinct and unshared (ref_count 1). A page may be in
  /// both lists: every page is read before any is written (so src = {a, b},
  /// dst = {b, a} swaps two pages).
  void copy_pages(const at::Tensor& src, const at::Tensor& dst) {
    copy_checked(checks::Caller{"PagedCache", Layout::name, "copy_pages"}, *this, src, dst);
  }

  /// this[dst[i]] <- other[src[i]] for every layer, k and v. other: the same
  /// n_layers, page_size, n_kv_heads, head_dim and dtype; any device, either
  /// layout (pages are relaid out). src is checked against other's pool, dst
  /// against this one's (as in copy_pages); each on cpu or either device.
  template <class OtherLayout>
  void copy_pages_from(const PagedCache<OtherLayout>& other, const at::Tensor& src, const at::Tensor& dst) {
    copy_checked(checks::Caller{"PagedCache", Layout::name, "copy_pages_from"}, other, src, dst);
  }

  /// [n_layers, n_pages, <page shape>]: the cache's dtype, or codes (kByte
  /// for fp8 e4m3, kChar for int8) when K is quantized.
  const at::Tensor& k_cache() const { return k_cache_; }
  /// [n_layers, n_pages, <page shape>]: as k_cache() for V.
  const at::Tensor& v_cache() const { return v_cache_; }
  /// How K and V are stored.
  KVQuant quant() const { return quant_; }
  /// [n_layers, n_pages, page_size * n_kv_heads] float32, one scale per
  /// (token slot, head) in the layout's order (NHD: token-major, HND:
  /// head-major); undefined when K is native.
  const at::Tensor& k_scales() const { return k_scales_; }
  /// As k_scales() for V.
  const at::Tensor& v_scales() const { return v_scales_; }
  /// The dtype write accepts and gather returns.
  at::ScalarType dtype() const { return dtype_; }
  int64_t n_layers() const { return n_layers_; }
  int64_t n_pages() const { return pool_.n_pages(); }
  int64_t page_size() const { return geometry_.page_size; }
  int64_t n_kv_heads() const { return geometry_.n_heads; }
  int64_t head_dim() const { return geometry_.head_dim; }
  /// The layout resolved into strides.
  const PageGeometry& geometry() const { return geometry_; }
  at::Device device() const { return k_cache_.device(); }
  /// The pages as the operations layer takes them (ops/storage.hpp).
  ops::Storage storage() const {
    return {k_cache_, v_cache_, k_scales_, v_scales_, quant_, geometry_, dtype_};
  }

  /// Audits every invariant (O(n_pages): for tests and debugging): the
  /// pool's (PagePool::check), and that k_cache() and v_cache() are still
  /// contiguous, strided [n_layers, n_pages, <page>] tensors, backed by
  /// enough storage, of one dtype on one device. Throws c10::Error naming the
  /// first violation; changes nothing.
  void check() const {
    pool_.check();
    const checks::Caller caller{"PagedCache", Layout::name, "check"};
    check_storage(caller, "k_cache", k_cache_);
    check_storage(caller, "v_cache", v_cache_);
    TORCH_CHECK(k_cache_.scalar_type() == storage_dtype(quant_.k, dtype_), caller, ": k_cache has dtype ",
                k_cache_.scalar_type(), ", expected ", storage_dtype(quant_.k, dtype_), " (K format ",
                format_name(quant_.k), ", dtype ", dtype_, ")");
    if (quant_.v == quant_.k) {
      TORCH_CHECK(v_cache_.scalar_type() == k_cache_.scalar_type(), caller, ": v_cache has dtype ",
                  v_cache_.scalar_type(), ", expected k_cache's ", k_cache_.scalar_type());
    } else {
      TORCH_CHECK(v_cache_.scalar_type() == storage_dtype(quant_.v, dtype_), caller, ": v_cache has dtype ",
                  v_cache_.scalar_type(), ", expected ", storage_dtype(quant_.v, dtype_), " (V format ",
                  format_name(quant_.v), ", dtype ", dtype_, ")");
    }
    TORCH_CHECK(v_cache_.device() == k_cache_.device(), caller, ": v_cache is on ", v_cache_.device(),
                ", expected k_cache's ", k_cache_.device());
    check_scales(caller, "k_scales", k_scales_, quant_.k);
    check_scales(caller, "v_scales", v_scales_, quant_.v);
  }

 private:
  friend class CacheView<Layout>;

  static PageGeometry checked_geometry(int64_t n_layers, int64_t n_pages, int64_t page_size, int64_t n_kv_heads,
                                       int64_t head_dim, const at::TensorOptions& options, const KVQuant& quant) {
    const checks::Caller caller{"PagedCache", Layout::name, "PagedCache"};
    checks::positive(caller, "n_layers", n_layers);
    checks::positive(caller, "page_size", page_size);
    checks::positive(caller, "n_kv_heads", n_kv_heads);
    checks::positive(caller, "head_dim", head_dim);
    checks::positive(caller, "n_pages", n_pages);
    // Before any product of the sizes is formed (the geometry, the storage shape).
    checks::storage_fits(caller, {n_layers, n_pages, page_size, n_kv_heads, head_dim},
                         static_cast<int64_t>(options.dtype().itemsize()));
    if (is_quantized(quant)) {
      const at::ScalarType dtype = options.dtype().toScalarType();
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, caller,
                  ": argument 'options' expected dtype float32, float16 or bfloat16 for quantized pages (K ",
                  format_name(quant.k), ", V ", format_name(quant.v), "), got ", dtype);
      checks::storage_fits(caller, {n_layers, n_pages, page_size, n_kv_heads}, static_cast<int64_t>(sizeof(float)));
    }
    return PageGeometry::of<Layout>(page_size, n_kv_heads, head_dim);
  }

  std::vector<int64_t> storage_shape(int64_t n_layers, int64_t n_pages) const {
    const auto page = Layout::page_shape(geometry_.page_size, geometry_.n_heads, geometry_.head_dim);
    return {n_layers, n_pages, page[0], page[1], page[2]};
  }

  static at::Tensor on_host(const at::Tensor& t) { return t.device().is_cpu() ? t : t.to(at::kCPU); }

  at::Tensor scales_storage(KVFormat format, int64_t n_layers, int64_t n_pages,
                            const at::TensorOptions& options) const {
    if (!is_quantized(format)) return at::Tensor();
    return cpu::zeroed_storage({n_layers, n_pages, geometry_.page_size * geometry_.n_heads},
                                   options.dtype(at::kFloat).requires_grad(false));
  }

  void check_scales(const checks::Caller& caller, const char* name, const at::Tensor& t, KVFormat format) const {
    if (!is_quantized(format)) {
      TORCH_CHECK(!t.defined(), caller, ": ", name, " is defined, expected undefined for a native side");
      return;
    }
    TORCH_CHECK(t.defined(), caller, ": ", name, " is undefined, expected scales for format ", format_name(format));
    const std::vector<int64_t> shape{n_layers_, n_pages(), page_size() * n_kv_heads()};
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), caller, ": ", name, " has shape ", t.sizes(), ", expected ",
                at::IntArrayRef(shape), " [n_layers, n_pages, page_size * n_kv_heads]");
    TORCH_CHECK(t.scalar_type() == at::kFloat, caller, ": ", name, " has dtype ", t.scalar_type(),
                ", expected Float");
    TORCH_CHECK(t.is_contiguous(), caller, ": ", name, " has strides ", t.strides(), ", expected contiguous");
    TORCH_CHECK(t.device() == k_cache_.device(), caller, ": ", name, " is on ", t.device(), ", expected k_cache's ",
                k_cache_.device());
  }

  void check_storage(const checks::Caller& caller, const char* name, const at::Tensor& t) const {
    TORCH_CHECK(t.defined(), caller, ": ", name, " is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, caller, ": ", name, " has layout ", t.layout(), ", expected strided");
    const std::vector<int64_t> shape = storage_shape(n_layers_, n_pages());
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), caller, ": ", name, " has shape ", t.sizes(), ", expected ",
                at::IntArrayRef(shape), " [n_layers, n_pages, <", Layout::name, " page>]");
    TORCH_CHECK(t.is_contiguous(), caller, ": ", name, " has strides ", t.strides(), ", expected contiguous");
    const auto needed = static_cast<size_t>((t.storage_offset() + t.numel()) * t.element_size());
    TORCH_CHECK(t.has_storage() && t.storage().nbytes() >= needed, caller, ": ", name, " needs ", needed,
                " bytes of storage, has ", t.has_storage() ? t.storage().nbytes() : 0);
  }

  void check_total_len(const checks::Caller& caller, const at::Tensor& host_table, int64_t total_len) const {
    visit_page_table(host_table, [&](const auto& table) {
      const int64_t mapped = checks::mapped_columns(table) * page_size();
      TORCH_CHECK_INDEX(total_len <= mapped, caller, ": argument 'total_len' expected <= ", mapped,
                        " (the tokens the page table maps), got ", total_len);
    });
  }

  /// The table a call validates: a bound view's snapshot where the call
  /// reads it (ops::table_of), else the caller's tensor.
  static const at::Tensor& checked_table(const ops::Storage& s, const at::Tensor& page_table,
                                         const cuda::BoundTables* bound) {
    return bound != nullptr && ops::bind_copies_tables(s) ? bound->host_table : page_table;
  }

  /// Every write: the checks, then ops::write. The table is the caller's,
  /// or a view's (`bound`: bind's snapshot and device copies of a view
  /// bound for the CUDA kernels, checked against the snapshot); the start
  /// positions are `*start_tensor` [B] or, when it is null, `start_scalar`.
  void write_rows(int64_t layer, const at::Tensor& page_table, const cuda::BoundTables* bound,
                  const at::Tensor* start_tensor, int64_t start_scalar, const at::Tensor& k, const at::Tensor& v) {
    const checks::Caller caller{"PagedCache", Layout::name, "write"};
    const ops::Storage s = storage();
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, checked_table(s, page_table, bound), device());
    const ops::Table table = ops::table_of(s, page_table, bound);
    const int64_t batch = table.rows();
    checks::key_values(caller, k, v, batch, geometry_, dtype(), device());
    ops::WriteStarts where;
    if (start_tensor != nullptr) {
      if (table.bound != nullptr && !start_tensor->device().is_cpu()) {
        checks::not_capturing(caller, cuda::capturing(device()));
      }
      where.starts = checks::per_sequence(caller, "start_pos", *start_tensor, batch, device());
    } else {
      checks::non_negative(caller, "start_pos", start_scalar);
      where.starts.assign(static_cast<size_t>(batch), start_scalar);
      where.one_start = true;
    }
    const int64_t n_tokens = k.size(1);
    visit_page_table(table.host, [&](const auto& rows) {
      for (int64_t row = 0; row < rows.rows; ++row) {
        checks::write_range(caller, rows, row, where.starts[static_cast<size_t>(row)], n_tokens, page_size(), pool_);
      }
      if (table.bound == nullptr) return;
      const PageDivisor pages(page_size());
      checks::bound_view_current(caller, *table.bound, rows, pool_, [&](int64_t row) {  // the pages it writes
        const int64_t first = where.starts[static_cast<size_t>(row)];
        if (n_tokens == 0) return std::make_pair(int64_t{0}, int64_t{0});
        return std::make_pair(pages.column(first), pages.column(first + n_tokens - 1) + 1);
      });
    });
    if (table.bound != nullptr && start_tensor != nullptr) {
      const std::vector<int64_t>& lengths = table.bound->host_lengths;
      bool tail = !lengths.empty();
      for (size_t row = 0; tail && row < lengths.size(); ++row) tail = where.starts[row] + n_tokens == lengths[row];
      where.bound_tail = tail;
      if (!tail) checks::tail_in_capture(caller, cuda::capturing(device()), n_tokens);
    }
    // Validated: from here on nothing throws (but a device error).
    ops::write(s, layer, table, where, k, v);
  }

  /// Every gather: the checks, then ops::gather. The tokens read: the
  /// lengths (`*lengths` [B], or a bound view's), else the first
  /// `total_len`, else (0) every token of the leading mapped columns.
  std::pair<at::Tensor, at::Tensor> gather_rows(int64_t layer, const at::Tensor& page_table,
                                                const cuda::BoundTables* bound, const at::Tensor* lengths,
                                                int64_t total_len) const {
    const bool prefix = total_len > 0 && lengths == nullptr;
    const checks::Caller caller{prefix ? "CacheView" : "PagedCache", Layout::name, "gather"};
    const ops::Storage s = storage();
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, checked_table(s, page_table, bound), device());
    const ops::Table table = ops::table_of(s, page_table, bound);
    std::vector<int64_t> lens;
    const bool bound_lengths = table.bound != nullptr && lengths != nullptr;
    if (bound_lengths) {
      lens = table.bound->host_lengths;
    } else if (lengths != nullptr) {
      lens = checks::per_sequence(caller, "lengths", *lengths, table.rows(), device());
    }
    if (prefix) check_total_len(caller, table.host, total_len);
    const int64_t n_tokens = visit_page_table(table.host, [&](const auto& rows) {
      if (lengths != nullptr) {
        if (table.bound == nullptr) {
          for (int64_t row = 0; row < rows.rows; ++row) {
            checks::mapped_prefix(caller, rows, row, lens[static_cast<size_t>(row)], page_size(), pool_);
          }
        } else {
          for (int64_t row = 0; table.bound->leading_unmapped && row < rows.rows; ++row) {  // bind let those through
            checks::mapped_prefix(caller, rows, row, lens[static_cast<size_t>(row)], page_size(), pool_);
          }
          checks::bound_view_current(caller, *table.bound, rows, pool_, [&](int64_t row) {
            return std::make_pair(int64_t{0}, (lens[static_cast<size_t>(row)] + page_size() - 1) / page_size());
          });
        }
        return lens.empty() ? int64_t{0} : *std::max_element(lens.begin(), lens.end());
      }
      const int64_t tokens = prefix ? total_len : checks::mapped_columns(rows) * page_size();
      const int64_t cols = (tokens + page_size() - 1) / page_size();
      checks::readable_columns(caller, rows, cols, pool_);
      if (table.bound != nullptr) {
        checks::bound_view_current(caller, *table.bound, rows, pool_,
                                   [cols](int64_t) { return std::make_pair(int64_t{0}, cols); });
      }
      lens.assign(static_cast<size_t>(rows.rows), tokens);
      return tokens;
    });
    // Validated: from here on nothing throws (but a device error).
    return ops::gather(s, layer, table, lens, bound_lengths, n_tokens, *outputs_);
  }

  /// Validates and copies this[dst[i]] <- from[src[i]].
  template <class FromLayout>
  void copy_checked(const checks::Caller& caller, const PagedCache<FromLayout>& from, const at::Tensor& src,
                    const at::Tensor& dst) {
    checks::same_geometry(caller, *this, from);
    const std::vector<int64_t> src_pages = checks::page_list(caller, "src", src, from.device(), device());
    const std::vector<int64_t> dst_pages = checks::page_list(caller, "dst", dst, device(), from.device());
    const bool overlap = checks::copy_lists(caller, src_pages, dst_pages, from.pool(), pool_);
    ops::copy_pages(storage(), from.storage(), src_pages.data(), dst_pages.data(),
                    static_cast<int64_t>(src_pages.size()), overlap);
  }


  PageGeometry geometry_;
  int64_t n_layers_;
  PagePool pool_;
  KVQuant quant_;
  at::ScalarType dtype_;  // what write accepts and gather returns
  at::Tensor k_cache_;    // [n_layers, n_pages, <page>]
  at::Tensor v_cache_;    // [n_layers, n_pages, <page>]
  at::Tensor k_scales_;   // [n_layers, n_pages, page_size * n_kv_heads] float32; undefined for native K
  at::Tensor v_scales_;   // [n_layers, n_pages, page_size * n_kv_heads] float32; undefined for native V
  // Storage of the last CPU gather's outputs, reused once the caller drops them.
  std::shared_ptr<cpu::OutputRecycler> outputs_ = std::make_shared<cpu::OutputRecycler>();
  // The device buffers of BindBuffers::per_shape binds, by shape.
  std::shared_ptr<cuda::BindBufferSets> bind_buffers_ = std::make_shared<cuda::BindBufferSets>();
};

}  // namespace pagedkv
