// Caches with quantized pages (fp8 e4m3 / int8 codes, one float32 scale per
// (token, head)): storage, write + gather within the contract's error bounds
// on hard data, identical codes on the CPU and generic paths, atomic
// failures, page copies / swap / fork carrying codes and scales, and
// paged_attention on quantized pages against float64 references.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "pagedkv/attention.hpp"
#include "pagedkv/sequences.hpp"
#include "test_support.hpp"

namespace {

using namespace pagedkv_test;
using pagedkv::KVFormat;
using pagedkv::KVQuant;
using pagedkv::simd::Isa;
using pagedkv::simd::ScopedIsa;

const std::vector<KVQuant> kFormats{{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3},
                                    {KVFormat::int8, KVFormat::int8},
                                    {KVFormat::fp8_e4m3, KVFormat::int8},
                                    {KVFormat::native, KVFormat::int8},
                                    {KVFormat::fp8_e4m3, KVFormat::native}};
const std::vector<at::ScalarType> kDtypes{at::kFloat, at::kHalf, at::kBFloat16};

std::string describe(const KVQuant& q, at::ScalarType dtype, int64_t page_size, const char* layout) {
  return std::string(layout) + " K " + pagedkv::format_name(q.k) + " V " + pagedkv::format_name(q.v) + " " +
         c10::toString(dtype) + " page_size " + std::to_string(page_size);
}

/// Gaussian K/V [B, S, H, D] (float32) with what breaks per-tensor scales:
/// an outlier channel (x50), an attention-sink first token (x100), an
/// all-zero head, and per-token magnitudes from 1e-6 to 1e4; clamped into
/// fp16's range.
at::Tensor hard_data(int64_t B, int64_t S, int64_t H, int64_t D, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn({B, S, H, D});
  if (D > 3) x.select(3, 3).mul_(50);
  x.select(1, 0).mul_(100);
  if (S > 1) x.select(1, 1).select(1, H - 1).zero_();
  x.mul_(at::pow(10.0, at::linspace(-6, 4, B * S)).view({B, S, 1, 1}).to(at::kFloat));
  return x.clamp_(-6e4, 6e4);
}

/// Rows of distinct pages enough for `lengths`, interleaved between rows.
template <class Cache>
at::Tensor allocate_table(Cache& cache, const std::vector<int64_t>& lengths, int64_t cols) {
  at::Tensor t = at::full({static_cast<int64_t>(lengths.size()), cols}, -1, at::kLong);
  for (int64_t c = 0; c < cols; ++c)
    for (size_t b = 0; b < lengths.size(); ++b)
      if (c * cache.page_size() < lengths[b]) t[static_cast<int64_t>(b)][c] = cache.alloc();
  return t;
}

/// Writes sequence b's first lengths[b] tokens of k, v [B, S, H, D]
/// (float32), as `dtype`, into row b of `table`.
template <class Cache>
void write_prefixes(Cache& cache, const at::Tensor& table, const std::vector<int64_t>& lengths, const at::Tensor& k,
                    const at::Tensor& v, at::ScalarType dtype) {
  for (int64_t b = 0; b < static_cast<int64_t>(lengths.size()); ++b) {
    const int64_t n = lengths[static_cast<size_t>(b)];
    cache.write(0, table.narrow(0, b, 1), 0, k.narrow(0, b, 1).narrow(1, 0, n).to(dtype),
                v.narrow(0, b, 1).narrow(1, 0, n).to(dtype));
  }
}

/// paged_attention over layer 0 on kernel path `path`, as float32.
template <class View>
at::Tensor attention_on(const KernelPath& path, const View& view, const at::Tensor& q) {
  const ScopedKernelPath scoped(path);
  return pagedkv::paged_attention(view, 0, q).to(at::kFloat);
}

/// The same on instruction set `isa`, with the decode step its CPU picks.
template <class View>
at::Tensor attention_on(Isa isa, const View& view, const at::Tensor& q) {
  return attention_on(KernelPath{isa, pagedkv::cpu::attention::DecodeStep::best}, view, q);
}

/// |gathered - x| within the contract's per-element bound for `format`,
/// plus the rounding to the output dtype; no NaN or Inf.
void expect_within_bounds(const at::Tensor& x,         // [N, D] the written values (the cache's dtype)
                          const at::Tensor& gathered,  // [N, D]
                          KVFormat format, const std::string& what) {
  const at::Tensor g = gathered.cpu().to(at::kDouble);
  ASSERT_TRUE(at::isfinite(g).all().item<bool>()) << what << ": NaN or Inf in the gather";
  const at::Tensor xd = x.cpu().to(at::kDouble);
  if (format == KVFormat::native) {
    EXPECT_TRUE(at::equal(g, xd)) << what << ": native side changed";
    return;
  }
  const at::Tensor xf = x.cpu().to(at::kFloat);
  const at::Tensor amax = xf.abs().amax(-1, true);
  const at::Tensor scale = (amax / at::full_like(amax, pagedkv::cpu::quant::format_max(format))).to(at::kDouble);
  at::Tensor bound = format == KVFormat::fp8_e4m3 ? xd.abs() * std::ldexp(1.0, -4) + scale * std::ldexp(1.0, -10)
                                                  : scale / 2 + at::zeros_like(xd);
  const at::ScalarType dtype = x.scalar_type();
  const double out_eps = dtype == at::kHalf ? std::ldexp(1.0, -11) : dtype == at::kBFloat16 ? std::ldexp(1.0, -8)
                                                                                             : std::ldexp(1.0, -24);
  const double out_tiny = dtype == at::kHalf ? std::ldexp(1.0, -25) : 1e-40;
  bound = bound * (1 + 1e-5) + g.abs() * out_eps + xd.abs() * 1e-6 + out_tiny;
  const at::Tensor err = (g - xd).abs();
  const at::Tensor excess = err - bound;
  const int64_t worst = excess.view(-1).argmax().item<int64_t>();
  EXPECT_LE(excess.view(-1)[worst].item<double>(), 0.0)
      << what << ": element " << worst << " x = " << xd.view(-1)[worst].item<double>()
      << " gathered = " << g.view(-1)[worst].item<double>() << " bound = " << bound.view(-1)[worst].item<double>();
  // An all-zero head vector comes back as zeros.
  const at::Tensor zero_rows = xd.abs().amax(-1).eq(0);
  if (zero_rows.any().item<bool>()) {
    EXPECT_TRUE(g.index({zero_rows}).eq(0).all().item<bool>()) << what << ": zero head not zero";
  }
}

bool all_zero(const at::Tensor& t) { return t.eq(0).all().item<bool>(); }
bool all_finite(const at::Tensor& t) { return at::isfinite(t).all().item<bool>(); }
double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

class QuantizedCache : public TargetTest {};

TEST_P(QuantizedCache, StoresCodesAndScalesPerFormat) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const KVQuant& q : kFormats) {
      PagedCache<L> cache(2, 5, 3, 2, 8, opts(at::kBFloat16), q);
      EXPECT_EQ(cache.dtype(), at::kBFloat16);
      EXPECT_EQ(cache.quant(), q);
      const auto expect_side = [&](KVFormat f, const at::Tensor& pages, const at::Tensor& scales) {
        EXPECT_EQ(pages.scalar_type(), f == KVFormat::fp8_e4m3 ? at::kByte
                                       : f == KVFormat::int8   ? at::kChar
                                                               : at::kBFloat16);
        EXPECT_EQ(scales.defined(), f != KVFormat::native);
        if (scales.defined()) {
          EXPECT_EQ(scales.sizes(), at::IntArrayRef({2, 5, 6}));
          EXPECT_EQ(scales.scalar_type(), at::kFloat);
          EXPECT_EQ(scales.device(), device());
        }
      };
      expect_side(q.k, cache.k_cache(), cache.k_scales());
      expect_side(q.v, cache.v_cache(), cache.v_scales());
      cache.check();
    }
  });
}

