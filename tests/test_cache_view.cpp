// CacheView: bind with total_len (the reference's semantics) or with
// per-sequence lengths; write/gather through the view; cheap copies.
#include <gtest/gtest.h>

#include <type_traits>
#include <vector>

#include "test_support.hpp"

namespace {

using pagedkv::CacheView;
using namespace pagedkv_test;

static_assert(std::is_copy_constructible<CacheView<NHD>>::value, "views are passed by value to layers");
static_assert(sizeof(CacheView<HND>) <= 6 * sizeof(void*),
              "a view is a pointer, two tensor handles, a length and (CUDA kernels) a shared_ptr to bind's state");

class CacheViewTest : public TargetTest {
 protected:
  at::TensorOptions opts() const { return TargetTest::opts(at::kHalf); }
};

TEST_P(CacheViewTest, TotalLenTruncatesLikeTheReference) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(2, 8, 4, 2, 8, opts());
    const auto pages = cache.alloc_n(6);
    const at::Tensor pt = table({{pages[3], pages[1], pages[5]}, {pages[0], pages[4], pages[2]}});
    const at::Tensor k = pattern({2, 12, 2, 8}, 1, opts());
    const at::Tensor v = pattern({2, 12, 2, 8}, 2, opts());
    auto all = cache.bind(pt);  // total_len 0 = everything mapped
    all.write(1, 0, k, v);
    const auto kv_all = all.gather(1);
    EXPECT_TRUE(bitwise_equal(kv_all.first, k));
    EXPECT_TRUE(bitwise_equal(kv_all.second, v));
    const auto kv_7 = cache.bind(pt, 7).gather(1);
    EXPECT_TRUE(bitwise_equal(kv_7.first, k.slice(1, 0, 7)));
    EXPECT_TRUE(bitwise_equal(kv_7.second, v.slice(1, 0, 7)));
    EXPECT_TRUE(kv_7.first.is_contiguous());
  });
}

TEST_P(CacheViewTest, PerSequenceLengthsAndStartsForContinuousBatching) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(1, 8, 4, 1, 4, opts());
    cache.alloc_n(8);
    const at::Tensor pt = table({{0, 1, 2, 3}, {4, 5, 6, 7}}, at::kInt).to(GetParam().device);
    // prefill: sequence 0 has 5 tokens, sequence 1 has 2 (written as 5, read as 2)
    const at::Tensor prompt = pattern({2, 5, 1, 4}, 3, opts());
    cache.write(0, pt, 0, prompt, prompt);
    // one decode step: each sequence appends at its own length
    const at::Tensor lengths = ints({6, 3}, at::kInt).to(GetParam().device);
    auto view = cache.bind(pt, lengths);
    const at::Tensor step = pattern({2, 1, 1, 4}, 4, opts());
    view.write(0, ints({5, 2}), step, step);
    const auto kv = view.gather(0);
    ASSERT_EQ(kv.first.sizes(), (std::vector<int64_t>{2, 6, 1, 4}));
    EXPECT_TRUE(bitwise_equal(kv.first[0].slice(0, 0, 5), prompt[0]));
    EXPECT_TRUE(bitwise_equal(kv.first[0][5], step[0][0]));
    EXPECT_TRUE(bitwise_equal(kv.first[1].slice(0, 0, 2), prompt[1].slice(0, 0, 2)));
    EXPECT_TRUE(bitwise_equal(kv.first[1][2], step[1][0]));
    EXPECT_EQ(kv.first[1].slice(0, 3).abs().sum().template item<float>(), 0.0f);
    EXPECT_TRUE(view.lengths().defined());
    EXPECT_EQ(view.total_len(), 0);
    EXPECT_EQ(&view.cache(), &cache);
  });
}

TEST_P(CacheViewTest, CopiesShareTheCacheAndSeeInPlaceTableUpdates) {
  PagedCache<NHD> cache(1, 4, 2, 1, 2, opts());
  cache.alloc_n(4);
  at::Tensor pt = table({{0, 1}});
  const auto view = cache.bind(pt, 4);
  const auto copy = view;  // NOLINT(performance-unnecessary-copy-initialization): copying is the point
  const at::Tensor k = pattern({1, 4, 1, 2}, 5, opts());
  copy.write(0, 0, k, k);
  EXPECT_TRUE(bitwise_equal(view.gather(0).first, k));
  pt[0][1] = 3;  // the engine remaps a page in place; the view follows
  EXPECT_TRUE(bitwise_equal(view.gather(0).first.slice(1, 0, 2), k.slice(1, 0, 2)));
  EXPECT_EQ(view.gather(0).first.slice(1, 2).abs().sum().item<float>(), 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Targets, CacheViewTest, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);

}  // namespace
