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
#include "pagedkv/cpu/quant/kernels.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/cuda/cache_ops.hpp"
#include "pagedkv/generic/quant_kernels.hpp"
#include "pagedkv/kernels.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_copy.hpp"
#include "pagedkv/page_pool.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {

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
        k_cache_(kernels::zeroed_storage(storage_shape(n_layers, n_pages),
                                         options.dtype(storage_dtype(quant.k, dtype_)).requires_grad(false))),
        v_cache_(kernels::zeroed_storage(storage_shape(n_layers, n_pages),
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
    const checks::Caller caller{"PagedCache", Layout::name, "write"};
    check_write_args(caller, layer, page_table, k, v);
    checks::non_negative(caller, "start_pos", start_pos);
    write_checked(caller, layer, page_table, std::vector<int64_t>(static_cast<size_t>(k.size(0)), start_pos), k, v);
  }

  /// Token s of sequence b goes to logical position start_pos[b] + s.
  void write(int64_t layer,
             const at::Tensor& page_table,  // [B, max_pages] int32/int64
             const at::Tensor& start_pos,   // [B] int32/int64
             const at::Tensor& k,           // [B, S, H, D], any strides
             const at::Tensor& v)           // [B, S, H, D], any strides
  {
    const checks::Caller caller{"PagedCache", Layout::name, "write"};
    check_write_args(caller, layer, page_table, k, v);
    write_checked(caller, layer, page_table, checks::per_sequence(caller, "start_pos", start_pos, k.size(0), device()),
                  k, v);
  }

  /// k, v as contiguous [B, T, H, D], T = page_size x the leading columns
  /// that map a page in some row; unmapped (-1) pages read as zeros.
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer,
                                           const at::Tensor& page_table)  // [B, max_pages]
      const {
    const checks::Caller caller{"PagedCache", Layout::name, "gather"};
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, page_table, device());
    const at::Tensor host_table = on_host(page_table);
    return visit_page_table(host_table, [&](const auto& table) {
      const int64_t cols = checks::mapped_columns(table);
      checks::readable_columns(caller, table, cols, pool_);
      const int64_t n_tokens = cols * page_size();
      return gather_checked(layer, page_table, table, std::vector<int64_t>(static_cast<size_t>(table.rows), n_tokens),
                            n_tokens);
    });
  }

  /// k, v as contiguous [B, max(lengths), H, D]; positions at or beyond a
  /// sequence's length are zeros.
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer,
                                           const at::Tensor& page_table,  // [B, max_pages]
                                           const at::Tensor& lengths)     // [B]
      const {
    const checks::Caller caller{"PagedCache", Layout::name, "gather"};
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, page_table, device());
    const std::vector<int64_t> lens = checks::per_sequence(caller, "lengths", lengths, page_table.size(0), device());
    const at::Tensor host_table = on_host(page_table);
    return visit_page_table(host_table, [&](const auto& table) {
      for (int64_t row = 0; row < table.rows; ++row) {
        checks::mapped_prefix(caller, table, row, lens[static_cast<size_t>(row)], page_size(), pool_);
      }
      const int64_t n_tokens = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
      return gather_checked(layer, page_table, table, lens, n_tokens);
    });
  }

  /// A view whose gather returns the first total_len tokens (0 = all).
  CacheView<Layout> bind(const at::Tensor& page_table, int64_t total_len = 0) {
    const checks::Caller caller{"PagedCache", Layout::name, "bind"};
    checks::page_table(caller, page_table, device());
    checks::non_negative(caller, "total_len", total_len);
    const at::Tensor host_table = on_host(page_table);
    check_total_len(caller, host_table, total_len);
    CacheView<Layout> view(this, page_table, total_len);
    if (kernels::use_cuda_kernels(device())) {
      checks::not_capturing(caller, cuda::capturing(device()));
      view.bound_ = cuda::bind_tables(*this, *bind_buffers_, host_table, nullptr, BindBuffers::fresh);
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
    if (kernels::use_cuda_kernels(device())) {
      checks::not_capturing(caller, cuda::capturing(device()));
      std::shared_ptr<cuda::BoundTables> bound = cuda::bind_tables(*this, *bind_buffers_, host_table, &lens, buffers);
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
    page_copy::copy_checked(checks::Caller{"PagedCache", Layout::name, "copy_pages"}, *this, *this, src, dst);
  }

  /// this[dst[i]] <- other[src[i]] for every layer, k and v. other: the same
  /// n_layers, page_size, n_kv_heads, head_dim and dtype; any device, either
  /// layout (pages are relaid out). src is checked against other's pool, dst
  /// against this one's (as in copy_pages); each on cpu or either device.
  template <class OtherLayout>
  void copy_pages_from(const PagedCache<OtherLayout>& other, const at::Tensor& src, const at::Tensor& dst) {
    page_copy::copy_checked(checks::Caller{"PagedCache", Layout::name, "copy_pages_from"}, *this, other, src, dst);
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
    return kernels::zeroed_storage({n_layers, n_pages, geometry_.page_size * geometry_.n_heads},
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

  void check_write_args(const checks::Caller& caller, int64_t layer, const at::Tensor& page_table,
                        const at::Tensor& k, const at::Tensor& v) const {
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, page_table, device());
    checks::key_values(caller, k, v, page_table.size(0), geometry_, dtype(), device());
  }

  void check_total_len(const checks::Caller& caller, const at::Tensor& host_table, int64_t total_len) const {
    visit_page_table(host_table, [&](const auto& table) {
      const int64_t mapped = checks::mapped_columns(table) * page_size();
      TORCH_CHECK_INDEX(total_len <= mapped, caller, ": argument 'total_len' expected <= ", mapped,
                        " (the tokens the page table maps), got ", total_len);
    });
  }

  /// Used by CacheView::gather for views bound with total_len > 0.
  // cppcheck-suppress unusedPrivateFunction ; called by the friend CacheView
  std::pair<at::Tensor, at::Tensor> gather_prefix(int64_t layer, const at::Tensor& page_table,
                                                  int64_t total_len) const {
    const checks::Caller caller{"CacheView", Layout::name, "gather"};
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, page_table, device());
    const at::Tensor host_table = on_host(page_table);
    check_total_len(caller, host_table, total_len);
    return visit_page_table(host_table, [&](const auto& table) {
      checks::readable_columns(caller, table, (total_len + page_size() - 1) / page_size(), pool_);
      return gather_checked(layer, page_table, table,
                            std::vector<int64_t>(static_cast<size_t>(table.rows), total_len), total_len);
    });
  }

  void write_checked(const checks::Caller& caller, int64_t layer, const at::Tensor& page_table,
                     const std::vector<int64_t>& starts, const at::Tensor& k, const at::Tensor& v) {
    const int64_t n_tokens = k.size(1);
    visit_page_table(on_host(page_table), [&](const auto& table) {
      for (int64_t row = 0; row < table.rows; ++row) {
        checks::write_range(caller, table, row, starts[static_cast<size_t>(row)], n_tokens, page_size(), pool_);
      }
      // Validated: from here on nothing throws (but a device error).
      if (kernels::use_cuda_kernels(device())) {
        write_cuda(layer, page_table, starts, k, v);
      } else if (is_quantized(quant_)) {
        write_quantized(layer, table, starts, n_tokens, k, v);
      } else if (kernels::use_cpu_kernels(device())) {
        const auto src = kernels::token_major(static_cast<const char*>(k.data_ptr()), k,
                                              static_cast<const char*>(v.data_ptr()), v);
        const kernels::LayerPages<char> dst{kernels::layer_bytes(k_cache_, layer),
                                            kernels::layer_bytes(v_cache_, layer), page_bytes(),
                                            kernels::page_strides(geometry_, elem_size())};
        kernels::write_cpu(table, starts, n_tokens, src, dst, geometry_, elem_size());
      } else {
        kernels::write_generic(table, starts, n_tokens, k, v, k_cache_.select(0, layer), v_cache_.select(0, layer),
                               geometry_);
      }
    });
  }

  template <class Index>
  std::pair<at::Tensor, at::Tensor> gather_checked(int64_t layer, const at::Tensor& page_table,
                                                   const PageTableRef<Index>& table,
                                                   const std::vector<int64_t>& lengths, int64_t n_tokens) const {
    if (kernels::use_cuda_kernels(device())) return gather_cuda(layer, page_table, lengths, n_tokens);
    if (is_quantized(quant_)) return gather_quantized(layer, table, lengths, n_tokens);
    if (!kernels::use_cpu_kernels(device())) {
      return kernels::gather_generic(table, lengths, n_tokens, k_cache_.select(0, layer), v_cache_.select(0, layer),
                                     geometry_);
    }
    at::Tensor k_out = outputs_->empty(0, {table.rows, n_tokens, n_kv_heads(), head_dim()}, k_cache_.options());
    at::Tensor v_out = outputs_->empty(1, {table.rows, n_tokens, n_kv_heads(), head_dim()}, v_cache_.options());
    const kernels::LayerPages<const char> src{kernels::layer_bytes(k_cache_, layer),
                                              kernels::layer_bytes(v_cache_, layer), page_bytes(),
                                              kernels::page_strides(geometry_, elem_size())};
    const auto dst = kernels::token_major(static_cast<char*>(k_out.data_ptr()), k_out,
                                          static_cast<char*>(v_out.data_ptr()), v_out);
    kernels::gather_cpu(table, lengths, n_tokens, src, dst, geometry_, elem_size());
    return {k_out, v_out};
  }

  // ---- the CUDA kernels (cuda/cache_ops.hpp) ----

  /// write_checked on a cache with CUDA kernels: the table on the device
  /// (the caller's, or a copy), the start positions as a launch argument
  /// when they are all equal, else copied to the device.
  void write_cuda(int64_t layer, const at::Tensor& page_table, const std::vector<int64_t>& starts,
                  const at::Tensor& k, const at::Tensor& v) {
    const at::Tensor table = cuda::on_device(page_table, device());
    cuda::Starts where;
    at::Tensor uploaded;
    if (std::adjacent_find(starts.begin(), starts.end(), std::not_equal_to<int64_t>()) == starts.end()) {
      where.scalar = starts.empty() ? 0 : starts.front();
    } else {
      uploaded = cuda::on_device(cuda::host_int64(starts), device());
      where.per_row = uploaded.data_ptr<int64_t>();
    }
    cuda::write_layer(*this, layer, cuda::table_ref(table), where, k, v);
  }

  /// gather_checked on a cache with CUDA kernels.
  std::pair<at::Tensor, at::Tensor> gather_cuda(int64_t layer, const at::Tensor& page_table,
                                                const std::vector<int64_t>& lengths, int64_t n_tokens) const {
    const at::Tensor table = cuda::on_device(page_table, device());
    if (std::adjacent_find(lengths.begin(), lengths.end(), std::not_equal_to<int64_t>()) == lengths.end()) {
      return cuda::gather_layer(*this, layer, cuda::table_ref(table), nullptr, lengths.empty() ? 0 : lengths.front(),
                                n_tokens);
    }
    const at::Tensor lens = cuda::on_device(cuda::host_int64(lengths), device());
    return cuda::gather_layer(*this, layer, cuda::table_ref(table), lens.data_ptr<int64_t>(), 0, n_tokens);
  }

  /// CacheView::write of a view bound for the CUDA kernels (start_pos
  /// undefined: `scalar`): checked against bind's host snapshot; start
  /// positions equal to the bound lengths' tail read the bound lengths on
  /// the device (what a replayed CUDA graph needs), others are uploaded.
  // cppcheck-suppress unusedPrivateFunction ; called by the friend CacheView
  void write_bound(const CacheView<Layout>& view, int64_t layer, const at::Tensor& start_pos, int64_t scalar,
                   const at::Tensor& k, const at::Tensor& v) {
    if (!kernels::use_cuda_kernels(device())) {  // bound for the CUDA kernels, used without them
      if (start_pos.defined()) return write(layer, view.page_table(), start_pos, k, v);
      return write(layer, view.page_table(), scalar, k, v);
    }
    const cuda::BoundTables& b = *view.bound_tables();
    const checks::Caller caller{"PagedCache", Layout::name, "write"};
    const int64_t batch = b.host_table.size(0);
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, b.host_table, device());
    checks::key_values(caller, k, v, batch, geometry_, dtype(), device());
    std::vector<int64_t> starts;
    if (start_pos.defined()) {
      if (!start_pos.device().is_cpu()) checks::not_capturing(caller, cuda::capturing(device()));
      starts = checks::per_sequence(caller, "start_pos", start_pos, batch, device());
    } else {
      checks::non_negative(caller, "start_pos", scalar);
      starts.assign(static_cast<size_t>(batch), scalar);
    }
    const int64_t n_tokens = k.size(1);
    visit_page_table(b.host_table, [&](const auto& table) {
      for (int64_t row = 0; row < table.rows; ++row) {
        checks::write_range(caller, table, row, starts[static_cast<size_t>(row)], n_tokens, page_size(), pool_);
      }
      const PageDivisor pages(page_size());
      checks::bound_view_current(caller, b, table, pool_, [&](int64_t row) {  // the pages it writes
        const int64_t first = starts[static_cast<size_t>(row)];
        if (n_tokens == 0) return std::make_pair(int64_t{0}, int64_t{0});
        return std::make_pair(pages.column(first), pages.column(first + n_tokens - 1) + 1);
      });
    });
    bool tail = start_pos.defined() && !b.host_lengths.empty();
    for (int64_t row = 0; tail && row < batch; ++row) {
      tail = starts[static_cast<size_t>(row)] + n_tokens == b.host_lengths[static_cast<size_t>(row)];
    }
    if (start_pos.defined() && !tail) checks::tail_in_capture(caller, cuda::capturing(device()), n_tokens);
    // Validated: from here on nothing throws (but a device error).
    cuda::Starts where;
    at::Tensor uploaded;
    if (!start_pos.defined()) {
      where.scalar = scalar;  // a launch argument (baked into a captured graph)
    } else if (tail) {
      where.tail_lengths = b.device_lengths.data_ptr<int64_t>();
    } else {
      uploaded = cuda::on_device(cuda::host_int64(starts), device());
      where.per_row = uploaded.data_ptr<int64_t>();
    }
    cuda::write_layer(*this, layer, cuda::table_ref(b.device_table), where, k, v);
  }

  /// CacheView::gather of a view bound for the CUDA kernels (the callers
  /// and the checks as on the CPU path, against bind's host snapshot).
  // cppcheck-suppress unusedPrivateFunction ; called by the friend CacheView
  std::pair<at::Tensor, at::Tensor> gather_bound(const CacheView<Layout>& view, int64_t layer) const {
    const bool prefix = view.total_len() > 0 && !view.lengths().defined();
    if (!kernels::use_cuda_kernels(device())) {  // bound for the CUDA kernels, used without them
      if (view.lengths().defined()) return gather(layer, view.page_table(), view.lengths());
      if (prefix) return gather_prefix(layer, view.page_table(), view.total_len());
      return gather(layer, view.page_table());
    }
    const cuda::BoundTables& b = *view.bound_tables();
    const checks::Caller caller{prefix ? "CacheView" : "PagedCache", Layout::name, "gather"};
    checks::layer(caller, layer, n_layers_);
    checks::page_table(caller, b.host_table, device());
    return visit_page_table(b.host_table, [&](const auto& table) {
      if (view.lengths().defined()) {
        for (int64_t row = 0; b.leading_unmapped && row < table.rows; ++row) {  // bind let those through
          checks::mapped_prefix(caller, table, row, b.host_lengths[static_cast<size_t>(row)], page_size(), pool_);
        }
        checks::bound_view_current(caller, b, table, pool_, [&](int64_t row) {
          return std::make_pair(int64_t{0}, (b.host_lengths[static_cast<size_t>(row)] + page_size() - 1) / page_size());
        });
        const int64_t n_tokens = b.host_lengths.empty() ? 0 : *std::max_element(b.host_lengths.begin(),
                                                                                 b.host_lengths.end());
        return cuda::gather_layer(*this, layer, cuda::table_ref(b.device_table), b.device_lengths.data_ptr<int64_t>(),
                                  0, n_tokens);
      }
      const int64_t n_tokens = prefix ? view.total_len() : checks::mapped_columns(table) * page_size();
      const int64_t cols = (n_tokens + page_size() - 1) / page_size();
      checks::readable_columns(caller, table, cols, pool_);
      checks::bound_view_current(caller, b, table, pool_, [cols](int64_t) { return std::make_pair(int64_t{0}, cols); });
      return cuda::gather_layer(*this, layer, cuda::table_ref(b.device_table), nullptr, n_tokens, n_tokens);
    });
  }

  /// Calls f(T{}) with the C++ type of the logical dtype (quantized caches: float32, float16, bfloat16).
  template <class F>
  void visit_dtype(const F& f) const {
    switch (dtype_) {
      case at::kHalf: return f(c10::Half());
      case at::kBFloat16: return f(c10::BFloat16());
      default: return f(float());
    }
  }

  static at::Tensor layer_of(const at::Tensor& t, int64_t layer) {
    return t.defined() ? t.select(0, layer) : at::Tensor();
  }

  /// write_checked for a cache with a quantized side: each side quantized
  /// (or copied, when native) on its own.
  template <class Index>
  void write_quantized(int64_t layer, const PageTableRef<Index>& table, const std::vector<int64_t>& starts,
                       int64_t n_tokens, const at::Tensor& k, const at::Tensor& v) {
    const at::Tensor* inputs[2] = {&k, &v};
    if (!kernels::use_cpu_kernels(device())) {
      for (int side = 0; side < 2; ++side) {
        quant_kernels::write_side_generic(table, starts, n_tokens, *inputs[side], format_of(side),
                                          pages_of(side).select(0, layer), layer_of(scales_of(side), layer),
                                          geometry_);
      }
      return;
    }
    const auto tokens_of = [](const at::Tensor& x) {
      return quant_kernels::SideTokens<const char>{static_cast<const char*>(x.data_ptr()),
                                                   x.stride(0) * static_cast<int64_t>(x.element_size()),
                                                   kernels::token_major_strides(x)};
    };
    const quant_kernels::SideTokens<const char> src[2] = {tokens_of(k), tokens_of(v)};
    const quant_kernels::SidePages<char> dst[2] = {side_pages<char>(0, layer), side_pages<char>(1, layer)};
    visit_dtype([&](auto t) {
      quant_kernels::write_sides_cpu<decltype(t)>(table, starts, n_tokens, src, dst, geometry_);
    });
  }

  /// gather_checked for a cache with a quantized side: dequantized into the logical dtype.
  template <class Index>
  std::pair<at::Tensor, at::Tensor> gather_quantized(int64_t layer, const PageTableRef<Index>& table,
                                                     const std::vector<int64_t>& lengths, int64_t n_tokens) const {
    at::Tensor out[2];
    for (int side = 0; side < 2; ++side) {
      if (!kernels::use_cpu_kernels(device())) {
        out[side] = quant_kernels::gather_side_generic(table, lengths, n_tokens, format_of(side),
                                                       pages_of(side).select(0, layer),
                                                       layer_of(scales_of(side), layer), geometry_, dtype_);
        continue;
      }
      out[side] = outputs_->empty(static_cast<size_t>(side), {table.rows, n_tokens, n_kv_heads(), head_dim()},
                                  k_cache_.options().dtype(dtype_));
      const auto src = side_pages<const char>(side, layer);
      visit_dtype([&](auto t) {
        using T = decltype(t);
        quant_kernels::gather_side_cpu<T>(table, lengths, n_tokens, src, out[side].data_ptr<T>(), geometry_);
      });
    }
    return {out[0], out[1]};
  }

  /// Side `side` (0: K, 1: V) of the cache: its format, pages and scales.
  KVFormat format_of(int side) const { return side == 0 ? quant_.k : quant_.v; }
  const at::Tensor& pages_of(int side) const { return side == 0 ? k_cache_ : v_cache_; }
  const at::Tensor& scales_of(int side) const { return side == 0 ? k_scales_ : v_scales_; }

  /// Layer `layer` of side `side` as raw bytes for the CPU kernels (no tensor is made: kernels::layer_bytes).
  template <class Byte>
  quant_kernels::SidePages<Byte> side_pages(int side, int64_t layer) const {
    const at::Tensor& scales = scales_of(side);
    return {format_of(side), kernels::layer_bytes(pages_of(side), layer),
            scales.defined() ? kernels::layer_floats(scales, layer) : nullptr,
            static_cast<int64_t>(pages_of(side).element_size())};
  }

  int64_t elem_size() const { return static_cast<int64_t>(k_cache_.element_size()); }
  int64_t page_bytes() const { return geometry_.page_elems * elem_size(); }

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
  std::shared_ptr<kernels::OutputRecycler> outputs_ = std::make_shared<kernels::OutputRecycler>();
  // The device buffers of BindBuffers::per_shape binds, by shape.
  std::shared_ptr<cuda::BindBufferSets> bind_buffers_ = std::make_shared<cuda::BindBufferSets>();
};

}  // namespace pagedkv
