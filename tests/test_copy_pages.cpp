// PagedCache::copy_pages and copy_pages_from: whole pages (every layer, k
// and v) within one cache, across caches of either layout and across
// devices; overlapping lists; and every failure path, which must throw and
// change nothing — on every test target (cpu, cpu_generic, cuda).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "test_support.hpp"

namespace {

using namespace pagedkv_test;

class CopyPagesTest : public TargetTest {};

/// Fills every page of the cache (allocated or not) with distinct values.
template <class L>
void fill(PagedCache<L>& cache, int64_t seed) {
  cache.k_cache().copy_(pattern(cache.k_cache().sizes(), seed, cache.k_cache().options()));
  cache.v_cache().copy_(pattern(cache.v_cache().sizes(), seed + 1, cache.v_cache().options()));
}

/// The cache's pages in token-major order [n_layers, n_pages, P, H, D], on the cpu.
template <class L>
at::Tensor logical(const at::Tensor& storage) {
  const at::Tensor t = std::is_same<L, NHD>::value ? storage : storage.transpose(2, 3);
  return t.cpu().contiguous();
}

/// expected[:, dst[i]] = before[:, src[i]], reads before writes.
at::Tensor expected_copy(const at::Tensor& before, const std::vector<int64_t>& src, const std::vector<int64_t>& dst) {
  at::Tensor out = before.clone();
  for (size_t i = 0; i < src.size(); ++i) out.select(1, dst[i]).copy_(before.select(1, src[i]));
  return out;
}

TEST_P(CopyPagesTest, CopiesEveryLayerKAndVInOneCache) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (at::ScalarType index : {at::kInt, at::kLong}) {
        for (bool on_device : {false, true}) {
          PagedCache<L> cache(3, 8, 3, 2, 5, opts(dtype));  // page size 3: not a power of two
          cache.alloc_n(8);
          fill(cache, 7);
          const at::Tensor k0 = cache.k_cache().cpu().clone();
          const at::Tensor v0 = cache.v_cache().cpu().clone();
          const std::vector<int64_t> src{0, 5, 2, 0};
          const std::vector<int64_t> dst{3, 1, 6, 7};
          at::Tensor s = ints(src, index), d = ints(dst, index);
          if (on_device) s = s.to(device()), d = d.to(device());
          cache.copy_pages(s, d);
          EXPECT_TRUE(bitwise_equal(cache.k_cache(), expected_copy(k0, src, dst))) << L::name << " " << dtype;
          EXPECT_TRUE(bitwise_equal(cache.v_cache(), expected_copy(v0, src, dst))) << L::name << " " << dtype;
          EXPECT_EQ(cache.n_free(), 0);
          for (int64_t p = 0; p < 8; ++p) EXPECT_EQ(cache.ref_count(p), 1);
        }
      }
    }
  });
}

TEST_P(CopyPagesTest, ManyPagesInOneCall) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(2, 600, 16, 4, 32, opts(at::kHalf));
    cache.alloc_n(600);
    fill(cache, 3);
    std::vector<int64_t> src(300), dst(300);
    std::iota(src.begin(), src.end(), 0);
    std::iota(dst.begin(), dst.end(), 300);
    std::mt19937 rng(5);
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
    const at::Tensor k0 = cache.k_cache().cpu().clone();
    const at::Tensor v0 = cache.v_cache().cpu().clone();
    cache.copy_pages(ints(src), ints(dst));
    EXPECT_TRUE(bitwise_equal(cache.k_cache(), expected_copy(k0, src, dst)));
    EXPECT_TRUE(bitwise_equal(cache.v_cache(), expected_copy(v0, src, dst)));
  });
}

