// Typed, strided read access to a page table, whatever its integer type.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace pagedkv {

/// Page-table entry meaning "no page mapped here".
constexpr int64_t kUnmappedPage = -1;

/// Read-only view of a host page table [rows, cols] of int32 or int64.
template <class Index>
struct PageTableRef {
  const Index* data;   // [rows, cols], strided
  int64_t rows;        ///< batch size B
  int64_t cols;        ///< max pages per sequence
  int64_t row_stride;  ///< elements between rows
  int64_t col_stride;  ///< elements between columns

  /// Physical page of logical page `col` of sequence `row`.
  int64_t operator()(int64_t row, int64_t col) const noexcept {
    return static_cast<int64_t>(data[row * row_stride + col * col_stride]);
  }
};

/// A PageTableRef whose integer type is known only at run time: for a
/// kernel that is too large to compile once per index type (the attention
/// kernel, generated for three instruction sets and three dtypes). Reading an
/// entry costs one perfectly predicted branch.
struct AnyPageTableRef {
  const void* data;    // [rows, cols], strided: int32 or int64
  bool is_int32;       ///< the entries' type: int32 (true) or int64
  int64_t rows;        ///< batch size B
  int64_t cols;        ///< max pages per sequence
  int64_t row_stride;  ///< elements between rows
  int64_t col_stride;  ///< elements between columns

  template <class Index>
  explicit AnyPageTableRef(const PageTableRef<Index>& table) noexcept
      : data(table.data), is_int32(std::is_same<Index, int32_t>::value), rows(table.rows), cols(table.cols),
        row_stride(table.row_stride), col_stride(table.col_stride) {
    static_assert(std::is_same<Index, int32_t>::value || std::is_same<Index, int64_t>::value,
                  "page tables hold int32 or int64");
  }

  /// Physical page of logical page `col` of sequence `row`.
  int64_t operator()(int64_t row, int64_t col) const noexcept {
    const int64_t i = row * row_stride + col * col_stride;
    return is_int32 ? static_cast<int64_t>(static_cast<const int32_t*>(data)[i]) : static_cast<const int64_t*>(data)[i];
  }
};

/// Calls f(PageTableRef<int32_t or int64_t>) on a CPU page table whose
/// dtype was already checked to be int32 or int64.
template <class F>
decltype(auto) visit_page_table(const at::Tensor& host_table, F&& f) {
  if (host_table.scalar_type() == at::kInt) {
    return std::forward<F>(f)(PageTableRef<int32_t>{host_table.data_ptr<int32_t>(), host_table.size(0),
                                                     host_table.size(1), host_table.stride(0),
                                                     host_table.stride(1)});
  }
  return std::forward<F>(f)(PageTableRef<int64_t>{host_table.data_ptr<int64_t>(), host_table.size(0),
                                                   host_table.size(1), host_table.stride(0), host_table.stride(1)});
}

}  // namespace pagedkv
