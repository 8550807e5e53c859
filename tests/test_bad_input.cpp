// Every bad input of the API (docs/cache.md, "Bad input"): the call throws c10::Error whose message
// names the function, the argument, what was expected and what was given,
// and the cache and pool are exactly as before.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {

using namespace pagedkv_test;

/// Expects `call` to throw c10::Error containing every phrase, and the cache
/// to be unchanged afterwards.
template <class L>
void expect_rejected(PagedCache<L>& cache, const std::function<void()>& call, const std::vector<std::string>& phrases) {
  const CacheSnapshot before(cache);
  expect_error(call, phrases);
  before.expect_same(cache);
}

class BadInputTest : public TargetTest {
 protected:
  /// A cache with written data on pages 0..5 (rows {0,1,2}, {3,4,5}), page
  /// 6 free, page 7 shared.
  template <class L>
  PagedCache<L> filled() {
    PagedCache<L> cache(2, 8, 4, 2, 3, opts());
    cache.alloc_n(8);
    cache.free(6);
    cache.retain(7);
    const at::Tensor k = pattern({2, 12, 2, 3}, 1, opts());
    cache.write(0, good_table(), 0, k, k);
    cache.write(1, good_table(), 0, k, k);
    return cache;
  }
  at::Tensor good_table(at::ScalarType dtype = at::kLong) const { return table({{0, 1, 2}, {3, 4, 5}}, dtype); }
  at::Tensor kv(int64_t batch, int64_t seq, int64_t heads = 2, int64_t dim = 3,
                at::ScalarType dtype = at::kFloat) const {
    return pattern({batch, seq, heads, dim}, 9, opts(dtype));
  }
};

TEST_P(BadInputTest, LayerOutOfRange) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    const at::Tensor k = kv(2, 1);
    expect_rejected(cache, [&] { cache.write(2, good_table(), 0, k, k); },
                    {"PagedCache<", "::write", "argument 'layer' expected in [0, 2), got 2"});
    expect_rejected(cache, [&] { cache.write(-1, good_table(), ints({0, 0}), k, k); }, {"got -1"});
    expect_rejected(cache, [&] { cache.gather(5, good_table()); }, {"::gather", "'layer'", "got 5"});
    expect_rejected(cache, [&] { cache.gather(2, good_table(), ints({1, 1})); }, {"'layer'"});
    expect_rejected(cache, [&] { cache.bind(good_table(), 0).gather(3); }, {"'layer'"});
    expect_rejected(cache, [&] { cache.bind(good_table(), 4).gather(3); }, {"CacheView<", "'layer'"});
  });
}

TEST_P(BadInputTest, NegativeStartPos) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    const at::Tensor k = kv(2, 1);
    expect_rejected(cache, [&] { cache.write(0, good_table(), -1, k, k); },
                    {"::write", "argument 'start_pos' expected >= 0, got -1"});
    expect_rejected(cache, [&] { cache.write(0, good_table(), ints({0, -3}), k, k); },
                    {"'start_pos' expected every value >= 0", "start_pos[1] = -3"});
  });
}

TEST_P(BadInputTest, WritePastTheLastColumn) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    expect_rejected(cache, [&] { cache.write(0, good_table(), 10, kv(2, 3), kv(2, 3)); },
                    {"::write", "past the last column", "last position 12"});
    // only the last row runs past: found late, still nothing written
    expect_rejected(cache, [&] { cache.write(0, good_table(), ints({0, 11}), kv(2, 2), kv(2, 2)); },
                    {"in row 1", "past the last column"});
    expect_rejected(cache, [&] { cache.write(0, good_table(), int64_t{1} << 62, kv(2, 2), kv(2, 2)); },
                    {"past the last column"});
  });
}

