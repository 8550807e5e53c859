// Every argument check of the stateless ops (torch.ops.pagedkv.*), in one
// place. An op sees cache tensors and page tables but no pool, so it checks
// what the tensors say: shapes, dtypes, devices, formats, and that every
// page id a call touches is in [0, n_pages) (a -1 where a write lands or a
// length reads is an error, as in the classes). Whether a page is allocated
// (use after free) only the classes can check: they own the pool. Messages
// use checks.hpp's words, with the op's name as the caller
// ("pagedkv::write: argument 'page_table' expected ..."). Nothing here
// changes anything.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/storage.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv_py {
namespace op_checks {

using pagedkv::checks::Caller;

/// The op `name` as a checks::Caller: printed "pagedkv::name".
inline Caller op(const char* name) { return Caller{name, nullptr, nullptr}; }

/// "NHD" or "HND"; returns whether it is HND.
inline bool layout_is_hnd(const Caller& caller, c10::string_view layout) {
  const std::string name(layout.data(), layout.size());
  TORCH_CHECK(name == "NHD" || name == "HND", caller, ": argument 'layout' expected \"NHD\" or \"HND\", got \"", name,
              "\"");
  return name == "HND";
}

/// The page at (row, col) is a page id of the cache: in [0, n_pages).
template <class Index>
void page_in_range(const Caller& caller, const pagedkv::PageTableRef<Index>& table, int64_t row, int64_t col,
                   int64_t n_pages) {
  const int64_t page = table(row, col);
  TORCH_CHECK_INDEX(page >= 0 && page < n_pages, caller, ": argument 'page_table' expected a page id in [0, ",
                    n_pages, ") at page_table[", row, "][", col, "], got ", page,
                    page == pagedkv::kUnmappedPage ? " (unmapped)" : "");
}

/// checks::write_range without a pool: tokens [start, start + n) of row
/// `row` fit in the table and sit on pages in range.
template <class Index>
void write_range(const Caller& caller, const pagedkv::PageTableRef<Index>& table, int64_t row, int64_t start,
                 int64_t n, int64_t page_size, int64_t n_pages) {
  if (n == 0) return;
  const int64_t capacity = table.cols * page_size;
  TORCH_CHECK_INDEX(start <= capacity - n, caller, ": write of ", n, " tokens at start_pos ", start, " in row ", row,
                    " expected to end within the page table's ", table.cols, " columns (", capacity,
                    " tokens), got last position ", static_cast<uint64_t>(start) + static_cast<uint64_t>(n - 1),
                    " (a write past the last column)");
  const pagedkv::PageDivisor pages(page_size);
  const int64_t last_col = pages.column(start + n - 1);
  for (int64_t col = pages.column(start); col <= last_col; ++col) page_in_range(caller, table, row, col, n_pages);
}

/// checks::readable_columns without a pool: every entry of the first
/// `n_cols` columns is -1 or a page in range.
template <class Index>
void readable_columns(const Caller& caller, const pagedkv::PageTableRef<Index>& table, int64_t n_cols,
                      int64_t n_pages) {
  for (int64_t row = 0; row < table.rows; ++row) {
    for (int64_t col = 0; col < n_cols; ++col) {
      if (table(row, col) != pagedkv::kUnmappedPage) page_in_range(caller, table, row, col, n_pages);
    }
  }
}

/// checks::mapped_prefix without a pool: row `row` maps a page in range at
/// every column that holds positions [0, length).
template <class Index>
void mapped_prefix(const Caller& caller, const pagedkv::PageTableRef<Index>& table, int64_t row, int64_t length,
                   int64_t page_size, int64_t n_pages) {
  TORCH_CHECK_INDEX(length <= table.cols * page_size, caller, ": argument 'lengths' expected lengths[", row,
                    "] <= ", table.cols * page_size, " (the tokens page_table row ", row, " can map), got ",
                    length);
  for (int64_t col = 0; col * page_size < length; ++col) {
    TORCH_CHECK_INDEX(table(row, col) != pagedkv::kUnmappedPage, caller, ": argument 'lengths' expected lengths[",
                      row, "] <= ", col * page_size, " (the tokens page_table row ", row,
                      " maps before its first -1 at column ", col, "), got ", length);
    page_in_range(caller, table, row, col, n_pages);
  }
}

/// mapped_prefix from position `first` (attention's earliest window start):
/// the columns before first's page are not read and may be -1.
template <class Index>
void mapped_range(const Caller& caller, const pagedkv::PageTableRef<Index>& table, int64_t row, int64_t first,
                  int64_t length, int64_t page_size, int64_t n_pages) {
  if (first <= 0) return mapped_prefix(caller, table, row, length, page_size, n_pages);
  TORCH_CHECK_INDEX(length <= table.cols * page_size, caller, ": argument 'lengths' expected lengths[", row,
                    "] <= ", table.cols * page_size, " (the tokens page_table row ", row, " can map), got ",
                    length);
  for (int64_t col = first / page_size; col * page_size < length; ++col) {
    TORCH_CHECK_INDEX(table(row, col) != pagedkv::kUnmappedPage, caller,
                      ": argument 'page_table' expected a page at page_table[", row, "][", col,
                      "] (it holds positions a query's window sees, ", first, " to lengths[", row, "] - 1 = ",
                      length - 1, "), got -1");
    page_in_range(caller, table, row, col, n_pages);
  }
}

/// A total length to read: at most the tokens of the leading mapped columns.
template <class Index>
void total_len(const Caller& caller, const pagedkv::PageTableRef<Index>& table, int64_t total_len,
               int64_t page_size) {
  const int64_t mapped = pagedkv::checks::mapped_columns(table) * page_size;
  TORCH_CHECK_INDEX(total_len <= mapped, caller, ": argument 'total_len' expected <= ", mapped,
                    " (the tokens the page table maps), got ", total_len);
}

/// The pages of a cache as an op receives them: ops::Storage, built only
/// by `storage`, which validates all of it (its dtype is the native side's;
/// an op on quantized pages sets the one it reads and writes).
using Storage = pagedkv::ops::Storage;

/// The format of one side: native without scales, else from its codes' dtype.
inline pagedkv::KVFormat side_format(const Caller& caller, const char* pages_arg, const at::Tensor& pages,
                                     const char* scales_arg, const c10::optional<at::Tensor>& scales) {
  if (!scales.has_value() || !scales->defined()) return pagedkv::KVFormat::native;
  const at::ScalarType codes = pages.scalar_type();
  TORCH_CHECK(codes == at::kByte || codes == at::kChar, caller, ": argument '", pages_arg,
              "' expected dtype Byte (fp8 e4m3 codes) or Char (int8 codes) since '", scales_arg, "' is given, got ",
              codes);
  return codes == at::kByte ? pagedkv::KVFormat::fp8_e4m3 : pagedkv::KVFormat::int8;
}

/// One page tensor: defined, strided, contiguous, 5-D with every size >= 1.
inline void page_tensor(const Caller& caller, const char* arg, const at::Tensor& t, bool hnd) {
  TORCH_CHECK(t.defined(), caller, ": argument '", arg, "' expected a tensor, got an undefined one");
  TORCH_CHECK(t.dim() == 5, caller, ": argument '", arg, "' expected 5-D [n_layers, n_pages, ",
              hnd ? "n_kv_heads, page_size" : "page_size, n_kv_heads", ", head_dim] (", hnd ? "HND" : "NHD",
              " pages), got ", t.dim(), "-D with shape ", t.sizes());
  for (int64_t d = 0; d < 5; ++d) {
    TORCH_CHECK(t.size(d) >= 1, caller, ": argument '", arg, "' expected every size >= 1, got shape ", t.sizes());
  }
  TORCH_CHECK(t.layout() == at::kStrided, caller, ": argument '", arg, "' expected a strided tensor, got layout ",
              t.layout());
  TORCH_CHECK(t.is_contiguous(), caller, ": argument '", arg, "' expected a contiguous tensor, got strides ",
              t.strides());
}

/// The scales of a quantized side: float32 [n_layers, n_pages, page_size * n_kv_heads], contiguous, on `device`.
inline void scales_tensor(const Caller& caller, const char* arg, const at::Tensor& t, int64_t n_layers,
                          int64_t n_pages, const pagedkv::PageGeometry& g, const at::Device& device) {
  const std::vector<int64_t> shape{n_layers, n_pages, g.page_size * g.n_heads};
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), caller, ": argument '", arg, "' expected shape ",
              at::IntArrayRef(shape), " [n_layers, n_pages, page_size * n_kv_heads], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, caller, ": argument '", arg, "' expected dtype Float, got ",
              t.scalar_type());
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), caller, ": argument '", arg,
              "' expected a contiguous tensor, got strides ", t.strides());
  TORCH_CHECK(t.device() == device, caller, ": argument '", arg, "' expected on ", device,
              " (k_cache's device), got ", t.device());
}

