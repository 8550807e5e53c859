// The attention suite of issue 4: paged_attention (K/V read straight from
// the pages) against gather + ATen attention (matmul/softmax) on the same
// data, against torch's scaled_dot_product_attention on contiguous K/V
// (torch 2.5 and later), and against three limits: a memcpy of the K/V
// bytes it reads, one pass that only reads them, and its float32
// multiply-adds as FMAs at the core's peak. Decode, fp16, 32 query heads,
// 8 kv heads, head_dim 128, page_size 16, shuffled page tables, both
// layouts. Naming convention: bench/bench_support.hpp (variants: memcpy and
// read = the K/V bytes, fma = the arithmetic, reference = gather + ATen,
// sdpa = torch's SDPA, pagedkv).
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_support.hpp"
#include "pagedkv/attention.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/torch_compat.hpp"

namespace {

using namespace pagedkv_bench;
using pagedkv::HND;
using pagedkv::NHD;
using pagedkv::PagedCache;

constexpr int64_t kQueryHeads = 32;

struct AttentionSpec {
  std::string name;
  int64_t batch;
  int64_t tokens;  ///< context length of every sequence (the new token included)
  at::ScalarType dtype = at::kHalf;
  bool with_reference = true;  ///< gather + ATen is 20-40x slower: only on the main rows
  pagedkv::KVQuant quant = {};  ///< quantized pages: codes + scales are the bytes read
};

/// Whether the case's arithmetic is float32 FMAs, so that the FMA pass
/// limits it: not bf16 pages where the decode step scores by AVX-512 BF16
/// dot products (two multiply-adds per lane and instruction; the AVX2 step
/// of the AVX-512 path, not its 512-bit step).
bool fma_limits(const AttentionSpec& spec) {
  namespace simd = pagedkv::simd;
  namespace cpu_attention = pagedkv::cpu::attention;
  const bool dots = spec.dtype == at::kBFloat16 && !pagedkv::is_quantized(spec.quant) &&
                    simd::selected_isa() == simd::Isa::avx512 && simd::cpu_has_avx512_bf16() &&
                    !cpu_attention::takes_wide_decode_step();
  return FmaLimit::available() && !dots;
}

/// gather + ATen attention, the way an engine without a paged kernel does
/// it: contiguous [B, T, H, D] K/V, then matmul / softmax / matmul per kv
/// head group. ATen 1.13 has no fp16 matmul on the CPU ("addmm_impl_cpu_"
/// not implemented for 'Half'), so K/V are converted to float32 after the
/// gather. K @ q^T on the strided [B, H, T, D] view is the fastest
/// formulation measured (q @ K^T copies K into [B, H, D, T] first: ~4x slower).
/// Decode: every key is visible, no mask needed.
template <class Layout>
at::Tensor gather_then_attention(const pagedkv::CacheView<Layout>& view,
                                 const at::Tensor& q,  // [B, 1, n_heads, D]
                                 double scale) {
  const auto [k, v] = view.gather(0);  // [B, T, H, D] each
  const int64_t batch = q.size(0), heads = k.size(2), group = q.size(2) / heads, dim = q.size(3);
  const at::Tensor kf = k.to(at::kFloat);                                     // [B, T, H, D]
  const at::Tensor vf = v.to(at::kFloat);                                     // [B, T, H, D]
  const at::Tensor qf = q.to(at::kFloat).view({batch, heads, group, dim});    // Sq = 1: the rows are the group
  const at::Tensor scores = at::matmul(kf.transpose(1, 2), qf.transpose(2, 3)).mul_(scale);  // [B, H, T, G]
  const at::Tensor probs = at::softmax(scores, 2);
  const at::Tensor out = at::matmul(probs.transpose(2, 3), vf.transpose(1, 2));  // [B, H, G, D]
  return out.reshape({batch, 1, heads * group, dim}).to(q.scalar_type());
}

template <class Layout>
struct AttentionFixture {
  explicit AttentionFixture(const AttentionSpec& spec) {
    const int64_t cols = pages_for(spec.tokens);
    cache = std::make_unique<PagedCache<Layout>>(1, spec.batch * cols, kPageSize, kHeads, kHeadDim,
                                                 at::TensorOptions().dtype(spec.dtype), spec.quant);
    table = shuffled_page_table(cache->pool(), spec.batch, cols, 17);
    // Gaussian K/V, as a model's are. Not fill_pattern's random bits: as
    // bf16 those are mostly tiny or subnormal floats, whose products are
    // float32 subnormals that cost the FMAs a microcode assist each (the
    // bf16 rows ran 12-18x the memcpy; bench/NOTES.md). Quantized pages
    // need real values too (a byte pattern would leave the scales 0).
    at::manual_seed(21);
    cache->write(0, table, 0, at::randn({spec.batch, spec.tokens, kHeads, kHeadDim}).to(spec.dtype),
                 at::randn({spec.batch, spec.tokens, kHeads, kHeadDim}).to(spec.dtype));
    lengths = at::full({spec.batch}, spec.tokens, at::kLong);
    q = at::randn({spec.batch, 1, kQueryHeads, kHeadDim}).to(spec.dtype);
    scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
    limit = std::make_unique<CopyLimit>(bytes(spec));
    read_limit = std::make_unique<ReadLimit>(bytes_read());
    TORCH_CHECK(read_limit->bytes() == bytes(spec), "bench: the read pass reads ", read_limit->bytes(),
                " bytes, the case ", bytes(spec));
#if PAGEDKV_HAS_TORCH_SDPA_GQA
    // What an engine without a paged cache holds: contiguous [B, H, T, D]
    // K/V in the logical dtype (a quantized cache's gathered values).
    const auto [k, v] = view().gather(0);  // [B, T, H, D]
    k_contiguous = k.transpose(1, 2).contiguous();
    v_contiguous = v.transpose(1, 2).contiguous();
    q_sdpa = q.transpose(1, 2).contiguous();  // [B, n_heads, 1, D]
#endif
    verify();
  }