TEST_P(QuantizedCache, QuantizedPagesNeedAFloatingDtype) {
  expect_error([&] { PagedCache<NHD>(1, 4, 4, 2, 8, opts(at::kInt), KVQuant{KVFormat::native, KVFormat::int8}); },
               {"pagedkv::PagedCache<NHD>::PagedCache: argument 'options' expected dtype float32, float16 or bfloat16",
                "got Int"});
  PagedCache<NHD> native(1, 4, 4, 2, 8, opts(at::kInt), KVQuant{});  // native pages: any dtype, as before
  EXPECT_FALSE(native.k_scales().defined());
}

TEST_P(QuantizedCache, GatherIsWithinTheContractBoundsOnHardData) {
  const int64_t B = 3, S = 7, H = 2, D = 16;
  const std::vector<int64_t> starts{0, 5, 2};  // ragged
  std::vector<int64_t> lengths;
  for (const int64_t s : starts) lengths.push_back(s + S);
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const int64_t page_size : {1, 3, 16}) {
      for (const at::ScalarType dtype : kDtypes) {
        for (const KVQuant& q : kFormats) {
          const std::string what = describe(q, dtype, page_size, L::name);
          PagedCache<L> cache(2, 40, page_size, H, D, opts(dtype), q);
          const int64_t cols = (12 + page_size - 1) / page_size + 1;
          const at::Tensor table = allocate_table(cache, lengths, cols).to(device());
          // A slice of a fused QKV projection: token stride 3 * H * D.
          const at::Tensor qkv = at::stack({hard_data(B, S, H, D, 1), hard_data(B, S, H, D, 2),
                                            hard_data(B, S, H, D, 3)}, 2).to(opts(dtype));
          const at::Tensor k = qkv.select(2, 1);
          const at::Tensor v = qkv.select(2, 2);
          cache.write(1, table, ints(starts).to(device()), k, v);
          cache.check();
          const auto kv = cache.gather(1, table, ints(lengths).to(device()));
          ASSERT_EQ(kv.first.scalar_type(), dtype) << what;
          for (int64_t b = 0; b < B; ++b) {
            const int64_t s0 = starts[static_cast<size_t>(b)];
            expect_within_bounds(k[b].reshape({-1, D}), kv.first[b].narrow(0, s0, S).reshape({-1, D}), q.k,
                                 what + " k row " + std::to_string(b));
            expect_within_bounds(v[b].reshape({-1, D}), kv.second[b].narrow(0, s0, S).reshape({-1, D}), q.v,
                                 what + " v row " + std::to_string(b));
            // Never written: zeros.
            EXPECT_TRUE(all_zero(kv.first[b].narrow(0, 0, s0))) << what;
          }
          // Layer 0 untouched: zeros.
          const auto other = cache.gather(0, table, ints(lengths).to(device()));
          EXPECT_TRUE(all_zero(other.first) && all_zero(other.second)) << what;
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  });
}