TEST_P(BadInputTest, UnmappedOrOutOfRangePageAtAWrittenPosition) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    const at::Tensor unmapped = table({{0, 1, 2}, {3, -1, 5}});
    expect_rejected(cache, [&] { cache.write(0, unmapped, 2, kv(2, 4), kv(2, 4)); },
                    {"::write", "argument 'page_table' expected a page id in [0, 8) at page_table[1][1], got -1",
                     "(unmapped)"});
    // a -1 in a column the write does not touch is fine (checked below by a good call)
    cache.write(0, unmapped, 0, kv(2, 4), kv(2, 4));
    expect_rejected(cache, [&] { cache.write(0, table({{0, 1, 2}, {3, 4, 8}}), 8, kv(2, 1), kv(2, 1)); },
                    {"page_table[1][2], got 8"});
    expect_rejected(cache, [&] { cache.write(0, table({{0, 1, 2}, {3, 4, -7}}, at::kInt), 8, kv(2, 1), kv(2, 1)); },
                    {"got -7"});
    expect_rejected(cache, [&] { cache.gather(0, table({{0, 1, 2}, {3, 4, 99}})); },
                    {"::gather", "page_table[1][2], got 99"});
    expect_rejected(cache, [&] { cache.gather(0, table({{0, -2}, {3, 4}})); }, {"page_table[0][1], got -2"});
  });
}

TEST_P(BadInputTest, WriteIntoAFreedPage) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    const at::Tensor with_free = table({{0, 1, 2}, {3, 4, 6}});
    expect_rejected(cache, [&] { cache.write(0, with_free, 8, kv(2, 1), kv(2, 1)); },
                    {"::write", "expected an allocated page at page_table[1][2], got page 6", "use after free"});
    expect_rejected(cache, [&] { cache.write(1, with_free, ints({0, 8}), kv(2, 2), kv(2, 2)); }, {"use after free"});
    expect_rejected(cache, [&] { cache.gather(0, with_free); }, {"::gather", "use after free"});
    expect_rejected(cache, [&] { cache.gather(0, with_free, ints({1, 9})); }, {"use after free"});
  });
}

TEST_P(BadInputTest, KeysAndValuesOfTheWrongShapeDtypeOrDevice) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    const at::Tensor pt = good_table();
    const at::Tensor good = kv(2, 1);
    expect_rejected(cache, [&] { cache.write(0, pt, 0, good[0], good); },
                    {"::write", "argument 'k' expected 4-D [batch, seq, n_kv_heads, head_dim], got 3-D"});
    expect_rejected(cache, [&] { cache.write(0, pt, 0, good, kv(2, 1, 3)); },
                    {"argument 'v' expected n_kv_heads 2 at dim 2, got shape [2, 1, 3, 3]"});
    expect_rejected(cache, [&] { cache.write(0, pt, 0, kv(2, 1, 2, 4), kv(2, 1, 2, 4)); },
                    {"argument 'k' expected head_dim 3 at dim 3"});
    expect_rejected(cache, [&] { cache.write(0, pt, 0, kv(3, 1), kv(3, 1)); },
                    {"argument 'k' expected batch 2 (page_table rows) at dim 0"});
    expect_rejected(cache, [&] { cache.write(0, pt, 0, kv(2, 1, 2, 3, at::kHalf), good); },
                    {"argument 'k' expected dtype Float (the cache's), got Half"});
    expect_rejected(cache, [&] { cache.write(0, pt, 0, good, kv(2, 2)); },
                    {"arguments 'k' and 'v' expected equal shapes"});
    expect_rejected(cache, [&] { cache.write(0, pt, 0, at::Tensor(), good); }, {"'k' expected a tensor"});
    if (GetParam().device != at::kCPU) {
      expect_rejected(cache, [&] { cache.write(0, pt, 0, good.cpu(), good.cpu()); },
                      {"argument 'k' expected on cuda", "got cpu"});
    }
  });
}

TEST_P(BadInputTest, PageTableNot2DOrNotIntegers) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    const at::Tensor k = kv(2, 1);
    expect_rejected(cache, [&] { cache.write(0, ints({0, 3}), 0, k, k); },
                    {"::write", "argument 'page_table' expected 2-D [batch, max_pages], got 1-D"});
    expect_rejected(cache, [&] { cache.write(0, good_table().to(at::kFloat), 0, k, k); },
                    {"argument 'page_table' expected dtype int32 or int64, got Float"});
    expect_rejected(cache, [&] { cache.gather(0, good_table().to(at::kShort)); }, {"::gather", "got Short"});
    expect_rejected(cache, [&] { cache.bind(good_table().unsqueeze(0)); }, {"::bind", "got 3-D"});
    expect_rejected(cache, [&] { cache.gather(0, at::Tensor()); }, {"'page_table' expected a tensor"});
  });
}