  /// The bytes paged_attention reads, where they lie: the one layer's K and
  /// V pages (the pool holds exactly the mapped pages) and, quantized, scales.
  std::vector<ReadLimit::Span> bytes_read() const {
    std::vector<ReadLimit::Span> spans;
    for (const at::Tensor& t : {cache->k_cache(), cache->v_cache(), cache->k_scales(), cache->v_scales()}) {
      if (!t.defined()) continue;
      spans.push_back({static_cast<const char*>(t.data_ptr()), t.numel() * static_cast<int64_t>(t.element_size())});
    }
    return spans;
  }

  /// K and V bytes read: codes (1 byte per element) plus a float32 scale
  /// per head vector on a quantized side.
  static int64_t bytes(const AttentionSpec& spec) {
    const auto side = [&](pagedkv::KVFormat f) {
      return pagedkv::is_quantized(f) ? kHeads * (kHeadDim + 4) : kTokenBytes;
    };
    return spec.batch * spec.tokens * (side(spec.quant.k) + side(spec.quant.v));
  }

  pagedkv::CacheView<Layout> view() const { return cache->bind(table, lengths); }
  at::Tensor run() const { return pagedkv::paged_attention(view(), 0, q, scale); }
  at::Tensor run_reference() const { return gather_then_attention(view(), q, scale); }
#if PAGEDKV_HAS_TORCH_SDPA_GQA
  /// torch's SDPA on the contiguous K/V, GQA by enable_gqa; [B, n_heads, 1, D].
  at::Tensor run_sdpa() const {
    return at::scaled_dot_product_attention(q_sdpa, k_contiguous, v_contiguous, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/false, scale, /*enable_gqa=*/true);
  }
#endif

  /// The benchmark is meaningless if pagedkv and the baselines disagree.
  void verify() const {
    const at::Tensor ours = run().to(at::kFloat);
    const auto check = [&](const at::Tensor& theirs, const char* what) {
      const double err = (ours - theirs).abs().max().item<double>() / theirs.abs().max().item<double>();
      TORCH_CHECK(err < 2e-2, "bench: paged_attention disagrees with ", what, " (rel. error ", err, ")");
    };
    check(run_reference().to(at::kFloat), "gather + ATen attention");
#if PAGEDKV_HAS_TORCH_SDPA_GQA
    check(run_sdpa().transpose(1, 2).to(at::kFloat), "torch's scaled_dot_product_attention");
#endif
  }