TEST_P(QuantizedCache, FailedCallsChangeNothing) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    PagedCache<L> cache(2, 6, 4, 2, 8, opts(at::kHalf), KVQuant{KVFormat::fp8_e4m3, KVFormat::int8});
    const at::Tensor table = allocate_table(cache, {8, 8}, 2).to(device());
    const at::Tensor k = hard_data(2, 8, 2, 8, 4).to(opts(at::kHalf));
    cache.write(0, table, 0, k, k * 2);
    const CacheSnapshot before(cache);
    expect_error([&] { cache.write(0, table, 0, k.to(at::kFloat), k); }, {"argument 'k' expected dtype Half"});
    expect_error([&] { cache.write(2, table, 0, k, k); }, {"argument 'layer' expected in [0, 2)"});
    expect_error([&] { cache.write(0, table, 1, k, k); }, {"a write past the last column"});
    expect_error([&] { cache.write(0, table, 0, k, k.narrow(3, 0, 4)); }, {"'v'"});
    cache.free(table[1][1].template item<int64_t>());
    const CacheSnapshot freed(cache);
    expect_error([&] { cache.write(1, table, 0, k, k); }, {"use after free"});
    freed.expect_same(cache, std::string(L::name) + " write into a freed page");
    expect_error([&] { cache.gather(0, table, ints({8, 8}).to(device())); }, {"use after free"});
    freed.expect_same(cache, std::string(L::name) + " gather");
    EXPECT_TRUE(bitwise_equal(cache.k_cache(), before.k));
    EXPECT_TRUE(bitwise_equal(cache.k_scales(), before.k_scales));
  });
}