TEST_P(BadInputTest, LengthsOrStartPosOfTheWrongSize) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    const at::Tensor k = kv(2, 1);
    expect_rejected(cache, [&] { cache.write(0, good_table(), ints({0}), k, k); },
                    {"::write", "argument 'start_pos' expected shape [2] (one per page_table row), got [1]"});
    expect_rejected(cache, [&] { cache.write(0, good_table(), ints({0, 0}).to(at::kFloat), k, k); },
                    {"'start_pos' expected dtype int32 or int64"});
    expect_rejected(cache, [&] { cache.gather(0, good_table(), ints({1, 2, 3})); },
                    {"::gather", "argument 'lengths' expected shape [2]"});
    expect_rejected(cache, [&] { cache.bind(good_table(), ints({1, 2}).view({1, 2})); },
                    {"::bind", "argument 'lengths' expected shape [2]"});
    expect_rejected(cache, [&] { cache.gather(0, good_table(), ints({1, -1})); }, {"lengths[1] = -1"});
  });
}

TEST_P(BadInputTest, LengthOrTotalLenLargerThanTheMappedTokens) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    expect_rejected(cache, [&] { cache.bind(good_table(), 13); },
                    {"::bind", "argument 'total_len' expected <= 12 (the tokens the page table maps), got 13"});
    expect_rejected(cache, [&] { cache.bind(good_table(), -2); }, {"'total_len' expected >= 0, got -2"});
    expect_rejected(cache, [&] { cache.gather(0, good_table(), ints({12, 13})); },
                    {"::gather", "expected lengths[1] <= 12", "got 13"});
    expect_rejected(cache, [&] { cache.gather(0, table({{0, 1, 2}, {3, -1, 5}}), ints({12, 5})); },
                    {"lengths[1] <= 4", "first -1 at column 1", "got 5"});
    expect_rejected(cache, [&] { cache.bind(table({{0, 1, 2}, {3, -1, 5}}), ints({3, 9})); },
                    {"::bind", "lengths[1] <= 4"});
    // a view whose table lost its pages after bind: found at gather time
    at::Tensor shrinking = good_table();
    auto view = cache.bind(shrinking, 12);
    shrinking.select(1, 2).fill_(-1);
    expect_rejected(cache, [&] { view.gather(0); }, {"CacheView<", "'total_len' expected <= 8", "got 12"});
  });
}

TEST_P(BadInputTest, PoolMisuseThroughTheCache) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = filled<L>();
    expect_rejected(cache, [&] { cache.free(6); }, {"PagePool::free", "double free"});
    expect_rejected(cache, [&] { cache.retain(6); }, {"PagePool::retain", "retain of a free page"});
    expect_rejected(cache, [&] { cache.free(8); }, {"expected in [0, 8), got 8"});
    expect_rejected(cache, [&] { cache.alloc_n(-2); }, {"'n' expected >= 0, got -2"});
  });
}

TEST_P(BadInputTest, ConstructorArguments) {
  EXPECT_THROW(PagedCache<NHD>(0, 4, 4, 1, 1, opts()), c10::Error);
  EXPECT_THROW(PagedCache<NHD>(1, 0, 4, 1, 1, opts()), c10::Error);
  EXPECT_THROW(PagedCache<HND>(1, 4, 0, 1, 1, opts()), c10::Error);
  EXPECT_THROW(PagedCache<HND>(1, 4, 4, -1, 1, opts()), c10::Error);
  try {
    PagedCache<HND>(1, 4, 4, 1, 0, opts());
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("PagedCache<HND>::PagedCache: argument 'head_dim' expected >= 1, got 0"),
              std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, BadInputTest, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);

}  // namespace