  std::unique_ptr<PagedCache<Layout>> cache;
  at::Tensor table;
  at::Tensor lengths;
  at::Tensor q;
  double scale = 0.0;
  std::unique_ptr<CopyLimit> limit;
  std::unique_ptr<ReadLimit> read_limit;
#if PAGEDKV_HAS_TORCH_SDPA_GQA
  at::Tensor k_contiguous;  // [B, H, T, D]
  at::Tensor v_contiguous;  // [B, H, T, D]
  at::Tensor q_sdpa;        // [B, n_heads, 1, D]
#endif
};

template <class Layout>
void register_attention(const AttentionSpec& spec) {
  auto get = [spec]() -> AttentionFixture<Layout>& {
    return fixture<AttentionFixture<Layout>>(spec.name,
                                             [&] { return std::make_unique<AttentionFixture<Layout>>(spec); });
  };
  const int64_t bytes = AttentionFixture<Layout>::bytes(spec);
  add(spec.name + "/memcpy", [get, bytes](benchmark::State& state, const std::string& bench_name) {
    auto& f = get();
    timed_loop(state, bench_name, bytes, [&] { f.limit->run(); });
  });
  add(spec.name + "/read", [get, bytes](benchmark::State& state, const std::string& bench_name) {
    auto& f = get();
    timed_loop(state, bench_name, bytes, [&] { benchmark::DoNotOptimize(f.read_limit->run()); });
  });
  if (fma_limits(spec)) {
    // Every K and V element times each query row of its kv head's group.
    const int64_t multiply_adds = 2 * spec.batch * spec.tokens * kHeads * (kQueryHeads / kHeads) * kHeadDim;
    add(spec.name + "/fma", [multiply_adds, bytes](benchmark::State& state, const std::string& bench_name) {
      const FmaLimit limit(multiply_adds);
      timed_loop(state, bench_name, bytes, [&] { benchmark::DoNotOptimize(limit.run()); });
    });
  }
  if (spec.with_reference) {
    add(spec.name + "/reference", [get, bytes](benchmark::State& state, const std::string& bench_name) {
      auto& f = get();
      timed_loop(state, bench_name, bytes, [&] { benchmark::DoNotOptimize(f.run_reference()); });
    });
  }
#if PAGEDKV_HAS_TORCH_SDPA_GQA
  add(spec.name + "/sdpa", [get, bytes](benchmark::State& state, const std::string& bench_name) {
    auto& f = get();
    timed_loop(state, bench_name, bytes, [&] { benchmark::DoNotOptimize(f.run_sdpa()); });
  });
#endif
  add(spec.name + "/pagedkv", [get, bytes](benchmark::State& state, const std::string& bench_name) {
    auto& f = get();
    timed_loop(state, bench_name, bytes, [&] { benchmark::DoNotOptimize(f.run()); });
  });
}

template <class Layout>
void register_layout(const std::string& layout) {
  // fp16 and bf16, on the suite's threads and on one (issue 13's targets are
  // at both); the gather + ATen reference only beside the fp16 main rows.
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    const std::string prefix = "attention_decode/" + layout + (dtype == at::kBFloat16 ? "/bf16" : "");
    for (const std::string threads : {"", "/1thread"}) {
      const bool main_row = dtype == at::kHalf && threads.empty();
      register_attention<Layout>({prefix + "/B32xT2048" + threads, 32, 2048, dtype, main_row});
      register_attention<Layout>({prefix + "/B1xT32768" + threads, 1, 32768, dtype, main_row});
    }
  }
  // Quantized pages (fp16 logical dtype), beside the fp16 rows above: the
  // target is fp8 <= 0.6x the fp16 time at 1 and at 2 threads.
  using pagedkv::KVFormat;
  for (const auto& [name, format] : {std::make_pair(std::string("fp8"), KVFormat::fp8_e4m3),
                                     std::make_pair(std::string("int8"), KVFormat::int8)}) {
    const std::string prefix = "attention_decode/" + layout + "/" + name;
    for (const std::string threads : {"", "/1thread"}) {
      register_attention<Layout>({prefix + "/B32xT2048" + threads, 32, 2048, at::kHalf, false, {format, format}});
      register_attention<Layout>({prefix + "/B1xT32768" + threads, 1, 32768, at::kHalf, false, {format, format}});
    }
  }
}