TEST_P(QuantizedCache, PageCopiesCarryCodesAndScales) {
  const KVQuant q{KVFormat::fp8_e4m3, KVFormat::int8};
  PagedCache<NHD> cache(2, 8, 3, 2, 8, opts(at::kFloat), q);
  const at::Tensor table = allocate_table(cache, {6}, 2).to(device());
  cache.write(0, table, 0, hard_data(1, 6, 2, 8, 5).to(device()), hard_data(1, 6, 2, 8, 6).to(device()));
  cache.write(1, table, 0, hard_data(1, 6, 2, 8, 7).to(device()), hard_data(1, 6, 2, 8, 8).to(device()));
  const int64_t a = cache.alloc(), b = cache.alloc();
  cache.copy_pages(ints({table[0][0].item<int64_t>(), table[0][1].item<int64_t>()}).to(device()), ints({a, b}));
  const at::Tensor copy_table = table.cpu().clone();
  copy_table[0][0] = a;
  copy_table[0][1] = b;
  for (int64_t layer = 0; layer < 2; ++layer) {
    const auto want = cache.gather(layer, table);
    const auto got = cache.gather(layer, copy_table);
    EXPECT_TRUE(bitwise_equal(got.first, want.first) && bitwise_equal(got.second, want.second)) << "copy_pages";
  }
  // Into the other layout (relaid out codes and scales), and back.
  PagedCache<HND> other(2, 8, 3, 2, 8, opts(at::kFloat), q);
  const int64_t c = other.alloc(), d = other.alloc();
  other.copy_pages_from(cache, ints({a, b}), ints({c, d}));
  other.check();
  for (int64_t layer = 0; layer < 2; ++layer) {
    const auto want = cache.gather(layer, copy_table);
    const auto got = other.gather(layer, pagedkv_test::table({{c, d}}));
    EXPECT_TRUE(bitwise_equal(got.first, want.first) && bitwise_equal(got.second, want.second)) << "NHD -> HND";
  }
  // Caches of other formats (or native) are not compatible.
  for (const KVQuant& wrong : {KVQuant{KVFormat::int8, KVFormat::int8}, KVQuant{}}) {
    PagedCache<NHD> mismatched(2, 8, 3, 2, 8, opts(at::kFloat), wrong);
    const int64_t e = mismatched.alloc();
    const CacheSnapshot before(mismatched);
    expect_error([&] { mismatched.copy_pages_from(cache, ints({a}), ints({e})); },
                 {"copy_pages_from: argument 'other' expected formats (K ", "got (K fp8_e4m3, V int8)"});
    before.expect_same(mismatched, "mixed formats");
  }
}

TEST_P(QuantizedCache, SwapAndForkCarryCodesAndScales) {
  const KVQuant q{KVFormat::int8, KVFormat::fp8_e4m3};
  PagedCache<HND> cache(2, 8, 4, 2, 8, opts(at::kHalf), q);
  PagedCache<NHD> host(2, 8, 4, 2, 8, at::TensorOptions().dtype(at::kHalf), q);
  pagedkv::SequenceTable<HND> seqs(cache);
  pagedkv::SequenceTable<NHD> host_seqs(host);
  const int64_t seq = seqs.create();
  ASSERT_TRUE(seqs.prepare_append(seq, 6));
  auto batch = seqs.batch({seq});
  for (int64_t layer = 0; layer < 2; ++layer) {
    cache.bind(batch.first, batch.second + 6)
        .write(layer, 0, hard_data(1, 6, 2, 8, 10 + layer).to(opts(at::kHalf)),
               hard_data(1, 6, 2, 8, 20 + layer).to(opts(at::kHalf)));
  }
  seqs.commit_append(seq, 6);
  batch = seqs.batch({seq});
  const auto before0 = cache.gather(0, batch.first, batch.second);
  const auto before1 = cache.gather(1, batch.first, batch.second);
  // Fork, then append to the fork: copy-on-write of the shared last page.
  const int64_t fork = seqs.fork(seq);
  ASSERT_TRUE(seqs.prepare_append(fork, 1));
  const auto fork_batch = seqs.batch({fork});
  EXPECT_NE(fork_batch.first[0][1].item<int64_t>(), batch.first[0][1].item<int64_t>());
  const auto forked = cache.gather(0, fork_batch.first, fork_batch.second);
  EXPECT_TRUE(bitwise_equal(forked.first, before0.first) && bitwise_equal(forked.second, before0.second));
  // Out to a host cache of the other layout and back.
  ASSERT_TRUE(seqs.swap_out(seq, host_seqs));
  // Overwrite the freed device pages (codes and scales) so that a swap that lost scales shows.
  const std::vector<int64_t> scratch = cache.alloc_n(cache.n_free());
  const at::Tensor scratch_table = at::tensor(scratch, at::kLong).view({1, -1}).to(device());
  const int64_t n = static_cast<int64_t>(scratch.size()) * 4;
  for (int64_t layer = 0; layer < 2; ++layer) {
    cache.write(layer, scratch_table, 0, hard_data(1, n, 2, 8, 99).to(opts(at::kHalf)),
                hard_data(1, n, 2, 8, 98).to(opts(at::kHalf)));
  }
  for (const int64_t page : scratch) cache.free(page);
  ASSERT_TRUE(seqs.swap_in(seq, host_seqs));
  batch = seqs.batch({seq});
  const auto after0 = cache.gather(0, batch.first, batch.second);
  const auto after1 = cache.gather(1, batch.first, batch.second);
  EXPECT_TRUE(bitwise_equal(after0.first, before0.first) && bitwise_equal(after0.second, before0.second));
  EXPECT_TRUE(bitwise_equal(after1.first, before1.first) && bitwise_equal(after1.second, before1.second));
  cache.check();
  host.check();
}

