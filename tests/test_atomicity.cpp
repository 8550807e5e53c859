// Failure atomicity: every public mutating call, made to fail as late as its
// validation allows (the last row of a page table bad, the last page it
// touches freed, v wrong after k was fine, ...), throws c10::Error and leaves
// the K/V tensors, every ref_count and n_free bit-identical to before.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "pagedkv/pagedkv.hpp"
#include "test_support.hpp"

namespace pagedkv {
struct PagePoolTestAccess {
  static std::vector<int32_t>& refs(PagePool& p) { return p.refs_; }
};
}  // namespace pagedkv

namespace {

using namespace pagedkv_test;

constexpr int64_t kLayers = 2, kPages = 16, kPageSize = 3, kHeads = 2, kHeadDim = 4;

/// Everything a failed call must leave alone, and the cache still passes check().
template <class Cache>
void expect_unchanged(const CacheSnapshot& before, const Cache& cache) {
  before.expect_same(cache);
  EXPECT_NO_THROW(cache.check());
}

/// `call` must throw c10::Error mentioning `fragment` and change nothing.
template <class Cache, class F>
void expect_atomic_failure(const Cache& cache, const std::string& fragment, F&& call) {
  const CacheSnapshot before(cache);
  expect_error(call, {fragment});
  expect_unchanged(before, cache);
}

/// The page formats of the quantized instantiation (QuantizedTargets):
/// every test also runs on a cache with fp8 keys and int8 values, so a
/// failed call must leave codes and scales alone too.
bool quantized_target(const pagedkv_test::Target& target) {
  return std::string(target.name).find("_fp8_int8") != std::string::npos;
}

std::vector<pagedkv_test::Target> quantized_targets() {
  return {{at::kCPU, pagedkv::Backend::automatic, "cpu_fp8_int8"},
          {at::kCPU, pagedkv::Backend::generic, "cpu_generic_fp8_int8"},
          {at::kCUDA, pagedkv::Backend::automatic, "cuda_fp8_int8"}};
}

class Atomicity : public TargetTest {
 protected:
  pagedkv::KVQuant quant() const {
    return quantized_target(GetParam()) ? pagedkv::KVQuant{pagedkv::KVFormat::fp8_e4m3, pagedkv::KVFormat::int8}
                                        : pagedkv::KVQuant{};
  }

  at::TensorOptions opts() const { return TargetTest::opts(at::kHalf); }

  /// A cache whose 12 allocated pages all hold distinct data, some shared
  /// (ref_count 2), 4 pages free.
  PagedCache<pagedkv::NHD> make_cache() const {
    PagedCache<pagedkv::NHD> cache(kLayers, kPages, kPageSize, kHeads, kHeadDim, opts(), quant());
    const auto pages = cache.alloc_n(12);
    cache.retain(pages[2]);
    cache.retain(pages[5]);
    const at::Tensor t = table({{pages[0], pages[1], pages[2], pages[3]},
                                {pages[4], pages[5], pages[6], pages[7]},
                                {pages[8], pages[9], pages[10], pages[11]}});
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      cache.write(layer, t, 0, pattern({3, 12, kHeads, kHeadDim}, layer, opts()),
                  pattern({3, 12, kHeads, kHeadDim}, layer + 10, opts()));
    }
    return cache;
  }

  at::Tensor kv(int64_t batch, int64_t seq, int64_t seed) const {
    return pattern({batch, seq, kHeads, kHeadDim}, seed, opts());
  }
};

// ---- pool calls (PagedCache forwards them to its PagePool) ----

TEST_P(Atomicity, AllocWhenExhaustedReturnsMinusOneAndChangesNothing) {
  auto cache = make_cache();
  cache.alloc_n(cache.n_free());
  const CacheSnapshot before(cache);
  EXPECT_EQ(cache.alloc(), -1);
  expect_unchanged(before, cache);
}

