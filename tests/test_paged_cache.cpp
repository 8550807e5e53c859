// PagedCache write/gather: round trips for both layouts, every dtype, page
// sizes that are not powers of two, int32/int64 tables, strided k/v, and
// edge cases — on every test target (cpu, cpu_generic, cuda).
#include <gtest/gtest.h>

#include <type_traits>
#include <vector>

#include "test_support.hpp"

namespace {

using namespace pagedkv_test;

// A copy would share storage but not the pool: two pools, one set of pages.
static_assert(!std::is_copy_constructible<PagedCache<NHD>>::value, "PagedCache must not be copyable");
static_assert(!std::is_copy_assignable<PagedCache<HND>>::value, "PagedCache must not be copyable");
static_assert(std::is_nothrow_move_constructible<PagedCache<NHD>>::value, "PagedCache is movable");

class PagedCacheTest : public TargetTest {};

// CPU storage of 2 MiB or more starts at a 2 MiB boundary (cpu/storage.hpp):
// torch's allocator alone left it 64 bytes past a 4 KiB boundary, so every
// page straddled one. Still zeroed, contiguous, and a cache like any other.
TEST(PagedCacheStorage, LargeCpuStorageStartsAtATwoMiBBoundary) {
  PagedCache<HND> cache(2, 64, 16, 8, 128, at::TensorOptions().dtype(at::kHalf));  // 2 MiB per layer and side
  for (const at::Tensor* t : {&cache.k_cache(), &cache.v_cache()}) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data_ptr()) % (uintptr_t{2} << 20), 0u);
    EXPECT_TRUE(t->is_contiguous());
    EXPECT_EQ(t->sizes(), (std::vector<int64_t>{2, 64, 8, 16, 128}));
    EXPECT_EQ(at::count_nonzero(*t).item<int64_t>(), 0);
  }
  const auto pages = cache.alloc_n(2);
  const at::Tensor pt = at::tensor(std::vector<int64_t>{pages[0], pages[1]}, at::kLong).view({1, 2});
  const at::Tensor k = at::randn({1, 20, 8, 128}).to(at::kHalf);
  const at::Tensor v = at::randn({1, 20, 8, 128}).to(at::kHalf);
  cache.write(1, pt, 0, k, v);
  const auto kv = cache.gather(1, pt, at::tensor(std::vector<int64_t>{20}, at::kLong));
  EXPECT_TRUE(at::equal(kv.first.slice(1, 0, 20), k));
  EXPECT_TRUE(at::equal(kv.second.slice(1, 0, 20), v));
  cache.check();
}

TEST_P(PagedCacheTest, StorageShapeFollowsTheLayout) {
  PagedCache<NHD> nhd(2, 5, 3, 4, 8, opts());
  EXPECT_EQ(nhd.k_cache().sizes(), (std::vector<int64_t>{2, 5, 3, 4, 8}));
  PagedCache<HND> hnd(2, 5, 3, 4, 8, opts());
  EXPECT_EQ(hnd.v_cache().sizes(), (std::vector<int64_t>{2, 5, 4, 3, 8}));
  EXPECT_EQ(hnd.k_cache().scalar_type(), at::kFloat);
  EXPECT_EQ(hnd.n_layers(), 2);
  EXPECT_EQ(hnd.n_pages(), 5);
  EXPECT_EQ(hnd.page_size(), 3);
  EXPECT_EQ(hnd.n_kv_heads(), 4);
  EXPECT_EQ(hnd.head_dim(), 8);
  EXPECT_EQ(hnd.n_free(), 5);
  PagedCache<> default_dtype(1, 1, 1, 1, 1, at::TensorOptions().device(GetParam().device).dtype(at::kHalf));
  EXPECT_EQ(default_dtype.k_cache().scalar_type(), at::kHalf);
}