TEST_P(QuantizedCache, CheckNamesBrokenScales) {
  PagedCache<NHD> cache(2, 4, 3, 2, 8, opts(at::kHalf), KVQuant{KVFormat::fp8_e4m3, KVFormat::int8});
  cache.check();
  const_cast<at::Tensor&>(cache.v_scales()) = at::zeros({2, 4, 5}, opts(at::kFloat));
  expect_error([&] { cache.check(); }, {"pagedkv::PagedCache<NHD>::check: v_scales has shape [2, 4, 5], expected [2, 4, 6]"});
  const_cast<at::Tensor&>(cache.v_scales()) = at::zeros({2, 4, 6}, opts(at::kHalf));
  expect_error([&] { cache.check(); }, {"v_scales has dtype Half, expected Float"});
  const_cast<at::Tensor&>(cache.v_scales()) = at::Tensor();
  expect_error([&] { cache.check(); }, {"v_scales is undefined, expected scales for format int8"});
  const_cast<at::Tensor&>(cache.k_cache()) = at::zeros(cache.k_cache().sizes(), opts(at::kChar));
  expect_error([&] { cache.check(); }, {"k_cache has dtype Char, expected Byte (K format fp8_e4m3, dtype Half)"});
}

INSTANTIATE_TEST_SUITE_P(Targets, QuantizedCache, ::testing::ValuesIn(all_targets()), target_name);

/// The ATen path (what CUDA caches take) gives the CPU kernels' codes and
/// scales bit for bit, and the same gathers.
TEST(QuantizedCacheCpu, CpuKernelsAndTheGenericPathGiveIdenticalCodes) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const at::ScalarType dtype : kDtypes) {
      for (const KVQuant& q : kFormats) {
        const std::string what = describe(q, dtype, 3, L::name);
        PagedCache<L> cpu(1, 12, 3, 4, 32, at::TensorOptions().dtype(dtype), q);
        PagedCache<L> generic(1, 12, 3, 4, 32, at::TensorOptions().dtype(dtype), q);
        const at::Tensor table = allocate_table(cpu, {9, 9}, 3);
        allocate_table(generic, {9, 9}, 3);
        // Element stride 2, and exact ties / saturation / tiny values mixed in.
        at::Tensor x = at::empty({2, 9, 4, 32, 2}, dtype).select(4, 0);
        x.copy_(hard_data(2, 9, 4, 32, 30));
        x.select(3, 5).fill_(448.0 / 3);
        const at::Tensor v = (x * 0.5).to(dtype);
        cpu.write(0, table, 0, x, v);
        {
          const pagedkv::ScopedBackend backend(pagedkv::Backend::generic);
          generic.write(0, table, 0, x, v);
        }
        EXPECT_TRUE(bitwise_equal(cpu.k_cache(), generic.k_cache())) << what << ": k codes differ";
        EXPECT_TRUE(bitwise_equal(cpu.v_cache(), generic.v_cache())) << what << ": v codes differ";
        if (is_quantized(q.k)) {
          EXPECT_TRUE(bitwise_equal(cpu.k_scales(), generic.k_scales())) << what;
        }
        if (is_quantized(q.v)) {
          EXPECT_TRUE(bitwise_equal(cpu.v_scales(), generic.v_scales())) << what;
        }
        const auto a = cpu.gather(0, table, ints({9, 7}));
        const pagedkv::ScopedBackend backend(pagedkv::Backend::generic);
        const auto b = cpu.gather(0, table, ints({9, 7}));
        EXPECT_TRUE(bitwise_equal(a.first, b.first) && bitwise_equal(a.second, b.second)) << what << ": gathers";
      }
    }
  });
}