TEST_P(CopyPagesTest, OverlappingListsReadEveryPageBeforeWriting) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases{
        {{1, 2}, {2, 1}},        // swap
        {{1, 2, 3}, {2, 3, 4}},  // shift right: a chain
        {{2, 3, 4}, {1, 2, 3}},  // shift left
        {{4}, {4}},              // onto itself
        {{0, 0, 0}, {0, 1, 2}},  // one page to many, itself included
    };
    for (const auto& c : cases) {
      PagedCache<L> cache(2, 6, 3, 2, 4, opts());
      cache.alloc_n(6);
      fill(cache, 11);
      const at::Tensor k0 = cache.k_cache().cpu().clone();
      const at::Tensor v0 = cache.v_cache().cpu().clone();
      cache.copy_pages(ints(c.first), ints(c.second));
      EXPECT_TRUE(bitwise_equal(cache.k_cache(), expected_copy(k0, c.first, c.second))) << L::name;
      EXPECT_TRUE(bitwise_equal(cache.v_cache(), expected_copy(v0, c.first, c.second))) << L::name;
    }
  });
}

TEST_P(CopyPagesTest, EmptyListsChangeNothing) {
  PagedCache<NHD> cache(1, 4, 2, 1, 2, opts());
  cache.alloc_n(2);
  fill(cache, 1);
  const CacheSnapshot before(cache);
  cache.copy_pages(ints({}), ints({}, at::kInt));
  before.expect_same(cache, "empty copy_pages");
  PagedCache<HND> other(1, 4, 2, 1, 2, opts());
  cache.copy_pages_from(other, ints({}), ints({}));
  before.expect_same(cache, "empty copy_pages_from");
}

TEST_P(CopyPagesTest, BadListsThrowAndChangeNothing) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(2, 8, 3, 2, 4, opts());
    cache.alloc_n(6);  // pages 0..5 allocated, 6 and 7 free
    cache.retain(4);   // page 4 shared
    fill(cache, 5);
    const CacheSnapshot before(cache);
    const std::string fn = std::string("pagedkv::PagedCache<") + L::name + ">::copy_pages";
    auto attempt = [&](const at::Tensor& src, const at::Tensor& dst, const std::vector<std::string>& parts,
                       const std::string& what) {
      std::vector<std::string> all{fn};
      all.insert(all.end(), parts.begin(), parts.end());
      expect_error([&] { cache.copy_pages(src, dst); }, all);
      before.expect_same(cache, what);
    };
    attempt(ints({0, 1}), ints({2}), {"'src' and 'dst'", "same length"}, "length mismatch");
    attempt(ints({0, 1}), ints({2, 2}), {"'dst'", "distinct", "2"}, "duplicate dst");
    attempt(ints({0}), ints({4}), {"'dst'", "ref_count 1", "shared"}, "dst shared");
    attempt(ints({0}), ints({6}), {"'dst'", "free"}, "dst free");
    attempt(ints({7}), ints({1}), {"'src'", "free"}, "src free");
    attempt(ints({8}), ints({1}), {"'src'", "[0, 8)", "8"}, "src out of range");
    attempt(ints({0}), ints({-1}), {"'dst'", "unmapped"}, "dst -1");
    attempt(ints({0, 1}), ints({2, 9}), {"'dst'", "9"}, "dst out of range, after a valid entry");
    attempt(ints({0, 1}).view({1, 2}), ints({2, 3}), {"'src'", "1-D"}, "src 2-D");
    attempt(ints({0}), ints({2}).to(at::kFloat), {"'dst'", "int32 or int64"}, "dst float");
    attempt(at::Tensor(), ints({2}), {"'src'", "undefined"}, "src undefined");
  });
}