/// Validates the cache tensors of an op and describes them.
inline Storage storage(const Caller& caller, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                       c10::string_view layout) {
  const bool hnd = layout_is_hnd(caller, layout);
  page_tensor(caller, "k_cache", k_cache, hnd);
  page_tensor(caller, "v_cache", v_cache, hnd);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), caller, ": argument 'v_cache' expected shape ", k_cache.sizes(),
              " (k_cache's), got ", v_cache.sizes());
  TORCH_CHECK(v_cache.device() == k_cache.device(), caller, ": argument 'v_cache' expected on ", k_cache.device(),
              " (k_cache's device), got ", v_cache.device());
  const pagedkv::KVQuant quant{side_format(caller, "k_cache", k_cache, "k_scales", k_scales),
                               side_format(caller, "v_cache", v_cache, "v_scales", v_scales)};
  if (!is_quantized(quant.k) && !is_quantized(quant.v)) {
    TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), caller, ": argument 'v_cache' expected dtype ",
                k_cache.scalar_type(), " (k_cache's), got ", v_cache.scalar_type());
  }
  const int64_t page_size = k_cache.size(hnd ? 3 : 2);
  const int64_t n_heads = k_cache.size(hnd ? 2 : 3);
  const int64_t head_dim = k_cache.size(4);
  const pagedkv::PageGeometry g = hnd ? pagedkv::PageGeometry::of<pagedkv::HND>(page_size, n_heads, head_dim)
                                      : pagedkv::PageGeometry::of<pagedkv::NHD>(page_size, n_heads, head_dim);
  const int64_t n_layers = k_cache.size(0);
  const int64_t n_pages = k_cache.size(1);
  Storage s{k_cache, v_cache, at::Tensor(), at::Tensor(), quant, g, k_cache.scalar_type()};
  if (is_quantized(quant.k)) {
    scales_tensor(caller, "k_scales", *k_scales, n_layers, n_pages, g, k_cache.device());
    s.k_scales = *k_scales;
  }
  if (is_quantized(quant.v)) {
    scales_tensor(caller, "v_scales", *v_scales, n_layers, n_pages, g, k_cache.device());
    s.v_scales = *v_scales;
  }
  return s;
}