/// A gather of 16 MiB or more streams its output (cpu::quant::dequantize_row's
/// streaming stores, rows of whole cache lines only): the same values as the
/// generic path, zeros past each length and for an unmapped page.
TEST(QuantizedCacheCpu, LargeGatherStreamsItsOutputAndMatchesTheGenericPath) {
  struct Shape {
    at::ScalarType dtype;
    int64_t heads, head_dim;  // rows of 128 and 256 bytes stream; 80 bytes (fp16 x 40) do not
  };
  const int64_t B = 4, T = 2100, P = 16, cols = (T + P - 1) / P;
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const Shape& shape : {Shape{at::kHalf, 8, 64}, Shape{at::kFloat, 8, 64}, Shape{at::kHalf, 16, 40}}) {
      for (const KVQuant& q : {KVQuant{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, KVQuant{KVFormat::int8, KVFormat::native}}) {
        const std::string what = describe(q, shape.dtype, P, L::name) + " D " + std::to_string(shape.head_dim);
        const int64_t H = shape.heads, D = shape.head_dim;
        PagedCache<L> cache(1, B * cols, P, H, D, at::TensorOptions().dtype(shape.dtype), q);
        at::Tensor pt = at::tensor(cache.alloc_n(B * cols), at::kLong).view({B, cols}).flip(1).contiguous();
        const at::Tensor k = hard_data(B, T, H, D, 41).to(shape.dtype);
        const at::Tensor v = at::randn({B, T, H, D}).to(shape.dtype);
        cache.write(0, pt, 0, k, v);
        pt[2][10] = -1;  // a hole past row 2's length
        const at::Tensor lengths = ints({T, 1000, 7 * P + 3, 0});
        const int64_t output_bytes = 2 * B * T * H * D * static_cast<int64_t>(c10::elementSize(shape.dtype));
        if (pagedkv::cpu::kHaveStreamingStores) {
          ASSERT_TRUE(pagedkv::cpu::use_streaming_gather(output_bytes)) << what;
        }
        const auto streamed = cache.bind(pt, lengths).gather(0);
        std::pair<at::Tensor, at::Tensor> generic;
        {
          const pagedkv::ScopedBackend backend(pagedkv::Backend::generic);
          generic = cache.bind(pt, lengths).gather(0);
        }
        EXPECT_TRUE(bitwise_equal(streamed.first, generic.first)) << what << ": k";
        EXPECT_TRUE(bitwise_equal(streamed.second, generic.second)) << what << ": v";
        EXPECT_EQ(streamed.first[1].slice(0, 1000).abs().sum().template item<float>(), 0.0f) << what;
        EXPECT_EQ(streamed.second[2].slice(0, 7 * P + 3).abs().sum().template item<float>(), 0.0f) << what;
        EXPECT_EQ(streamed.first[3].abs().sum().template item<float>(), 0.0f) << what;
        EXPECT_GT(streamed.first[0].abs().sum().template item<float>(), 0.0f) << what;
      }
    }
  });
}

// ---- paged attention on quantized pages ----

/// Causal attention in float64 over k, v [B, T, H, D] (zeros past lengths),
/// q [B, Sq, NH, D]; query s of row b at lengths[b] - Sq + s.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::vector<int64_t>& lengths, double scale) {
  const int64_t B = q.size(0), Sq = q.size(1), NH = q.size(2), D = q.size(3), H = k.size(2);
  const int64_t G = NH / H;
  at::Tensor out = at::zeros({B, Sq, NH, D}, at::kDouble);
  const at::Tensor qd = q.cpu().to(at::kDouble), kd = k.cpu().to(at::kDouble), vd = v.cpu().to(at::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < Sq; ++s) {
      const int64_t visible = lengths[static_cast<size_t>(b)] - Sq + s + 1;
      for (int64_t h = 0; h < NH; ++h) {
        const at::Tensor keys = kd[b].narrow(0, 0, visible).select(1, h / G);    // [visible, D]
        const at::Tensor values = vd[b].narrow(0, 0, visible).select(1, h / G);  // [visible, D]
        const at::Tensor p = at::softmax(at::mv(keys, qd[b][s][h]) * scale, 0);
        out[b][s][h] = at::mv(values.t(), p);
      }
    }
  }
  return out;
}

class QuantizedAttention : public TargetTest {};