TEST_P(CopyPagesTest, CopyPagesFromMatchesWhatWasWrittenInEitherLayout) {
  auto run = [&](auto to_layout, auto from_layout) {
    using To = decltype(to_layout);
    using From = decltype(from_layout);
    for (at::ScalarType dtype : {at::kFloat, at::kHalf}) {
      PagedCache<From> from(2, 6, 3, 3, 4, opts(dtype));
      PagedCache<To> to(2, 9, 3, 3, 4, opts(dtype));
      const auto src = from.alloc_n(4);
      to.alloc_n(2);  // to's pages 0, 1 keep their contents
      const auto dst = to.alloc_n(4);
      fill(to, 21);
      const at::Tensor pt_from = table({{src[2], src[0], src[3], src[1]}});
      const at::Tensor k = pattern({1, 12, 3, 4}, 3, opts(dtype));
      const at::Tensor v = pattern({1, 12, 3, 4}, 4, opts(dtype));
      for (int64_t layer = 0; layer < 2; ++layer) from.write(layer, pt_from, 0, k * (layer + 1), v - layer);
      const at::Tensor untouched_k = logical<To>(to.k_cache()).narrow(1, 0, 2).clone();
      to.copy_pages_from(from, ints({src[2], src[0], src[3], src[1]}, at::kInt), ints(dst));
      const at::Tensor pt_to = table({{dst[0], dst[1], dst[2], dst[3]}});
      for (int64_t layer = 0; layer < 2; ++layer) {
        const auto got = to.gather(layer, pt_to);
        const auto want = from.gather(layer, pt_from);
        EXPECT_TRUE(bitwise_equal(got.first, want.first)) << To::name << "<-" << From::name << " layer " << layer;
        EXPECT_TRUE(bitwise_equal(got.second, want.second)) << To::name << "<-" << From::name << " layer " << layer;
      }
      EXPECT_TRUE(bitwise_equal(logical<To>(to.k_cache()).narrow(1, 0, 2), untouched_k));
      // whole pages, token-major, are equal
      for (size_t i = 0; i < 4; ++i) {
        const int64_t s = std::vector<int64_t>{src[2], src[0], src[3], src[1]}[i];
        EXPECT_TRUE(bitwise_equal(logical<To>(to.v_cache()).select(1, dst[i]),
                                  logical<From>(from.v_cache()).select(1, s)));
      }
    }
  };
  run(NHD{}, NHD{});
  run(HND{}, HND{});
  run(NHD{}, HND{});
  run(HND{}, NHD{});
}

TEST_P(CopyPagesTest, CopyPagesFromItselfIsCopyPages) {
  PagedCache<HND> cache(2, 5, 2, 2, 3, opts());
  cache.alloc_n(5);
  fill(cache, 9);
  const at::Tensor k0 = cache.k_cache().cpu().clone();
  cache.copy_pages_from(cache, ints({1, 2}), ints({2, 1}));  // overlap: reads before writes
  EXPECT_TRUE(bitwise_equal(cache.k_cache(), expected_copy(k0, {1, 2}, {2, 1})));
}

TEST_P(CopyPagesTest, CopyPagesFromRejectsOtherGeometryDtypeAndBadListsChangingNothing) {
  PagedCache<NHD> to(2, 6, 3, 2, 4, opts());
  to.alloc_n(4);
  to.retain(3);
  fill(to, 2);
  const CacheSnapshot before(to);
  const std::string fn = "pagedkv::PagedCache<NHD>::copy_pages_from";
  auto attempt = [&](const auto& from, const at::Tensor& src, const at::Tensor& dst,
                     const std::vector<std::string>& parts, const std::string& what) {
    std::vector<std::string> all{fn};
    all.insert(all.end(), parts.begin(), parts.end());
    expect_error([&] { to.copy_pages_from(from, src, dst); }, all);
    before.expect_same(to, what);
  };
  auto make = [&](int64_t layers, int64_t page_size, int64_t heads, int64_t dim, at::ScalarType dtype) {
    PagedCache<HND> c(layers, 6, page_size, heads, dim, opts(dtype));
    c.alloc_n(4);
    fill(c, 8);
    return c;
  };
  attempt(make(1, 3, 2, 4, at::kFloat), ints({0}), ints({1}), {"geometry", "(2, 3, 2, 4)", "(1, 3, 2, 4)"}, "layers");
  attempt(make(2, 4, 2, 4, at::kFloat), ints({0}), ints({1}), {"geometry"}, "page_size");
  attempt(make(2, 3, 1, 4, at::kFloat), ints({0}), ints({1}), {"geometry"}, "heads");
  attempt(make(2, 3, 2, 8, at::kFloat), ints({0}), ints({1}), {"geometry"}, "head_dim");
  attempt(make(2, 3, 2, 4, at::kHalf), ints({0}), ints({1}), {"dtype", "Half"}, "dtype");
  const auto from = make(2, 3, 2, 4, at::kFloat);  // pages 0..3 allocated, 4 and 5 free
  attempt(from, ints({4}), ints({1}), {"'src'", "free"}, "src free in other's pool (allocated in this one)");
  attempt(from, ints({0}), ints({5}), {"'dst'", "free"}, "dst free in this pool (allocated in other's)");
  attempt(from, ints({0}), ints({3}), {"'dst'", "shared"}, "dst shared");
  attempt(from, ints({0, 1}), ints({1, 1}), {"'dst'", "distinct"}, "dst duplicate");
  attempt(from, ints({0, 1}), ints({1}), {"same length"}, "length mismatch");
  attempt(from, ints({6}), ints({1}), {"'src'", "[0, 6)"}, "src out of range");
}