/// The dtype the op reads and writes (k and v of a write, a gather's
/// outputs, q): a native side's storage dtype, else `given` (named `arg`),
/// which must then be float32, float16 or bfloat16. A given dtype must
/// agree with a native side's.
inline at::ScalarType logical_dtype(const Caller& caller, const Storage& s, const char* arg,
                                    const c10::optional<at::ScalarType>& given) {
  const at::Tensor* native = !is_quantized(s.quant.k) ? &s.k : !is_quantized(s.quant.v) ? &s.v : nullptr;
  if (native != nullptr) {
    if (given.has_value()) {
      TORCH_CHECK(*given == native->scalar_type(), caller, ": argument '", arg, "' expected dtype ",
                  native->scalar_type(), " (the cache's native side), got ", *given);
    }
    const at::ScalarType dtype = native->scalar_type();
    TORCH_CHECK(!is_quantized(s.quant) || dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                caller, ": expected a native side of dtype float32, float16 or bfloat16 beside quantized pages (K ",
                pagedkv::format_name(s.quant.k), ", V ", pagedkv::format_name(s.quant.v), "), got ", dtype);
    return dtype;
  }
  TORCH_CHECK(given.has_value(), caller, ": argument '", arg,
              "' expected a dtype (float32, float16 or bfloat16) to dequantize into, got None");
  TORCH_CHECK(*given == at::kFloat || *given == at::kHalf || *given == at::kBFloat16, caller, ": argument '", arg,
              "' expected dtype float32, float16 or bfloat16 for quantized pages (K ",
              pagedkv::format_name(s.quant.k), ", V ", pagedkv::format_name(s.quant.v), "), got ", *given);
  return *given;
}

/// A page list of copy_pages: 1-D int32/int64 on the cpu or the cache's
/// device, copied to the host; every id in [0, n_pages).
inline std::vector<int64_t> page_list(const Caller& caller, const char* arg, const at::Tensor& t,
                                      const at::Device& device, int64_t n_pages) {
  TORCH_CHECK(t.defined(), caller, ": argument '", arg, "' expected a tensor, got an undefined one");
  TORCH_CHECK(t.dim() == 1, caller, ": argument '", arg, "' expected 1-D [n_pages_to_copy], got ", t.dim(),
              "-D with shape ", t.sizes());
  TORCH_CHECK(pagedkv::checks::is_index_type(t.scalar_type()), caller, ": argument '", arg,
              "' expected dtype int32 or int64, got ", t.scalar_type());
  pagedkv::checks::host_or_cache_device(caller, arg, t, device);
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  std::vector<int64_t> pages(data, data + host.numel());
  for (size_t i = 0; i < pages.size(); ++i) {
    TORCH_CHECK_INDEX(pages[i] >= 0 && pages[i] < n_pages, caller, ": argument '", arg, "' expected page ids in [0, ",
                      n_pages, "), got ", arg, "[", i, "] = ", pages[i],
                      pages[i] == pagedkv::kUnmappedPage ? " (unmapped)" : "");
  }
  return pages;
}

}  // namespace op_checks
}  // namespace pagedkv_py