// ---- Attention options (issues 51 and 52): what each option costs beside
// the plain decode of the same shape, in the same run. fp16, 32 query heads,
// 8 kv heads x 128, page 16, shuffled pages; both layouts.
//   window1024/B32xT32768: a decode at position 32767 with window 1024 on a
//     windowed table's rows (only the window's 64 pages mapped, the 1984
//     columns before them -1), beside plain/B32xT1024 (an unwindowed decode
//     over 1024 tokens: the target is at most 1.3x its time);
//   softcap50 and sinks on B32xT2048, beside plain/B32xT2048 (at most 1.1x);
//   verify{5,9}/{causal,chain,tree}: 1 + K = 5 or 9 query tokens a sequence
//     (speculative decoding's verify pass), causal without a mask, with a
//     chain mask (equal to causal) and with a tree mask, beside the plain
//     single-token decode (the target is at most 1.3x).
// Every row's memcpy limit is the K/V bytes it reads.

struct OptionsSpec {
  std::string name;
  int64_t batch;
  int64_t tokens;          ///< every sequence's length, the new tokens included
  int64_t mapped_tokens;   ///< the last mapped_tokens are on pages; the columns before are -1
  int64_t n_queries = 1;
  enum class Mask { none, chain, tree } mask = Mask::none;
  pagedkv::AttentionOptions options;
};

template <class Layout>
struct OptionsFixture {
  explicit OptionsFixture(const OptionsSpec& spec) {
    const int64_t cols = pages_for(spec.tokens);
    const int64_t mapped = pages_for(spec.mapped_tokens);
    cache = std::make_unique<PagedCache<Layout>>(1, spec.batch * mapped, kPageSize, kHeads, kHeadDim,
                                                 at::TensorOptions().dtype(at::kHalf));
    const at::Tensor pages = shuffled_page_table(cache->pool(), spec.batch, mapped, 23);  // [B, mapped]
    at::manual_seed(22);
    cache->write(0, pages, 0, at::randn({spec.batch, mapped * kPageSize, kHeads, kHeadDim}).to(at::kHalf),
                 at::randn({spec.batch, mapped * kPageSize, kHeads, kHeadDim}).to(at::kHalf));
    table = at::full({spec.batch, cols}, -1, pages.options());
    table.narrow(1, cols - mapped, mapped).copy_(pages);
    lengths = at::full({spec.batch}, spec.tokens, at::kLong);
    q = at::randn({spec.batch, spec.n_queries, kQueryHeads, kHeadDim}).to(at::kHalf);
    options = spec.options;
    if (spec.mask != OptionsSpec::Mask::none) {
      const int64_t n = spec.n_queries;
      at::Tensor mask = at::ones({n, n}, at::kBool).tril();
      if (spec.mask == OptionsSpec::Mask::tree) {
        // Two branches under the first draft token: 0 <- 1 <- 2 <- ..., and
        // every second token after the first starts a sibling of its predecessor.
        mask = at::eye(n, at::kBool);
        for (int64_t i = 1; i < n; ++i) {
          const int64_t parent = i % 2 == 0 ? i - 2 : i - 1;
          mask[i] = mask[i].logical_or(mask[parent < 0 ? 0 : parent]);
        }
      }
      options.tree_mask = mask.expand({spec.batch, n, n}).contiguous();
    }
    limit = std::make_unique<CopyLimit>(bytes(spec));
  }

  static int64_t bytes(const OptionsSpec& spec) {
    const int64_t read = spec.options.window > 0 ? std::min(spec.options.window + spec.n_queries - 1, spec.tokens)
                                                 : spec.tokens;
    return spec.batch * read * 2 * kTokenBytes;
  }

  at::Tensor run() const { return pagedkv::paged_attention(cache->bind(table, lengths), 0, q, options); }

  std::unique_ptr<PagedCache<Layout>> cache;
  at::Tensor table;    // [B, cols]
  at::Tensor lengths;  // [B]
  at::Tensor q;        // [B, Sq, 32, 128]
  pagedkv::AttentionOptions options;
  std::unique_ptr<CopyLimit> limit;
};