TEST_P(PagedCacheTest, WriteLandsWhereTheLayoutSays) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(2, 4, 3, 2, 4, opts());
    const auto pages = cache.alloc_n(2);
    const at::Tensor pt = table({{pages[1], pages[0]}});
    const at::Tensor k = pattern({1, 4, 2, 4}, 1, opts());
    const at::Tensor v = pattern({1, 4, 2, 4}, 2, opts());
    cache.write(1, pt, 1, k, v);  // positions 1..4: page pages[1] offsets 1,2; page pages[0] offsets 0,1
    for (int64_t s = 0; s < 4; ++s) {
      const int64_t pos = 1 + s;
      const int64_t page = pos < 3 ? pages[1] : pages[0];
      const int64_t off = pos % 3;
      for (int64_t h = 0; h < 2; ++h) {
        const at::Tensor stored_k = std::is_same<L, NHD>::value ? cache.k_cache()[1][page][off][h]
                                                                : cache.k_cache()[1][page][h][off];
        const at::Tensor stored_v = std::is_same<L, NHD>::value ? cache.v_cache()[1][page][off][h]
                                                                : cache.v_cache()[1][page][h][off];
        EXPECT_TRUE(bitwise_equal(stored_k, k[0][s][h])) << L::name << " s=" << s << " h=" << h;
        EXPECT_TRUE(bitwise_equal(stored_v, v[0][s][h])) << L::name << " s=" << s << " h=" << h;
      }
    }
    // layer 0 and untouched offsets stay zero
    EXPECT_EQ(cache.k_cache()[0].abs().sum().template item<float>(), 0.0f);
  });
}

TEST_P(PagedCacheTest, RoundTripEveryDtypePageSizeAndIndexType) {
  for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kByte}) {
    for (int64_t page_size : {1, 3, 16}) {
      for (at::ScalarType index : {at::kInt, at::kLong}) {
        for_each_layout([&](auto layout) {
          using L = decltype(layout);
          const int64_t batch = 3, seq = 37, heads = 2, dim = 5;
          const int64_t cols = (seq + page_size - 1) / page_size;
          PagedCache<L> cache(2, batch * cols + 2, page_size, heads, dim, opts(dtype));
          auto pages = cache.alloc_n(batch * cols);
          std::reverse(pages.begin(), pages.end());  // scattered, descending
          std::vector<std::vector<int64_t>> rows(batch);
          for (int64_t b = 0; b < batch; ++b)
            for (int64_t c = 0; c < cols; ++c) rows[b].push_back(pages[static_cast<size_t>(b * cols + c)]);
          const at::Tensor pt = table(rows, index).to(GetParam().device);
          const at::Tensor k = pattern({batch, seq, heads, dim}, 3, opts(dtype));
          const at::Tensor v = pattern({batch, seq, heads, dim}, 4, opts(dtype));
          cache.write(1, pt, 0, k, v);
          const auto kv = cache.gather(1, pt, ints({seq, seq, seq}, index));
          EXPECT_TRUE(bitwise_equal(kv.first, k)) << L::name << " " << dtype << " P=" << page_size;
          EXPECT_TRUE(bitwise_equal(kv.second, v)) << L::name << " " << dtype << " P=" << page_size;
          EXPECT_TRUE(kv.first.is_contiguous());
          EXPECT_EQ(kv.first.device().type(), GetParam().device);
        });
      }
    }
  }
}

TEST_P(PagedCacheTest, ScalarStartMidPageAcrossManyPages) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(1, 40, 3, 2, 4, opts());
    std::vector<std::vector<int64_t>> rows(2);
    for (int64_t c = 0; c < 12; ++c) rows[0].push_back(cache.alloc());
    for (int64_t c = 0; c < 12; ++c) rows[1].push_back(cache.alloc());
    const at::Tensor pt = table(rows);
    const at::Tensor prefix_k = pattern({2, 7, 2, 4}, 5, opts());
    const at::Tensor prefix_v = pattern({2, 7, 2, 4}, 6, opts());
    cache.write(0, pt, 0, prefix_k, prefix_v);
    const at::Tensor k = pattern({2, 25, 2, 4}, 7, opts());
    const at::Tensor v = pattern({2, 25, 2, 4}, 8, opts());
    cache.write(0, pt, 7, k, v);  // starts mid-page, spans 9 pages
    const auto kv = cache.gather(0, pt, ints({32, 32}));
    EXPECT_TRUE(bitwise_equal(kv.first, at::cat({prefix_k, k}, 1)));
    EXPECT_TRUE(bitwise_equal(kv.second, at::cat({prefix_v, v}, 1)));
  });
}

