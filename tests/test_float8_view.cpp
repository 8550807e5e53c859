// k_cache_as_float8 / v_cache_as_float8: a cache's fp8 codes viewed as
// torch's float8_e4m3fn (torch 2.1 and later). The view shares the pages'
// storage; torch's own decoding of it agrees with pagedkv's codec on all 256
// codes, and times the scales it is the cache's gather; other formats throw.
// Built against a torch without the dtype (Debian's 1.13), the suite skips.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "pagedkv/float8_view.hpp"
#include "pagedkv/cpu/quant/codecs.hpp"
#include "test_support.hpp"

namespace {

using namespace pagedkv_test;
using pagedkv::KVFormat;
using pagedkv::KVQuant;

#if PAGEDKV_HAS_TORCH_FLOAT8

using Float8View = TargetTest;

constexpr int64_t kLayers = 2, kPages = 6, kPageSize = 3, kHeads = 2, kHeadDim = 8;

template <class L>
PagedCache<L> fp8_cache(at::TensorOptions options, KVQuant quant = {KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}) {
  return PagedCache<L>(kLayers, kPages, kPageSize, kHeads, kHeadDim, options, quant);
}

/// The cache's dequantized pages, from a float8 view and its scales:
/// [n_layers, n_pages, <page shape>] float32.
at::Tensor dequantized(const at::Tensor& float8_pages,  // [n_layers, n_pages, <page shape>]
                       const at::Tensor& scales) {      // [n_layers, n_pages, page_size * n_kv_heads]
  const at::Tensor s = scales.view({float8_pages.size(0), float8_pages.size(1), float8_pages.size(2),
                                    float8_pages.size(3), 1});
  return float8_pages.to(at::kFloat) * s;
}

/// Pages `pages` of one layer's dequantized pages as a sequence: [1, T, H, D].
template <class L>
at::Tensor as_tokens(const at::Tensor& layer_pages,  // [n_pages, <page shape>]
                     const at::Tensor& pages) {      // [n] page ids
  at::Tensor t = layer_pages.index_select(0, pages);  // [n, <page shape>]
  if (std::is_same<L, HND>::value) t = t.permute({0, 2, 1, 3});
  return t.reshape({1, -1, kHeads, kHeadDim});
}

TEST_P(Float8View, IsTheCodesStorageAsFloat8) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = fp8_cache<L>(opts(at::kHalf));
    const at::Tensor k = pagedkv::k_cache_as_float8(cache);
    const at::Tensor v = pagedkv::v_cache_as_float8(cache);
    EXPECT_EQ(k.scalar_type(), at::kFloat8_e4m3fn) << L::name;
    EXPECT_EQ(k.sizes(), cache.k_cache().sizes()) << L::name;
    EXPECT_EQ(k.strides(), cache.k_cache().strides()) << L::name;
    EXPECT_EQ(k.data_ptr(), cache.k_cache().data_ptr()) << L::name;
    EXPECT_EQ(v.data_ptr(), cache.v_cache().data_ptr()) << L::name;
    EXPECT_EQ(v.device(), device()) << L::name;

    // A write after the view was taken shows through it: no copy was made.
    const at::Tensor t = table({{cache.alloc(), cache.alloc()}}).to(device());
    cache.write(1, t, 0, pattern({1, 5, kHeads, kHeadDim}, 1, opts(at::kHalf)),
                pattern({1, 5, kHeads, kHeadDim}, 2, opts(at::kHalf)));
    EXPECT_TRUE(bitwise_equal(k.view(at::kByte), cache.k_cache())) << L::name;
    EXPECT_TRUE(bitwise_equal(v.view(at::kByte), cache.v_cache())) << L::name;
    EXPECT_TRUE(cache.k_cache().ne(0).any().item().toBool()) << L::name << ": the write wrote no code";
  });
}

TEST_P(Float8View, TorchDecodesEveryCodeAsPagedkvDoes) {
  auto cache = fp8_cache<NHD>(opts(at::kFloat));
  // The first 256 code bytes of the K pages hold every code once.
  cache.k_cache().view({-1}).narrow(0, 0, 256).copy_(at::arange(256, at::kInt).to(at::kByte).to(device()));
  const at::Tensor decoded = pagedkv::k_cache_as_float8(cache).view({-1}).narrow(0, 0, 256).to(at::kFloat).cpu();
  for (int code = 0; code < 256; ++code) {
    const float torch_value = decoded[code].item<float>();
    const float pagedkv_value = pagedkv::cpu::quant::decode_e4m3(static_cast<uint8_t>(code));
    if (std::isnan(pagedkv_value)) {
      EXPECT_TRUE(std::isnan(torch_value)) << "code " << code << ": torch gives " << torch_value;
    } else {
      EXPECT_EQ(torch_value, pagedkv_value) << "code " << code;
      EXPECT_EQ(std::signbit(torch_value), std::signbit(pagedkv_value)) << "code " << code;
    }
  }
}

TEST_P(Float8View, TimesTheScalesIsTheGather) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    auto cache = fp8_cache<L>(opts(at::kFloat));
    const at::Tensor pages = pagedkv_test::ints({cache.alloc(), cache.alloc(), cache.alloc()});
    const at::Tensor t = pages.view({1, 3}).to(device());
    at::manual_seed(7);
    const at::Tensor k_in = (at::randn({1, 8, kHeads, kHeadDim}) * 3).to(device());
    const at::Tensor v_in = (at::randn({1, 8, kHeads, kHeadDim}) / 5).to(device());
    cache.write(1, t, 0, k_in, v_in);

    const auto gathered = cache.gather(1, t, pagedkv_test::ints({8}).to(device()));
    const at::Tensor k = as_tokens<L>(dequantized(pagedkv::k_cache_as_float8(cache), cache.k_scales())[1].cpu(), pages);
    const at::Tensor v = as_tokens<L>(dequantized(pagedkv::v_cache_as_float8(cache), cache.v_scales())[1].cpu(), pages);
    EXPECT_TRUE(bitwise_equal(k.narrow(1, 0, 8), gathered.first)) << L::name;
    EXPECT_TRUE(bitwise_equal(v.narrow(1, 0, 8), gathered.second)) << L::name;
  });
}

TEST_P(Float8View, OtherFormatsThrowNamingTheSide) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const std::string name = L::name;
    auto int8_keys = fp8_cache<L>(opts(at::kHalf), {KVFormat::int8, KVFormat::fp8_e4m3});
    expect_error([&] { pagedkv::k_cache_as_float8(int8_keys); },
                 {"pagedkv::k_cache_as_float8<" + name + ">", "argument 'cache'", "keys stored as fp8_e4m3",
                  "got int8"});
    EXPECT_NO_THROW(pagedkv::v_cache_as_float8(int8_keys));
    auto native_values = fp8_cache<L>(opts(at::kHalf), {KVFormat::fp8_e4m3, KVFormat::native});
    expect_error([&] { pagedkv::v_cache_as_float8(native_values); },
                 {"pagedkv::v_cache_as_float8<" + name + ">", "values stored as fp8_e4m3", "got native"});
  });
}

INSTANTIATE_TEST_SUITE_P(Targets, Float8View, ::testing::ValuesIn(all_targets()), target_name);

#else  // no float8 dtype in this torch

TEST(Float8View, NeedsTorch21) {
  GTEST_SKIP() << "this libtorch (" << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR
               << ") has no float8_e4m3fn dtype; k_cache_as_float8 needs 2.1 or later"
                  " (make test-torch2 runs this suite)";
}

#endif

}  // namespace