template <class Layout>
void register_options(const OptionsSpec& spec) {
  auto get = [spec]() -> OptionsFixture<Layout>& {
    return fixture<OptionsFixture<Layout>>(spec.name, [&] { return std::make_unique<OptionsFixture<Layout>>(spec); });
  };
  const int64_t bytes = OptionsFixture<Layout>::bytes(spec);
  add(spec.name + "/memcpy", [get, bytes](benchmark::State& state, const std::string& bench_name) {
    auto& f = get();
    timed_loop(state, bench_name, bytes, [&] { f.limit->run(); });
  });
  if (FmaLimit::available()) {
    // The floor of the arithmetic: every K and V element read times each
    // query row of its kv head's group, of every query token (1 + K for a
    // verify pass: K + 1 times a decode's multiply-adds over the same bytes).
    const int64_t read = bytes / (2 * kTokenBytes * spec.batch);
    const int64_t multiply_adds = 2 * spec.batch * read * kHeads * (kQueryHeads / kHeads) * kHeadDim * spec.n_queries;
    add(spec.name + "/fma", [multiply_adds, bytes](benchmark::State& state, const std::string& bench_name) {
      const FmaLimit limit(multiply_adds);
      timed_loop(state, bench_name, bytes, [&] { benchmark::DoNotOptimize(limit.run()); });
    });
  }
  add(spec.name + "/pagedkv", [get, bytes](benchmark::State& state, const std::string& bench_name) {
    auto& f = get();
    timed_loop(state, bench_name, bytes, [&] { benchmark::DoNotOptimize(f.run()); });
  });
}

template <class Layout>
void register_options_layout(const std::string& layout) {
  const std::string prefix = "attention_options/" + layout;
  pagedkv::AttentionOptions plain, window, softcap, sinks;
  window.window = 1024;
  softcap.softcap = 50.0;
  sinks.sinks = at::linspace(-1, 1, kQueryHeads);
  register_options<Layout>({prefix + "/plain/B32xT1024", 32, 1024, 1024, 1, OptionsSpec::Mask::none, plain});
  register_options<Layout>({prefix + "/window1024/B32xT32768", 32, 32768, 1024, 1, OptionsSpec::Mask::none, window});
  register_options<Layout>({prefix + "/plain/B32xT2048", 32, 2048, 2048, 1, OptionsSpec::Mask::none, plain});
  register_options<Layout>({prefix + "/softcap50/B32xT2048", 32, 2048, 2048, 1, OptionsSpec::Mask::none, softcap});
  register_options<Layout>({prefix + "/sinks/B32xT2048", 32, 2048, 2048, 1, OptionsSpec::Mask::none, sinks});
  for (const int64_t n : {5, 9}) {
    const std::string verify = prefix + "/verify" + std::to_string(n);
    register_options<Layout>({verify + "/causal/B32xT2048", 32, 2048, 2048, n, OptionsSpec::Mask::none, plain});
    register_options<Layout>({verify + "/chain/B32xT2048", 32, 2048, 2048, n, OptionsSpec::Mask::chain, plain});
    register_options<Layout>({verify + "/tree/B32xT2048", 32, 2048, 2048, n, OptionsSpec::Mask::tree, plain});
  }
}

const bool registered = [] {
  const CpuDescription cpu = describe_cpu();
  benchmark::AddCustomContext("pagedkv_cpu", cpu.model);
  benchmark::AddCustomContext("pagedkv_vector_extensions", cpu.extensions);
  if (!cpu.microarchitecture.empty()) {
    benchmark::AddCustomContext("pagedkv_cpu_microarchitecture", cpu.microarchitecture);
  }
  namespace simd = pagedkv::simd;
  namespace cpu_attention = pagedkv::cpu::attention;
  benchmark::AddCustomContext("pagedkv_attention_isa", simd::isa_name(simd::selected_isa()));
  const char* decode_step = cpu_attention::decode_step_isa_name(simd::selected_isa());
  benchmark::AddCustomContext("pagedkv_attention_decode_step", decode_step != nullptr ? decode_step : "none");
  register_layout<NHD>("NHD");
  register_layout<HND>("HND");
  register_options_layout<NHD>("NHD");
  register_options_layout<HND>("HND");
  return true;
}();

}  // namespace