TEST_P(PagedCacheTest, PerSequenceStartsWriteEachRowAtItsOwnPosition) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(1, 16, 4, 1, 2, opts());
    const at::Tensor pt = table({{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}});
    cache.alloc_n(12);
    const at::Tensor k = pattern({3, 3, 1, 2}, 9, opts());
    const at::Tensor v = pattern({3, 3, 1, 2}, 10, opts());
    for (at::ScalarType index : {at::kInt, at::kLong}) {
      cache.write(0, pt, ints({0, 3, 13}, index).to(GetParam().device), k, v);
      const auto kv = cache.gather(0, pt, ints({3, 6, 16}));
      EXPECT_TRUE(bitwise_equal(kv.first[0].slice(0, 0, 3), k[0]));
      EXPECT_TRUE(bitwise_equal(kv.first[1].slice(0, 3, 6), k[1]));
      EXPECT_TRUE(bitwise_equal(kv.second[2].slice(0, 13, 16), v[2]));
      // zero padding past each length
      EXPECT_EQ(kv.first[0].slice(0, 3).abs().sum().template item<float>(), 0.0f);
      EXPECT_EQ(kv.first[1].slice(0, 6).abs().sum().template item<float>(), 0.0f);
      EXPECT_EQ(kv.first.size(1), 16);
    }
  });
}

TEST_P(PagedCacheTest, StridedKeysAndValuesFromAFusedQkvProjection) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const int64_t heads = 2, dim = 4;
    PagedCache<L> cache(1, 8, 3, heads, dim, opts());
    const at::Tensor pt = table({{3, 1, 5}, {0, 2, 4}});
    cache.alloc_n(6);
    // [B, S, q_heads + 2 * kv_heads, D]: k and v are slices, not copies
    const at::Tensor qkv = pattern({2, 8, 4 + 2 * heads, dim}, 11, opts());
    const at::Tensor k = qkv.slice(2, 4, 4 + heads);
    const at::Tensor v = qkv.slice(2, 4 + heads, 4 + 2 * heads);
    ASSERT_FALSE(k.is_contiguous());
    cache.write(0, pt, 1, k, v);
    auto kv = cache.gather(0, pt, ints({9, 9}));
    EXPECT_TRUE(bitwise_equal(kv.first.slice(1, 1, 9), k.contiguous()));
    EXPECT_TRUE(bitwise_equal(kv.second.slice(1, 1, 9), v.contiguous()));
    // head-major source, transposed to [B, S, H, D]
    const at::Tensor k_t = pattern({2, heads, 8, dim}, 12, opts()).transpose(1, 2);
    const at::Tensor v_t = pattern({2, heads, 8, dim}, 13, opts()).transpose(1, 2);
    cache.write(0, pt, 0, k_t, v_t);
    kv = cache.gather(0, pt, ints({8, 8}));
    EXPECT_TRUE(bitwise_equal(kv.first, k_t.contiguous()));
    EXPECT_TRUE(bitwise_equal(kv.second, v_t.contiguous()));
    // every other element of the head dim (innermost stride 2)
    const at::Tensor wide = pattern({2, 8, heads, 2 * dim}, 14, opts());
    const at::Tensor k_s = wide.slice(3, 0, 2 * dim, 2);
    const at::Tensor v_s = wide.slice(3, 1, 2 * dim, 2);
    cache.write(0, pt, 0, k_s, v_s);
    kv = cache.gather(0, pt, ints({8, 8}));
    EXPECT_TRUE(bitwise_equal(kv.first, k_s.contiguous()));
    EXPECT_TRUE(bitwise_equal(kv.second, v_s.contiguous()));
    // a broadcast (stride 0) batch
    const at::Tensor one = pattern({1, 2, heads, dim}, 15, opts());
    cache.write(0, pt, 4, one.expand({2, 2, heads, dim}), one.expand({2, 2, heads, dim}));
    kv = cache.gather(0, pt, ints({6, 6}));
    EXPECT_TRUE(bitwise_equal(kv.first.slice(1, 4, 6), one.expand({2, 2, heads, dim}).contiguous()));
  });
}

