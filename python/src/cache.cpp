// pagedkv.PagedCache (pool, write, gather, bind, page copies) and the
// stateless ops that move K/V: pagedkv::write, pagedkv::gather,
// pagedkv::copy_pages. Both in one file so that each kernel template is
// compiled once.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "handles.hpp"
#include "op_checks.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/cpu/storage.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/bind.hpp"
#include "pagedkv/ops/page_copy.hpp"
#include "pagedkv/ops/storage.hpp"
#include "pagedkv/ops/write_gather.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/paged_cache.hpp"
#include "stateless.hpp"

namespace pagedkv_py {

using pagedkv::HND;
using pagedkv::KVFormat;
using pagedkv::NHD;
using pagedkv::PageGeometry;
using pagedkv::PageTableRef;
namespace checks = pagedkv::checks;
namespace ops = pagedkv::ops;

// ---------------------------------------------------------------- classes

KVFormat parse_format(const char* arg, const std::string& name) {
  if (name == "native") return KVFormat::native;
  if (name == "fp8" || name == "fp8_e4m3") return KVFormat::fp8_e4m3;
  if (name == "int8") return KVFormat::int8;
  TORCH_CHECK(false, "pagedkv.PagedCache: argument '", arg, "' expected \"native\", \"fp8\" or \"int8\", got \"", name,
              "\"");
}

Cache::Cache(int64_t n_layers, int64_t n_pages, int64_t page_size, int64_t n_kv_heads, int64_t head_dim,
             const at::Tensor& like, const std::string& layout, const std::string& k_format,
             const std::string& v_format) {
  TORCH_CHECK(layout == "NHD" || layout == "HND", "pagedkv.PagedCache: argument 'layout' expected \"NHD\" or \"HND\", got \"",
              layout, "\"");
  const pagedkv::KVQuant quant{parse_format("k_format", k_format), parse_format("v_format", v_format)};
  const at::TensorOptions options = at::TensorOptions().dtype(like.scalar_type()).device(like.device());
  if (layout == "NHD") {
    cache_ = std::make_unique<pagedkv::PagedCache<NHD>>(n_layers, n_pages, page_size, n_kv_heads, head_dim, options,
                                                        quant);
  } else {
    cache_ = std::make_unique<pagedkv::PagedCache<HND>>(n_layers, n_pages, page_size, n_kv_heads, head_dim, options,
                                                        quant);
  }
}

int64_t Cache::alloc() {
  return visit([](auto& c) { return c.alloc(); });
}
std::vector<int64_t> Cache::alloc_n(int64_t n) {
  return visit([&](auto& c) { return c.alloc_n(n); });
}
void Cache::free(int64_t page) {
  visit([&](auto& c) { c.free(page); });
}
void Cache::retain(int64_t page) {
  visit([&](auto& c) { c.retain(page); });
}
int64_t Cache::ref_count(int64_t page) const {
  return visit([&](const auto& c) { return c.ref_count(page); });
}
int64_t Cache::n_free() const {
  return visit([](const auto& c) { return c.n_free(); });
}

void Cache::write(int64_t layer, const at::Tensor& page_table, int64_t start_pos, const at::Tensor& k,
                  const at::Tensor& v) {
  visit([&](auto& c) { c.write(layer, page_table, start_pos, k, v); });
}
void Cache::write(int64_t layer, const at::Tensor& page_table, const at::Tensor& start_pos, const at::Tensor& k,
                  const at::Tensor& v) {
  visit([&](auto& c) { c.write(layer, page_table, start_pos, k, v); });
}
std::pair<at::Tensor, at::Tensor> Cache::gather(int64_t layer, const at::Tensor& page_table) const {
  return visit([&](const auto& c) { return c.gather(layer, page_table); });
}
std::pair<at::Tensor, at::Tensor> Cache::gather(int64_t layer, const at::Tensor& page_table,
                                                const at::Tensor& lengths) const {
  return visit([&](const auto& c) { return c.gather(layer, page_table, lengths); });
}
View Cache::bind(const at::Tensor& page_table, int64_t total_len) {
  return visit([&](auto& c) { return View(c.bind(page_table, total_len)); });
}
View Cache::bind(const at::Tensor& page_table, const at::Tensor& lengths) {
  return visit([&](auto& c) { return View(c.bind(page_table, lengths)); });
}
void Cache::copy_pages(const at::Tensor& src, const at::Tensor& dst) {
  visit([&](auto& c) { c.copy_pages(src, dst); });
}
void Cache::copy_pages_from(const Cache& other, const at::Tensor& src, const at::Tensor& dst) {
  visit([&](auto& c) { other.visit([&](const auto& o) { c.copy_pages_from(o, src, dst); }); });
}
void Cache::check() const {
  visit([](const auto& c) { c.check(); });
}

const at::Tensor& Cache::k_cache() const {
  return visit([](const auto& c) -> const at::Tensor& { return c.k_cache(); });
}
const at::Tensor& Cache::v_cache() const {
  return visit([](const auto& c) -> const at::Tensor& { return c.v_cache(); });
}
const at::Tensor& Cache::k_scales() const {
  return visit([](const auto& c) -> const at::Tensor& { return c.k_scales(); });
}
const at::Tensor& Cache::v_scales() const {
  return visit([](const auto& c) -> const at::Tensor& { return c.v_scales(); });
}
pagedkv::KVQuant Cache::quant() const {
  return visit([](const auto& c) { return c.quant(); });
}
at::ScalarType Cache::dtype() const {
  return visit([](const auto& c) { return c.dtype(); });
}
int64_t Cache::n_layers() const {
  return visit([](const auto& c) { return c.n_layers(); });
}
int64_t Cache::n_pages() const {
  return visit([](const auto& c) { return c.n_pages(); });
}
int64_t Cache::page_size() const {
  return visit([](const auto& c) { return c.page_size(); });
}
int64_t Cache::n_kv_heads() const {
  return visit([](const auto& c) { return c.n_kv_heads(); });
}
int64_t Cache::head_dim() const {
  return visit([](const auto& c) { return c.head_dim(); });
}
const char* Cache::layout() const {
  return cache_.index() == 0 ? NHD::name : HND::name;
}

void View::write(int64_t layer, int64_t start_pos, const at::Tensor& k, const at::Tensor& v) const {
  std::visit([&](const auto& view) { view.write(layer, start_pos, k, v); }, view_);
}
void View::write(int64_t layer, const at::Tensor& start_pos, const at::Tensor& k, const at::Tensor& v) const {
  std::visit([&](const auto& view) { view.write(layer, start_pos, k, v); }, view_);
}
std::pair<at::Tensor, at::Tensor> View::gather(int64_t layer) const {
  return std::visit([&](const auto& view) { return view.gather(layer); }, view_);
}
const at::Tensor& View::page_table() const {
  return std::visit([](const auto& view) -> const at::Tensor& { return view.page_table(); }, view_);
}
const at::Tensor& View::lengths() const {
  return std::visit([](const auto& view) -> const at::Tensor& { return view.lengths(); }, view_);
}
int64_t View::total_len() const {
  return std::visit([](const auto& view) { return view.total_len(); }, view_);
}

// ---------------------------------------------------------------- ops

namespace {

using op_checks::Storage;

/// Storage of the CPU gathers' outputs, recycled as PagedCache recycles its own (cpu::OutputRecycler).
pagedkv::cpu::OutputRecycler& op_outputs() {
  static pagedkv::cpu::OutputRecycler recycler;
  return recycler;
}

/// The dtype a write's k and v must have: a native side's, else k's (a float type).
at::ScalarType write_dtype(const checks::Caller& caller, const Storage& s, const at::Tensor& k) {
  TORCH_CHECK(k.defined(), caller, ": argument 'k' expected a tensor, got an undefined one");
  const bool has_native = !is_quantized(s.quant.k) || !is_quantized(s.quant.v);
  return op_checks::logical_dtype(caller, s, "k", has_native ? c10::nullopt : c10::make_optional(k.scalar_type()));
}

/// The checks every write makes before its start positions: the cache tensors, layer, page table, k and v.
Storage checked_write(const checks::Caller& caller, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      int64_t layer, const at::Tensor& page_table, const at::Tensor& k, const at::Tensor& v,
                      c10::string_view layout, const c10::optional<at::Tensor>& k_scales,
                      const c10::optional<at::Tensor>& v_scales) {
  Storage s = op_checks::storage(caller, k_cache, v_cache, k_scales, v_scales, layout);
  const at::ScalarType dtype = write_dtype(caller, s, k);
  s.dtype = dtype;
  checks::layer(caller, layer, s.n_layers());
  checks::page_table(caller, page_table, s.device());
  checks::key_values(caller, k, v, page_table.size(0), s.geometry, dtype, s.device());
  return s;
}

void write_starts(const checks::Caller& caller, const Storage& s, int64_t layer, const at::Tensor& page_table,
                  const std::vector<int64_t>& starts, const at::Tensor& k, const at::Tensor& v) {
  const int64_t n_tokens = k.size(1);
  pagedkv::visit_page_table(on_host(page_table), [&](const auto& table) {
    for (int64_t row = 0; row < table.rows; ++row) {
      op_checks::write_range(caller, table, row, starts[static_cast<size_t>(row)], n_tokens, s.geometry.page_size,
                             s.n_pages());
    }
  });
  // Validated: from here on nothing throws (but a device error).
  ops::WriteStarts where;
  where.starts = starts;
  ops::write(s, layer, ops::table_of(s, page_table, nullptr), where, k, v);
}

/// The checks every gather makes before its lengths: the cache tensors, the
/// dtype asked for (the storage's dtype from then on), layer and page table.
Storage checked_gather(const checks::Caller& caller, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            int64_t layer, const at::Tensor& page_table, c10::string_view layout,
                            const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                            c10::optional<at::ScalarType> dtype) {
  Storage s = op_checks::storage(caller, k_cache, v_cache, k_scales, v_scales, layout);
  const at::ScalarType out_dtype = op_checks::logical_dtype(caller, s, "dtype", dtype);
  s.dtype = out_dtype;
  checks::layer(caller, layer, s.n_layers());
  checks::page_table(caller, page_table, s.device());
  return s;
}

void write_op(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer, const at::Tensor& page_table,
              int64_t start_pos, const at::Tensor& k, const at::Tensor& v, c10::string_view layout,
              const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales) {
  op_body([&] {
    const checks::Caller caller = op_checks::op("write");
    const Storage s = checked_write(caller, k_cache, v_cache, layer, page_table, k, v, layout, k_scales, v_scales);
    checks::non_negative(caller, "start_pos", start_pos);
    write_starts(caller, s, layer, page_table, std::vector<int64_t>(static_cast<size_t>(k.size(0)), start_pos), k, v);
  });
}

void write_starts_op(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                     const at::Tensor& page_table, const at::Tensor& start_pos, const at::Tensor& k,
                     const at::Tensor& v, c10::string_view layout, const c10::optional<at::Tensor>& k_scales,
                     const c10::optional<at::Tensor>& v_scales) {
  op_body([&] {
    const checks::Caller caller = op_checks::op("write");
    const Storage s = checked_write(caller, k_cache, v_cache, layer, page_table, k, v, layout, k_scales, v_scales);
    write_starts(caller, s, layer, page_table,
                 checks::per_sequence(caller, "start_pos", start_pos, k.size(0), s.device()), k, v);
  });
}

std::tuple<at::Tensor, at::Tensor> gather_op(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                                             const at::Tensor& page_table, int64_t total_len, c10::string_view layout,
                                             const c10::optional<at::Tensor>& k_scales,
                                             const c10::optional<at::Tensor>& v_scales,
                                             c10::optional<at::ScalarType> dtype) {
  return op_body([&] {
    const checks::Caller caller = op_checks::op("gather");
    const Storage s = checked_gather(caller, k_cache, v_cache, layer, page_table, layout, k_scales, v_scales, dtype);
    checks::non_negative(caller, "total_len", total_len);
    const at::Tensor host_table = on_host(page_table);
    const int64_t page_size = s.geometry.page_size;
    const auto kv = pagedkv::visit_page_table(host_table, [&](const auto& table) {
      int64_t n_tokens = total_len;
      if (total_len == 0) {  // every mapped token, as the reference's gather
        const int64_t cols = checks::mapped_columns(table);
        op_checks::readable_columns(caller, table, cols, s.n_pages());
        n_tokens = cols * page_size;
      } else {  // the first total_len tokens, as the reference's CacheView
        op_checks::total_len(caller, table, total_len, page_size);
        op_checks::readable_columns(caller, table, (total_len + page_size - 1) / page_size, s.n_pages());
      }
      return ops::gather(s, layer, ops::table_of(s, page_table, nullptr),
                         std::vector<int64_t>(static_cast<size_t>(table.rows), n_tokens), false, n_tokens, op_outputs());
    });
    return std::make_tuple(kv.first, kv.second);
  });
}

std::tuple<at::Tensor, at::Tensor> gather_lengths_op(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                     int64_t layer, const at::Tensor& page_table,
                                                     const at::Tensor& lengths, c10::string_view layout,
                                                     const c10::optional<at::Tensor>& k_scales,
                                                     const c10::optional<at::Tensor>& v_scales,
                                                     c10::optional<at::ScalarType> dtype) {
  return op_body([&] {
    const checks::Caller caller = op_checks::op("gather");
    const Storage s = checked_gather(caller, k_cache, v_cache, layer, page_table, layout, k_scales, v_scales, dtype);
    const std::vector<int64_t> lens = checks::per_sequence(caller, "lengths", lengths, page_table.size(0), s.device());
    const auto kv = pagedkv::visit_page_table(on_host(page_table), [&](const auto& table) {
      for (int64_t row = 0; row < table.rows; ++row) {
        op_checks::mapped_prefix(caller, table, row, lens[static_cast<size_t>(row)], s.geometry.page_size, s.n_pages());
      }
      const int64_t n_tokens = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
      return ops::gather(s, layer, ops::table_of(s, page_table, nullptr), lens, false, n_tokens, op_outputs());
    });
    return std::make_tuple(kv.first, kv.second);
  });
}

void copy_pages_op(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& src,
                   const at::Tensor& dst, c10::string_view layout, const c10::optional<at::Tensor>& k_scales,
                   const c10::optional<at::Tensor>& v_scales) {
  op_body([&] {
    const checks::Caller caller = op_checks::op("copy_pages");
    const Storage s = op_checks::storage(caller, k_cache, v_cache, k_scales, v_scales, layout);
    const std::vector<int64_t> from = op_checks::page_list(caller, "src", src, s.device(), s.n_pages());
    const std::vector<int64_t> to = op_checks::page_list(caller, "dst", dst, s.device(), s.n_pages());
    TORCH_CHECK(from.size() == to.size(), caller, ": arguments 'src' and 'dst' expected the same length, got ",
                from.size(), " and ", to.size());
    std::vector<int64_t> sorted(to);
    std::sort(sorted.begin(), sorted.end());
    const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    TORCH_CHECK(dup == sorted.end(), caller, ": argument 'dst' expected distinct pages, got page ",
                dup == sorted.end() ? int64_t{0} : *dup, " more than once");
    // Validated: from here on nothing throws (but a device error).
    const bool overlap = std::any_of(from.begin(), from.end(), [&](int64_t page) {
      return std::binary_search(sorted.begin(), sorted.end(), page);
    });
    ops::copy_pages(s, s, from.data(), to.data(), static_cast<int64_t>(to.size()), overlap);
  });
}

}  // namespace

}  // namespace pagedkv_py

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("write", &pagedkv_py::write_op);
  m.impl("write.starts", &pagedkv_py::write_starts_op);
  m.impl("gather", &pagedkv_py::gather_op);
  m.impl("gather.lengths", &pagedkv_py::gather_lengths_op);
  m.impl("copy_pages", &pagedkv_py::copy_pages_op);
}

// CUDA tensors: the same functions, whose operations layer (pagedkv/ops/)
// runs the CUDA kernels in a CUDA build of the package, as a CUDA
// PagedCache does.
TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("write", &pagedkv_py::write_op);
  m.impl("write.starts", &pagedkv_py::write_starts_op);
  m.impl("gather", &pagedkv_py::gather_op);
  m.impl("gather.lengths", &pagedkv_py::gather_lengths_op);
  m.impl("copy_pages", &pagedkv_py::copy_pages_op);
}