TEST_P(Atomicity, AllocNOneMoreThanFreeChangesNothing) {
  auto cache = make_cache();
  const CacheSnapshot before(cache);
  EXPECT_TRUE(cache.alloc_n(cache.n_free() + 1).empty());  // the last page is missing
  expect_unchanged(before, cache);
  EXPECT_EQ(cache.alloc_n(cache.n_free()).size(), 4u);
}

TEST_P(Atomicity, AllocNNegative) {
  auto cache = make_cache();
  expect_atomic_failure(cache, "alloc_n: argument 'n' expected >= 0, got -1", [&] { cache.alloc_n(-1); });
}

TEST_P(Atomicity, DoubleFreeOfTheLastPageFreed) {
  auto cache = make_cache();
  cache.free(11);
  expect_atomic_failure(cache, "double free", [&] { cache.free(11); });
}

TEST_P(Atomicity, FreeOutOfRange) {
  auto cache = make_cache();
  expect_atomic_failure(cache, "free: argument 'page' expected in [0, 16), got 16", [&] { cache.free(kPages); });
  expect_atomic_failure(cache, "got -1", [&] { cache.free(-1); });
}

TEST_P(Atomicity, RetainOfAFreePageAndOutOfRange) {
  auto cache = make_cache();
  expect_atomic_failure(cache, "retain of a free page", [&] { cache.retain(15); });
  expect_atomic_failure(cache, "retain: argument 'page' expected in [0, 16)", [&] { cache.retain(1 << 20); });
}

TEST_P(Atomicity, RetainAtTheRefCountLimit) {
  auto cache = make_cache();
  pagedkv::PagePoolTestAccess::refs(cache.pool())[3] = std::numeric_limits<int32_t>::max();
  expect_atomic_failure(cache, "at the limit", [&] { cache.retain(3); });
}

TEST_P(Atomicity, RetainAllAtTheRefCountLimit) {
  auto cache = make_cache();
  pagedkv::PagePoolTestAccess::refs(cache.pool())[3] = std::numeric_limits<int32_t>::max() - 1;
  // pages[1] takes page 3 to the limit, pages[2] would pass it: both undone.
  expect_atomic_failure(cache, "retain_all: argument 'pages' expected ref_counts < 2147483647, got page 3 at pages[2]",
                        [&] { cache.pool().retain_all({0, 3, 3}); });
}

// ---- write(layer, page_table, int start_pos, k, v) ----

TEST_P(Atomicity, WriteWhoseLastRowHasABadPageId) {
  auto cache = make_cache();
  // Rows 0 and 1 are fine; row 2's last touched column is out of range.
  const at::Tensor t = table({{0, 1, 2}, {4, 5, 6}, {8, 9, kPages}});
  expect_atomic_failure(cache, "page_table[2][2], got 16", [&] { cache.write(1, t, 1, kv(3, 8, 5), kv(3, 8, 6)); });
}

TEST_P(Atomicity, WriteWhoseLastPageWasFreed) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}}, at::kInt);
  cache.free(11);  // the last page of the last row
  expect_atomic_failure(cache, "use after free", [&] { cache.write(0, t, 0, kv(3, 12, 5), kv(3, 12, 6)); });
}

TEST_P(Atomicity, WriteWhoseLastRowIsUnmappedAtTheEnd) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, -1}});
  expect_atomic_failure(cache, "(unmapped)", [&] { cache.write(1, t, 2, kv(3, 10, 5), kv(3, 10, 6)); });
}

TEST_P(Atomicity, WriteWhoseVIsBadAfterKWasFine) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1}, {4, 5}, {8, 9}});
  const at::Tensor v = pattern({3, 4, kHeads, kHeadDim}, 6, opts().dtype(at::kFloat));
  expect_atomic_failure(cache, "argument 'v' expected dtype Half", [&] { cache.write(0, t, 0, kv(3, 4, 5), v); });
  expect_atomic_failure(cache, "'k' and 'v' expected equal shapes",
                        [&] { cache.write(0, t, 0, kv(3, 4, 5), kv(3, 3, 6)); });
}