TEST_P(PagedCacheTest, GatherWithoutLengthsStopsAtTheFirstUnmappedColumnAndZeroesHoles) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(1, 6, 2, 1, 3, opts());
    cache.alloc_n(6);
    const at::Tensor full = table({{0, 1, 2}, {3, 4, 5}});
    const at::Tensor k = pattern({2, 6, 1, 3}, 16, opts());
    const at::Tensor v = pattern({2, 6, 1, 3}, 17, opts());
    cache.write(0, full, 0, k, v);
    // column 1 is mapped only in row 0; column 2 nowhere; column 3 mapped again but never read
    const at::Tensor holes = table({{0, 1, -1, 2}, {3, -1, -1, 5}});
    const auto kv = cache.gather(0, holes);
    ASSERT_EQ(kv.first.sizes(), (std::vector<int64_t>{2, 4, 1, 3}));
    EXPECT_TRUE(bitwise_equal(kv.first[0], k[0].slice(0, 0, 4)));
    EXPECT_TRUE(bitwise_equal(kv.first[1].slice(0, 0, 2), k[1].slice(0, 0, 2)));
    EXPECT_EQ(kv.first[1].slice(0, 2).abs().sum().template item<float>(), 0.0f);
    EXPECT_EQ(kv.second[1].slice(0, 2).abs().sum().template item<float>(), 0.0f);
    // nothing mapped at all: an empty [B, 0, H, D] (the reference raises on torch.cat([]))
    const auto none = cache.gather(0, table({{-1, -1}, {-1, -1}}));
    EXPECT_EQ(none.first.sizes(), (std::vector<int64_t>{2, 0, 1, 3}));
  });
}

TEST_P(PagedCacheTest, EmptyWriteChangesNothing) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(1, 2, 2, 1, 2, opts());
    const at::Tensor before = cache.k_cache().clone();
    // even a table of unmapped pages is fine: an empty write touches none
    cache.write(0, table({{-1}}), 0, at::empty({1, 0, 1, 2}, opts()), at::empty({1, 0, 1, 2}, opts()));
    EXPECT_TRUE(bitwise_equal(cache.k_cache(), before));
    // a batch of zero sequences
    cache.write(0, at::empty({0, 3}, at::kLong), 0, at::empty({0, 4, 1, 2}, opts()), at::empty({0, 4, 1, 2}, opts()));
    const auto kv = cache.gather(0, at::empty({0, 3}, at::kLong));
    EXPECT_EQ(kv.first.sizes(), (std::vector<int64_t>{0, 0, 1, 2}));
  });
}

TEST_P(PagedCacheTest, PageSizeOneAndASinglePage) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> one_token_pages(1, 5, 1, 2, 2, opts());
    const auto pages = one_token_pages.alloc_n(5);
    const at::Tensor pt = table({{pages[4], pages[2], pages[0], pages[3], pages[1]}});
    const at::Tensor k = pattern({1, 5, 2, 2}, 18, opts());
    one_token_pages.write(0, pt, 0, k, k);
    EXPECT_TRUE(bitwise_equal(one_token_pages.gather(0, pt).first, k));

    PagedCache<L> single(2, 1, 4, 1, 3, opts());
    ASSERT_EQ(single.alloc(), 0);
    EXPECT_EQ(single.alloc(), -1);  // full pool
    const at::Tensor k1 = pattern({1, 4, 1, 3}, 19, opts());
    single.write(1, table({{0}}), 0, k1, k1);
    EXPECT_TRUE(bitwise_equal(single.gather(1, table({{0}})).second, k1));
    EXPECT_TRUE(bitwise_equal(single.bind(table({{0}}), 2).gather(1).first, k1.slice(1, 0, 2)));
  });
}

TEST_P(PagedCacheTest, GenericAndCpuKernelsAgreeBitForBit) {
  if (GetParam().device != at::kCPU) GTEST_SKIP() << "compares the two CPU paths";
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> a(1, 12, 3, 2, 4, opts(at::kHalf));
    PagedCache<L> b(1, 12, 3, 2, 4, opts(at::kHalf));
    a.alloc_n(12);
    b.alloc_n(12);
    const at::Tensor pt = table({{11, 2, 7, 5}, {0, 9, 4, -1}});
    const at::Tensor k = pattern({2, 8, 2, 4}, 20, opts(at::kHalf));
    const at::Tensor v = pattern({2, 8, 2, 4}, 21, opts(at::kHalf));
    {
      pagedkv::ScopedBackend cpu(pagedkv::Backend::automatic);
      a.write(0, pt, ints({2, 1}), k, v);
    }
    {
      pagedkv::ScopedBackend generic(pagedkv::Backend::generic);
      b.write(0, pt, ints({2, 1}), k, v);
    }
    EXPECT_TRUE(bitwise_equal(a.k_cache(), b.k_cache()));
    EXPECT_TRUE(bitwise_equal(a.v_cache(), b.v_cache()));
    std::pair<at::Tensor, at::Tensor> from_cpu, from_generic;
    {
      pagedkv::ScopedBackend cpu(pagedkv::Backend::automatic);
      from_cpu = a.gather(0, pt);
    }
    {
      pagedkv::ScopedBackend generic(pagedkv::Backend::generic);
      from_generic = a.gather(0, pt);
    }
    EXPECT_TRUE(bitwise_equal(from_cpu.first, from_generic.first));
    EXPECT_TRUE(bitwise_equal(from_cpu.second, from_generic.second));
  });
}