TEST_P(QuantizedAttention, MatchesFloat64ReferencesOfItsOwnGatherAndOfTheOriginalKv) {
  const int64_t H = 2, D = 64, NH = 8;
  const std::vector<int64_t> lengths{600, 37};  // the long row is split across threads
  const std::vector<Isa> isas = GetParam().backend == pagedkv::Backend::automatic && GetParam().device == at::kCPU
                                    ? pagedkv::simd::available_isas()
                                    : std::vector<Isa>{Isa::best};
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const at::ScalarType dtype : kDtypes) {
      for (const KVQuant& quant : kFormats) {
        for (const int64_t n_queries : {1, 5}) {
          const std::string what = describe(quant, dtype, 16, L::name) + " Sq " + std::to_string(n_queries);
          PagedCache<L> cache(1, 64, 16, H, D, opts(dtype), quant);
          const at::Tensor table = allocate_table(cache, lengths, 38).to(device());
          at::manual_seed(40);
          const at::Tensor k = at::randn({2, 600, H, D}).to(opts(dtype));
          const at::Tensor v = at::randn({2, 600, H, D}).to(opts(dtype));
          k.select(3, 7).mul_(20);  // an outlier channel
          cache.write(0, table, 0, k.narrow(1, 0, 37), v.narrow(1, 0, 37));
          cache.write(0, table.narrow(0, 0, 1), 37, k.narrow(0, 0, 1).narrow(1, 37, 563),
                      v.narrow(0, 0, 1).narrow(1, 37, 563));
          const at::Tensor q = at::randn({2, n_queries, NH, D}).to(opts(dtype));
          const auto view = cache.bind(table, ints(lengths).to(device()));
          const auto kv = cache.gather(0, table, ints(lengths).to(device()));
          const double scale = 1.0 / std::sqrt(static_cast<double>(D));
          const at::Tensor own = reference_attention(q, kv.first, kv.second, lengths, scale);
          at::Tensor original_k = k.cpu().clone(), original_v = v.cpu().clone();
          original_k[1].narrow(0, 37, 563).zero_();
          original_v[1].narrow(0, 37, 563).zero_();
          const at::Tensor exact = reference_attention(q, original_k, original_v, lengths, scale);
          const double tol = dtype == at::kFloat ? 1e-4 : dtype == at::kHalf ? 2e-3 : 1.6e-2;
          for (const Isa isa : isas) {
            const ScopedIsa scoped(isa);
            const at::Tensor out = pagedkv::paged_attention(view, 0, q).cpu().to(at::kDouble);
            ASSERT_TRUE(all_finite(out)) << what;
            // Kernel error alone: against its own (dequantized) gather.
            const double kernel_err = max_abs(out - own);
            EXPECT_LE(kernel_err, tol) << what << " isa " << pagedkv::simd::isa_name(isa);
            // Quantization error: against the original K/V (values ~N(0, 1));
            // the x20 outlier channel of the keys makes int8 keys coarse (a
            // step of amax / 127 for every channel: why K may be fp8 while V
            // is int8) and fp8 keys' 2^-4 relative error moves sharp scores.
            const double quant_err = max_abs(out - exact);
            const double quant_tol = quant.k == KVFormat::int8 ? 0.5 : quant.k == KVFormat::fp8_e4m3 ? 0.2 : 0.1;
            EXPECT_LE(quant_err, quant_tol) << what << " isa " << pagedkv::simd::isa_name(isa);
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Targets, QuantizedAttention, ::testing::ValuesIn(all_targets()), target_name);

// The kernel decodes an fp8 code through fp16 bits, to e4m3(c) / 2^8, and
// multiplies the scale by 2^8 (simd/convert.hpp): exact for every code
// the encoder writes, the subnormal codes and -0 included.
TEST(QuantizedAttentionCpu, Fp8DecodeThroughHalfIsTheCodecsDecodeOver256) {
  using pagedkv::simd::E4m3Code;
  using pagedkv::simd::kE4m3ViaHalfFactor;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN codes, never written
    const auto code = static_cast<uint8_t>(c);
    const float via_half = pagedkv::simd::to_float32(E4m3Code{code}) * kE4m3ViaHalfFactor;
    const float decoded = pagedkv::cpu::quant::decode_e4m3(code);
    EXPECT_EQ(std::signbit(via_half), std::signbit(decoded)) << "code " << c;
    EXPECT_EQ(via_half, decoded) << "code " << c;
  }
}

// Every vector path against the portable loops on quantized pages, K and V
// in the same and in different formats, for head_dims with a vector tail
// (20, 40) and GQA groups that are not a multiple of the rows scored at once.
TEST(QuantizedAttentionCpu, VectorPathsAgreeWithThePortableLoopsOnCodes) {
  const std::vector<KernelPath> paths = vector_kernel_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU runs no vector path (neither AVX2 nor AVX-512)";
  const std::vector<int64_t> lengths{1, 37, 130};
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const KVQuant& quant : kFormats) {
      for (const at::ScalarType dtype : {at::kFloat, at::kHalf}) {
        for (const int64_t group : {1, 3, 8}) {
          for (const int64_t head_dim : {16, 20, 40, 128}) {
            const std::string what = describe(quant, dtype, 3, L::name) + " G " + std::to_string(group) + " D " +
                                     std::to_string(head_dim);
            const int64_t H = 2;
            PagedCache<L> cache(1, 64, 3, H, head_dim, at::TensorOptions().dtype(dtype), quant);
            const at::Tensor table = allocate_table(cache, lengths, 44);
            const at::Tensor k = hard_data(3, 130, H, head_dim, 7 + static_cast<uint64_t>(head_dim)).div_(1e3);
            const at::Tensor v = at::randn({3, 130, H, head_dim});
            write_prefixes(cache, table, lengths, k, v, dtype);
            const at::Tensor q = at::randn({3, 1, H * group, head_dim}).to(dtype);
            const auto view = cache.bind(table, ints(lengths));
            const at::Tensor portable = attention_on(Isa::portable, view, q);
            ASSERT_TRUE(all_finite(portable)) << what;
            for (const KernelPath& path : paths) {
              const at::Tensor out = attention_on(path, view, q);
              const double bound = dtype == at::kFloat ? 1e-5 : 1e-2;  // fp16: one rounding of the output
              EXPECT_LE(max_abs(out - portable), bound * std::max(1.0, max_abs(portable)))
                  << what << " isa " << path.name();
            }
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  });
}

// The decode path reads codes too where K and V share a format (cpu/
// attention/decode.hpp): every step length, 1 to 16 keys (the sequences'
// last, partial pages: lengths 17 to 32 on pages of 16), and the first, full
// page with its read-ahead of the next, against the portable loops. The
// step multiplies each score by its key's scale and each softmax weight by
// its value's; a step's odd length scores a copy of its last key, whose
// scale must be that key's. fp8 steps widen their codes to fp16 first up
// to a head_dim of 256 (Avx2Decode::kMaxWidenedDim) and read them in place
// above: head_dims 32 and 272. GQA groups of 3 and 4 take one step per
// kv head, of 5 to 8 two (4 rows, then 1 to 4: Qwen2's groups of 5 and 7
// among them), which on fp8 pages share the head's widened codes
// (Avx2Decode::run_widened_head). One thread: each sequence one work
// item. An outlier first token in K and V (x40) makes every scale count.
// Both decode steps of the AVX-512 path (256- and 512-bit passes).
TEST(QuantizedAttentionCpu, DecodeStepsOfEveryLengthOnCodes) {
  const std::vector<KernelPath> paths = vector_kernel_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU runs no vector path (neither AVX2 nor AVX-512)";
  const int previous = at::get_num_threads();
  at::set_num_threads(1);
  std::vector<int64_t> lengths;
  for (int64_t n = 17; n <= 32; ++n) lengths.push_back(n);
  const int64_t B = static_cast<int64_t>(lengths.size()), H = 2;
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const KVFormat format : {KVFormat::fp8_e4m3, KVFormat::int8}) {
      for (const int64_t D : {32, 272}) {
        for (const at::ScalarType dtype : {at::kFloat, at::kHalf}) {
          for (const int64_t group : {3, 4, 5, 6, 7, 8}) {
            const KVQuant quant{format, format};
            const std::string what =
                describe(quant, dtype, 16, L::name) + " G " + std::to_string(group) + " D " + std::to_string(D);
            PagedCache<L> cache(1, 2 * B, 16, H, D, at::TensorOptions().dtype(dtype), quant);
            const at::Tensor table = allocate_table(cache, lengths, 2);
            at::manual_seed(51 + group);
            const at::Tensor k = at::randn({B, 32, H, D});
            const at::Tensor v = at::randn({B, 32, H, D});
            k.select(1, 0).mul_(40);
            v.select(1, 0).mul_(40);
            write_prefixes(cache, table, lengths, k, v, dtype);
            const at::Tensor q = at::randn({B, 1, H * group, D}).to(dtype);
            const auto view = cache.bind(table, ints(lengths));
            const at::Tensor portable = attention_on(Isa::portable, view, q);
            ASSERT_TRUE(all_finite(portable)) << what;
            for (const KernelPath& path : paths) {
              const at::Tensor out = attention_on(path, view, q);
              const double bound = dtype == at::kFloat ? 1e-5 : 1e-2;  // fp16: one rounding of the output
              for (int64_t b = 0; b < B; ++b) {
                EXPECT_LE(max_abs(out[b] - portable[b]), bound * std::max(1.0, max_abs(portable[b])))
                    << what << " last step of " << lengths[static_cast<size_t>(b)] - 16 << " keys, isa "
                    << path.name();
              }
            }
            if (::testing::Test::HasFailure()) break;
          }
        }
      }
    }
  });
  at::set_num_threads(previous);
}

}  // namespace