/// A host (cpu) cache and a cache on the target's device: pages go both
/// ways, in both layouts. On the cuda target this is the CPU <-> CUDA copy.
TEST_P(CopyPagesTest, BetweenAHostCacheAndADeviceCache) {
  auto run = [&](auto dev_layout, auto host_layout) {
    using D = decltype(dev_layout);
    using H = decltype(host_layout);
    PagedCache<D> dev(2, 10, 4, 2, 8, opts(at::kHalf));
    PagedCache<H> host(2, 12, 4, 2, 8, at::TensorOptions().dtype(at::kHalf));
    dev.alloc_n(10);
    host.alloc_n(12);
    fill(dev, 31);
    fill(host, 41);
    const at::Tensor dev_k0 = logical<D>(dev.k_cache()).clone();
    const at::Tensor host_v0 = logical<H>(host.v_cache()).clone();
    // device -> host: index lists on the device
    host.copy_pages_from(dev, ints({9, 0, 4}).to(device()), ints({1, 11, 5}));
    EXPECT_TRUE(bitwise_equal(logical<H>(host.k_cache()).narrow(1, 1, 1), dev_k0.narrow(1, 9, 1)));
    EXPECT_TRUE(bitwise_equal(logical<H>(host.k_cache()).narrow(1, 11, 1), dev_k0.narrow(1, 0, 1)));
    EXPECT_TRUE(bitwise_equal(logical<H>(host.k_cache()).narrow(1, 5, 1), dev_k0.narrow(1, 4, 1)));
    EXPECT_TRUE(bitwise_equal(logical<H>(host.v_cache()).narrow(1, 0, 1), host_v0.narrow(1, 0, 1)));
    // host -> device
    const at::Tensor host_k1 = logical<H>(host.k_cache()).clone();
    const at::Tensor host_v1 = logical<H>(host.v_cache()).clone();
    dev.copy_pages_from(host, ints({0, 1, 2, 3}, at::kInt), ints({6, 7, 8, 9}, at::kInt).to(device()));
    EXPECT_TRUE(bitwise_equal(logical<D>(dev.k_cache()).narrow(1, 6, 4), host_k1.narrow(1, 0, 4)));
    EXPECT_TRUE(bitwise_equal(logical<D>(dev.v_cache()).narrow(1, 6, 4), host_v1.narrow(1, 0, 4)));
    EXPECT_TRUE(bitwise_equal(logical<D>(dev.k_cache()).narrow(1, 0, 6), dev_k0.narrow(1, 0, 6)));
  };
  run(NHD{}, NHD{});
  run(HND{}, NHD{});
  run(NHD{}, HND{});
  run(HND{}, HND{});
}

INSTANTIATE_TEST_SUITE_P(Targets, CopyPagesTest, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);

}  // namespace