// Outputs of kGatherStreamingMinBytes or more are written with streaming
// stores: a separate code path, with ragged lengths (a partial last page,
// an empty row), a hole past a length and tails of zeros, checked against
// the generic path and against what was written.
TEST_P(PagedCacheTest, LargeGatherStreamsItsOutputAndMatchesTheGenericPath) {
  if (GetParam().device != at::kCPU) GTEST_SKIP() << "compares the two CPU paths";
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const int64_t B = 4, T = 2100, P = 16, H = 8, D = 64;  // 2 KiB per token and side (float32)
    const int64_t cols = (T + P - 1) / P;
    PagedCache<L> cache(1, B * cols, P, H, D, opts(at::kFloat));
    const std::vector<int64_t> ids = cache.alloc_n(B * cols);
    at::Tensor pt = at::tensor(ids, at::kLong).view({B, cols}).flip(1).contiguous();  // pages out of order
    const at::Tensor k = at::randn({B, T, H, D}, opts(at::kFloat));
    const at::Tensor v = at::randn({B, T, H, D}, opts(at::kFloat));
    cache.write(0, pt, 0, k, v);
    pt[2][10] = -1;  // a hole past row 2's length
    const at::Tensor lengths = ints({T, 1000, 7 * P + 3, 0});
    const int64_t output_bytes = 2 * B * T * H * D * static_cast<int64_t>(sizeof(float));
    if (pagedkv::cpu::kHaveStreamingStores) {
      ASSERT_TRUE(pagedkv::cpu::use_streaming_gather(output_bytes));
    }

    const auto streamed = cache.bind(pt, lengths).gather(0);
    std::pair<at::Tensor, at::Tensor> generic;
    {
      pagedkv::ScopedBackend generic_backend(pagedkv::Backend::generic);
      generic = cache.bind(pt, lengths).gather(0);
    }
    EXPECT_TRUE(bitwise_equal(streamed.first, generic.first));
    EXPECT_TRUE(bitwise_equal(streamed.second, generic.second));
    // and what the generic path returns is what was written, zeros where nothing is
    EXPECT_TRUE(bitwise_equal(streamed.first[0], k[0]));
    EXPECT_TRUE(bitwise_equal(streamed.second[1].slice(0, 0, 1000), v[1].slice(0, 0, 1000)));
    EXPECT_EQ(streamed.first[1].slice(0, 1000).abs().sum().template item<float>(), 0.0f);
    EXPECT_TRUE(bitwise_equal(streamed.first[2].slice(0, 0, 7 * P + 3), k[2].slice(0, 0, 7 * P + 3)));
    EXPECT_EQ(streamed.first[2].slice(0, 7 * P + 3).abs().sum().template item<float>(), 0.0f);
    EXPECT_EQ(streamed.second[3].abs().sum().template item<float>(), 0.0f);
  });
}

TEST_P(PagedCacheTest, PageTableMayLiveOnTheHostForADeviceCache) {
  PagedCache<NHD> cache(1, 4, 2, 1, 2, opts());
  cache.alloc_n(2);
  const at::Tensor host_table = table({{1, 0}});
  const at::Tensor k = pattern({1, 4, 1, 2}, 22, opts());
  cache.write(0, host_table, 0, k, k);
  EXPECT_TRUE(bitwise_equal(cache.gather(0, host_table).first, k));
  EXPECT_TRUE(bitwise_equal(cache.gather(0, host_table.to(GetParam().device)).first, k));
}

INSTANTIATE_TEST_SUITE_P(Targets, PagedCacheTest, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);

}  // namespace