TEST_P(Atomicity, WritePastTheLastColumn) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1}, {4, 5}, {8, 9}});
  expect_atomic_failure(cache, "a write past the last column", [&] { cache.write(0, t, 4, kv(3, 3, 5), kv(3, 3, 6)); });
}

// Regression (found by the fuzzer under UBSan): a start_pos near INT64_MAX
// made the error message's "last position" overflow int64.
TEST_P(Atomicity, WriteAtAHugeStartPosReportsTheLastPositionWithoutOverflow) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1}, {4, 5}, {8, 9}});
  const int64_t start = std::numeric_limits<int64_t>::max() - 1;
  expect_atomic_failure(cache, "got last position 9223372036854775810",
                        [&] { cache.write(0, t, start, kv(3, 5, 5), kv(3, 5, 6)); });
  expect_atomic_failure(cache, "got last position 9223372036854775807",
                        [&] { cache.write(0, t, ints({0, 0, start + 1}), kv(3, 1, 5), kv(3, 1, 6)); });
}

// ---- write(layer, page_table, Tensor start_pos, k, v) ----

TEST_P(Atomicity, WriteWhoseLastStartPosIsNegative) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1}, {4, 5}, {8, 9}});
  expect_atomic_failure(cache, "start_pos[2] = -1",
                        [&] { cache.write(0, t, ints({0, 1, -1}), kv(3, 2, 5), kv(3, 2, 6)); });
}

TEST_P(Atomicity, WriteWhoseLastRowRunsPastTheTable) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1}, {4, 5}, {8, 9}});
  expect_atomic_failure(cache, "in row 2", [&] { cache.write(1, t, ints({0, 2, 3}), kv(3, 4, 5), kv(3, 4, 6)); });
}

TEST_P(Atomicity, WriteWithPerSequenceStartsWhoseLastPageWasFreed) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}});
  cache.free(11);
  expect_atomic_failure(cache, "page_table[2][3], got page 11 which is free",
                        [&] { cache.write(1, t, ints({0, 3, 6}, at::kInt), kv(3, 6, 5), kv(3, 6, 6)); });
}

TEST_P(Atomicity, WriteWithAStartPosOfTheWrongSize) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1}, {4, 5}, {8, 9}});
  expect_atomic_failure(cache, "argument 'start_pos' expected shape [3]",
                        [&] { cache.write(0, t, ints({0, 1}), kv(3, 2, 5), kv(3, 2, 6)); });
}

// ---- a wide batch: a kernel that wrote while validating would be caught ----

TEST_P(Atomicity, WideBatchWhoseLastRowFails) {
  PagedCache<pagedkv::NHD> cache(1, 64, 4, kHeads, kHeadDim, opts(), quant());
  const auto pages = cache.alloc_n(64);
  std::vector<std::vector<int64_t>> rows;
  for (int64_t r = 0; r < 16; ++r) rows.push_back({pages[4 * r], pages[4 * r + 1], pages[4 * r + 2], pages[4 * r + 3]});
  cache.write(0, table(rows), 0, kv(16, 16, 1), kv(16, 16, 2));
  cache.free(pages[63]);
  expect_atomic_failure(cache, "page_table[15][3]", [&] { cache.write(0, table(rows), 0, kv(16, 16, 3), kv(16, 16, 4)); });
}

// ---- copy_pages: the last pair of the lists is the bad one ----

TEST_P(Atomicity, CopyPagesWhoseLastPairIsBad) {
  auto cache = make_cache();
  // pages 2 and 5 are shared (ref_count 2): no copy may land on them.
  expect_atomic_failure(cache, "dst[2] = 5 with ref_count 2",
                        [&] { cache.copy_pages(ints({0, 1, 3}), ints({8, 9, 5})); });
  expect_atomic_failure(cache, "distinct pages", [&] { cache.copy_pages(ints({0, 1, 3}), ints({8, 9, 8})); });
  cache.free(11);
  expect_atomic_failure(cache, "dst[2] = 11 which is free",
                        [&] { cache.copy_pages(ints({0, 1, 3}), ints({8, 9, 11}, at::kInt)); });
  expect_atomic_failure(cache, "src[2] = 11 which is free",
                        [&] { cache.copy_pages(ints({0, 1, 11}), ints({8, 9, 10})); });
  expect_atomic_failure(cache, "src[2] = 16", [&] { cache.copy_pages(ints({0, 1, 16}), ints({8, 9, 10})); });
}

