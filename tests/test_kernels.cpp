// cpu::copy_block merges contiguous runs but must copy exactly the
// same bytes whatever the strides; layouts resolve into the right strides.
#include <gtest/gtest.h>

#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "pagedkv/ops/backend.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"
#include "test_support.hpp"

namespace {

using pagedkv::cpu::BlockShape;
using pagedkv::cpu::BlockStrides;
using pagedkv::cpu::copy_block;
using pagedkv_test::all_targets;
using pagedkv_test::Target;

/// Copies with copy_block and with a naive loop; both must agree byte for byte.
void check_copy(const BlockShape& shape, const BlockStrides& ds, const BlockStrides& ss, size_t buffer_bytes) {
  std::vector<char> src(buffer_bytes);
  std::iota(src.begin(), src.end(), static_cast<char>(1));
  std::vector<char> got(buffer_bytes, 0), want(buffer_bytes, 0);
  copy_block(got.data(), ds, src.data(), ss, shape);
  for (int64_t t = 0; t < shape.tokens; ++t)
    for (int64_t h = 0; h < shape.heads; ++h)
      for (int64_t d = 0; d < shape.head_dim; ++d)
        for (int64_t b = 0; b < shape.elem_size; ++b)
          want[static_cast<size_t>(t * ds.token + h * ds.head + d * ds.elem + b)] =
              src[static_cast<size_t>(t * ss.token + h * ss.head + d * ss.elem + b)];
  EXPECT_EQ(got, want);
}

TEST(CopyBlock, EveryStrideCombinationCopiesTheSameBytes) {
  const BlockShape shape{3, 2, 4, 2};  // 3 tokens, 2 heads, 4 elements of 2 bytes
  const BlockStrides token_major{16, 8, 2};
  const BlockStrides head_major{8, 24, 2};
  const BlockStrides padded{40, 12, 2};
  const BlockStrides every_other{32, 16, 4};
  for (const auto& ds : {token_major, head_major, padded, every_other})
    for (const auto& ss : {token_major, head_major, padded, every_other}) check_copy(shape, ds, ss, 256);
}

TEST(CopyBlock, DegenerateExtents) {
  check_copy({1, 1, 1, 4}, {4, 4, 4}, {4, 4, 4}, 16);
  check_copy({0, 2, 4, 2}, {16, 8, 2}, {16, 8, 2}, 64);
  check_copy({5, 1, 3, 1}, {7, 100, 1}, {3, 100, 1}, 64);  // one head: head stride is irrelevant
}

TEST(PageGeometry, LayoutsResolveToStrides) {
  const auto nhd = pagedkv::PageGeometry::of<pagedkv::NHD>(16, 8, 128);
  EXPECT_EQ(nhd.token_stride, 8 * 128);
  EXPECT_EQ(nhd.head_stride, 128);
  EXPECT_EQ(nhd.offset(2, 3), 2 * 1024 + 3 * 128);
  const auto hnd = pagedkv::PageGeometry::of<pagedkv::HND>(16, 8, 128);
  EXPECT_EQ(hnd.token_stride, 128);
  EXPECT_EQ(hnd.head_stride, 16 * 128);
  EXPECT_EQ(hnd.page_elems, 16 * 8 * 128);
  EXPECT_EQ(pagedkv::HND::page_shape(16, 8, 128), (std::array<int64_t, 3>{8, 16, 128}));
}

// Writes and their checks find page columns with PageDivisor: a shift for
// power-of-two page sizes, a division otherwise. Both must agree with / for
// every page size, up to positions near INT64_MAX.
TEST(PageDivisor, AgreesWithDivisionForEveryPageSize) {
  std::vector<int64_t> sizes;
  for (int64_t p = 1; p <= 70; ++p) sizes.push_back(p);
  for (const int shift : {10, 20, 40, 62}) sizes.insert(sizes.end(), {int64_t{1} << shift, (int64_t{1} << shift) + 1});
  std::vector<int64_t> positions;
  for (int64_t pos = 0; pos < 300; ++pos) positions.push_back(pos);
  for (int64_t back = 0; back < 300; ++back) positions.push_back(std::numeric_limits<int64_t>::max() - back);
  for (const int shift : {31, 32, 33, 62}) positions.push_back(int64_t{1} << shift);
  for (const int64_t page_size : sizes) {
    const pagedkv::PageDivisor pages(page_size);
    EXPECT_EQ(pages.page_size(), page_size);
    for (const int64_t pos : positions) {
      ASSERT_EQ(pages.column(pos), pos / page_size) << "page_size " << page_size << " position " << pos;
    }
  }
}

// ctest lists every device-parametrised test by the name gtest prints for
// its parameter: the target's name, not a dump of the struct's bytes.
// The attention kernel reads page tables through AnyPageTableRef: every
// entry of a strided (transposed) table, int32 and int64, must read as
// PageTableRef reads it, an int64 entry above 2^31 included.
TEST(AnyPageTableRef, ReadsWhatPageTableRefReadsForBothIndexTypes) {
  for (const at::ScalarType dtype : {at::kInt, at::kLong}) {
    at::Tensor table = at::arange(12, at::TensorOptions().dtype(dtype)).view({3, 4}).mul(7).sub(1).t();  // [4, 3], strided
    if (dtype == at::kLong) table[3][2] = int64_t{1} << 40;
    pagedkv::visit_page_table(table, [&](const auto& typed) {
      const pagedkv::AnyPageTableRef any(typed);
      EXPECT_EQ(any.is_int32, dtype == at::kInt);
      for (int64_t row = 0; row < table.size(0); ++row)
        for (int64_t col = 0; col < table.size(1); ++col)
          EXPECT_EQ(any(row, col), typed(row, col)) << "row " << row << " col " << col;
      return 0;
    });
    EXPECT_EQ(pagedkv::visit_page_table(table, [](const auto& t) { return pagedkv::AnyPageTableRef(t)(3, 2); }),
              dtype == at::kLong ? int64_t{1} << 40 : 76);  // t[3][2] = (4 * 2 + 3) * 7 - 1
  }
}

TEST(TestSupport, TargetsPrintByName) {
  std::vector<std::string> printed;
  for (const Target& target : all_targets()) printed.push_back(::testing::PrintToString(target));
  EXPECT_EQ(printed, (std::vector<std::string>{"cpu", "cpu_generic", "cuda"}));
}

}  // namespace