// ---- CacheView (its page table is shared: the engine may change it) ----

TEST_P(Atomicity, ViewWriteAfterTheEngineFreedTheLastPage) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}});
  const auto view = cache.bind(t, ints({12, 12, 12}));
  cache.free(11);
  expect_atomic_failure(cache, "use after free", [&] { view.write(0, 9, kv(3, 3, 5), kv(3, 3, 6)); });
  expect_atomic_failure(cache, "use after free", [&] { view.write(0, ints({0, 0, 9}), kv(3, 3, 5), kv(3, 3, 6)); });
  expect_atomic_failure(cache, "use after free", [&] { view.gather(0); });
}

TEST_P(Atomicity, ViewWriteAfterTheEngineEditedTheTableInPlace) {
  auto cache = make_cache();
  at::Tensor t = table({{0, 1}, {4, 5}, {8, 9}});
  const auto view = cache.bind(t);
  t[2][1] = kPages + 3;
  expect_atomic_failure(cache, "page_table[2][1], got 19", [&] { view.write(1, 0, kv(3, 6, 5), kv(3, 6, 6)); });
}

// ---- reads and binds change nothing either when they fail ----

TEST_P(Atomicity, FailedGatherAndBindChangeNothing) {
  auto cache = make_cache();
  const at::Tensor t = table({{0, 1}, {4, 5}, {8, -1}});
  expect_atomic_failure(cache, "lengths", [&] { cache.gather(0, t, ints({6, 6, 6})); });
  expect_atomic_failure(cache, "lengths", [&] { cache.bind(t, ints({6, 6, 4})); });
  expect_atomic_failure(cache, "total_len", [&] { cache.bind(t, 7); });
  cache.free(9);
  expect_atomic_failure(cache, "use after free", [&] { cache.gather(1, table({{0, 1}, {4, 5}, {8, 9}})); });
}

INSTANTIATE_TEST_SUITE_P(Targets, Atomicity, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);
INSTANTIATE_TEST_SUITE_P(QuantizedTargets, Atomicity, ::testing::ValuesIn(quantized_targets()),
                         pagedkv_test::target_name);

// ---- construction ----

// Regression (found by UBSan): the page geometry (page_size x n_kv_heads x
// head_dim) and the storage size were computed in int64 before anything
// bounded them, so huge sizes overflowed (undefined behaviour) on the way to
// the allocator.
TEST(AtomicityConstruction, SizesWhoseProductOverflowsAreRejected) {
  const int64_t big = int64_t{1} << 40;
  const std::string expected = "expected n_layers x n_pages x page_size x n_kv_heads x head_dim x element size <= ";
  try {
    PagedCache<pagedkv::NHD>(1, 1, big, big, 1);
    ADD_FAILURE() << "no throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("pagedkv::PagedCache<NHD>::PagedCache: " + expected),
              std::string::npos)
        << e.what_without_backtrace();
    EXPECT_NE(std::string(e.what_without_backtrace()).find("got 1 x 1 x 1099511627776 x 1099511627776 x 1 x 2"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_THROW(PagedCache<pagedkv::HND>(1, 1, 1, big, big), c10::Error);
  EXPECT_THROW(PagedCache<pagedkv::NHD>(big, big, 1, 1, 1), c10::Error);
  EXPECT_THROW(PagedCache<pagedkv::NHD>(1, 0, big, big, 1), c10::Error);  // n_pages bad too: still no overflow
  EXPECT_THROW(PagedCache<pagedkv::NHD>(1, 1, 1, 1, int64_t{1} << 62, at::TensorOptions().dtype(at::kFloat)),
               c10::Error);  // fits in elements, not in bytes
}

}  // namespace
