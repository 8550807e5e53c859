// paged_attention: decode and chunked prefill against a float64 reference
// (gather, then softmax(q k^T * scale + causal mask) v), for both layouts,
// fp32/fp16/bf16, page sizes 1/3/16, GQA ratios 1/4/8, ragged lengths,
// int32/int64 page tables, split contexts; and every bad input — on every
// test target (cpu, cpu_generic = the ATen fallback, cuda).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "test_support.hpp"

namespace {

using pagedkv::paged_attention;
using namespace pagedkv_test;

/// softmax(q k^T * scale + causal mask) v in float64, per sequence.
/// q: [B, Sq, Hq, D]; k[b], v[b]: [lengths[b], H, D]. Returns [B, Sq, Hq, D] float64 (cpu).
at::Tensor reference(const at::Tensor& q, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                     double scale) {
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2);
  std::vector<at::Tensor> outs;
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor kb = k[static_cast<size_t>(b)].cpu().to(at::kDouble);  // [L, H, D]
    const at::Tensor vb = v[static_cast<size_t>(b)].cpu().to(at::kDouble);
    const int64_t length = kb.size(0), group = n_heads / kb.size(1);
    const at::Tensor qb = q[b].cpu().to(at::kDouble).permute({1, 0, 2});                      // [Hq, Sq, D]
    const at::Tensor ke = kb.repeat_interleave(group, 1).permute({1, 2, 0});                  // [Hq, D, L]
    const at::Tensor ve = vb.repeat_interleave(group, 1).permute({1, 0, 2});                  // [Hq, L, D]
    at::Tensor scores = at::matmul(qb, ke) * scale;                                           // [Hq, Sq, L]
    const at::Tensor pos = at::arange(length, at::kLong).view({1, length});
    const at::Tensor last = at::arange(n_queries, at::kLong).view({n_queries, 1}) + (length - n_queries);
    scores.masked_fill_(pos.gt(last).unsqueeze(0), -INFINITY);
    outs.push_back(at::matmul(at::softmax(scores, -1), ve).permute({1, 0, 2}));  // [Sq, Hq, D]
  }
  return at::stack(outs);
}

double rel_error(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = out.cpu().to(at::kDouble);
  return (o - ref).abs().max().item<double>() / std::max(1e-12, ref.abs().max().item<double>());
}

double tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 1e-5 : 2e-2; }

class AttentionTest : public TargetTest {};

/// The instruction sets this machine runs, and `best` (what an engine gets).
std::vector<pagedkv::simd::Isa> isas_to_test() {
  auto isas = pagedkv::simd::available_isas();
  isas.push_back(pagedkv::simd::Isa::best);
  return isas;
}

/// A cache holding per-sequence K/V of `lengths` tokens on scattered pages,
/// and those K/V for the reference.
template <class L>
struct Filled {
  PagedCache<L> cache;
  at::Tensor page_table;  // [B, cols]
  at::Tensor lengths;     // [B]
  std::vector<at::Tensor> k, v;  // [lengths[b], H, D] each

  Filled(const std::vector<int64_t>& lens, int64_t page_size, int64_t kv_heads, int64_t head_dim,
         at::TensorOptions options, at::ScalarType index, uint64_t seed, int64_t layer = 1, int64_t spare_cols = 1)
      : cache(2, pages_needed(lens, page_size, spare_cols) + 3, page_size, kv_heads, head_dim, options) {
    const int64_t batch = static_cast<int64_t>(lens.size());
    const int64_t cols = max_cols(lens, page_size) + spare_cols;
    std::vector<int64_t> pages = cache.alloc_n(cache.n_pages() - 1);  // one page stays free
    std::mt19937_64 rng(seed);
    std::shuffle(pages.begin(), pages.end(), rng);
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(batch), std::vector<int64_t>(cols, -1));
    size_t next = 0;
    for (int64_t b = 0; b < batch; ++b) {
      // Map the pages the sequence uses, plus a spare column (then -1).
      const int64_t used = (lens[static_cast<size_t>(b)] + page_size - 1) / page_size + spare_cols;
      for (int64_t c = 0; c < std::min(used, cols); ++c) {
        rows[static_cast<size_t>(b)][static_cast<size_t>(c)] = pages[next++];
      }
    }
    page_table = table(rows, index).to(options.device());
    lengths = ints(lens, index).to(options.device());
    at::manual_seed(seed);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lens[static_cast<size_t>(b)];
      k.push_back(at::randn({len, kv_heads, head_dim}, at::kFloat).to(options));
      v.push_back(at::randn({len, kv_heads, head_dim}, at::kFloat).to(options));
      if (len > 0) {
        cache.write(layer, page_table.slice(0, b, b + 1), 0, k.back().unsqueeze(0), v.back().unsqueeze(0));
      }
    }
  }

  static int64_t max_cols(const std::vector<int64_t>& lens, int64_t page_size) {
    int64_t m = 0;
    for (int64_t l : lens) m = std::max(m, (l + page_size - 1) / page_size);
    return m;
  }
  static int64_t pages_needed(const std::vector<int64_t>& lens, int64_t page_size, int64_t spare_cols) {
    int64_t n = 0;
    for (int64_t l : lens) n += (l + page_size - 1) / page_size + spare_cols;
    return n;
  }
};

TEST(AttentionKernels, HalfConversionIsBitIdenticalToC10) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float ours = pagedkv::simd::half_to_float(static_cast<uint16_t>(bits));
    const float theirs = static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
    uint32_t a, b;
    std::memcpy(&a, &ours, 4);
    std::memcpy(&b, &theirs, 4);
    ASSERT_EQ(a, b) << "half bits " << bits;
  }
}

TEST(AttentionKernels, PlanSplitsLongContextsAcrossThreads) {
  using pagedkv::cpu::attention::plan;
  // Decode, B = 1 x 32k tokens, 8 kv heads (one item takes all 8), 16 threads:
  // split into at least one piece per thread, covering [0, 32768) in order.
  const auto p = plan({32768}, 1, 4, 8, 16);
  EXPECT_EQ(p.heads, 8);
  EXPECT_GE(p.work.size(), 16u);
  ASSERT_EQ(p.split.size(), 1u);
  int64_t covered = 0;
  for (const auto& w : p.work) {
    EXPECT_EQ(w.t0, covered);
    covered = w.t1;
  }
  EXPECT_EQ(covered, 32768);
  // A large batch already gives every thread several items: no split.
  EXPECT_TRUE(plan(std::vector<int64_t>(32, 2048), 1, 4, 8, 4).split.empty());
  // One thread: never split.
  EXPECT_TRUE(plan({32768}, 1, 4, 8, 1).split.empty());
  // Chunked prefill: one kv head per item, tiles of 64 / G queries that read
  // only up to their last query's position.
  const auto prefill = plan({100}, 40, 2, 3, 1);
  EXPECT_EQ(prefill.heads, 1);
  ASSERT_EQ(prefill.work.size(), 6u);  // 2 tiles x 3 kv heads
  EXPECT_EQ(prefill.work[0].t1, 60 + 32);
  EXPECT_EQ(prefill.work[3].t1, 100);
}

TEST(AttentionKernels, ReadAheadChunksAreWholeScorePassesOfAtMost8Rows) {
  using pagedkv::cpu::attention::read_ahead_chunk;
  EXPECT_EQ(read_ahead_chunk(128, 2), 8);   // fp16 x 128: 256-byte vectors, 2 KiB
  EXPECT_EQ(read_ahead_chunk(128, 1), 8);   // fp8 / int8 codes: 16 would fit, 8 read faster
  EXPECT_EQ(read_ahead_chunk(128, 4), 4);   // float32
  EXPECT_EQ(read_ahead_chunk(40, 2), 8);    // 25 vectors fit: 8
  EXPECT_EQ(read_ahead_chunk(200, 2), 4);   // 5 fit: rounded down to one pass of 4 keys
  EXPECT_EQ(read_ahead_chunk(1024, 4), 4);  // a vector larger than the chunk: still one pass
  for (int64_t head_dim = 1; head_dim <= 300; ++head_dim) {
    for (int64_t elem_size : {1, 2, 4}) {
      const int64_t chunk = read_ahead_chunk(head_dim, elem_size);
      EXPECT_TRUE(chunk == 4 || chunk == 8) << head_dim << " x " << elem_size << ": " << chunk;
      if (chunk > 4) {
        EXPECT_LE(chunk * head_dim * elem_size, pagedkv::cpu::attention::kPrefetchChunkBytes);
      }
    }
  }
}

// The kernel reads a block in PieceOrder and prefetches, before each piece,
// the one next_in_block names: both must agree on one sequence that visits
// every (head, chunk) once, chunk by chunk where token_major.
TEST(AttentionKernels, PieceOrderVisitsEveryPieceOnceAndNamesTheNext) {
  using pagedkv::cpu::attention::PieceOrder;
  for (const bool token_major : {false, true}) {
    for (const int64_t heads : {1, 3, 8}) {
      for (const int64_t n : {1, 7, 8, 9, 32}) {
        const PieceOrder order{token_major, heads, 8};
        std::vector<std::array<int64_t, 3>> pieces;  // (head, j0, count)
        order.for_each(n, [&](int64_t h, int64_t j0, int64_t c) { pieces.push_back({h, j0, c}); });
        const std::string where = std::string(token_major ? "token-major" : "head-major") +
                                  " heads=" + std::to_string(heads) + " n=" + std::to_string(n);
        // Every row of every head exactly once.
        std::vector<int> seen(static_cast<size_t>(heads * n), 0);
        for (const auto& [h, j0, c] : pieces) {
          EXPECT_EQ(j0 % 8, 0) << where;
          EXPECT_EQ(c, std::min<int64_t>(8, n - j0)) << where;
          for (int64_t j = j0; j < j0 + c; ++j) ++seen[static_cast<size_t>(h * n + j)];
        }
        EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), heads * n) << where;
        // next_in_block walks the same sequence, and ends after the last piece.
        for (size_t i = 0; i < pieces.size(); ++i) {
          int64_t h = pieces[i][0], j0 = pieces[i][1];
          const bool in_block = order.next_in_block(n, h, j0);
          ASSERT_EQ(in_block, i + 1 < pieces.size()) << where << " piece " << i;
          if (in_block) {
            EXPECT_EQ(h, pieces[i + 1][0]) << where << " piece " << i;
            EXPECT_EQ(j0, pieces[i + 1][1]) << where << " piece " << i;
          }
        }
        // Token-major: all heads of a chunk before the next chunk.
        if (token_major && heads > 1 && n > 8) {
          EXPECT_EQ(pieces[1][0], 1) << where;
          EXPECT_EQ(pieces[1][1], 0) << where;
        } else if (!token_major && n > 8) {
          EXPECT_EQ(pieces[1][0], 0) << where;
          EXPECT_EQ(pieces[1][1], 8) << where;
        }
      }
    }
  }
}

TEST_P(AttentionTest, MatchesFloat64ReferenceAcrossShapes) {
  std::mt19937_64 rng(1234);
  uint64_t seed = 1;
  // Every instruction set of the CPU kernel this machine runs (portable,
  // AVX2, AVX-512), and the one it picks by itself.
  for (auto isa : isas_to_test()) {
    for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (int64_t page_size : {1, 3, 16}) {
        for (int64_t group : {1, 4, 8}) {
          for (int64_t n_queries : {1, 5}) {
            for_each_layout([&](auto layout) {
              using L = decltype(layout);
              const at::ScalarType index = (seed % 2 == 0) ? at::kInt : at::kLong;
              const int64_t kv_heads = 2;
              // 20 and 24: the tails past the 16- and 8-wide loops over head_dim.
              const int64_t head_dim = seed % 3 == 0 ? 20 : seed % 3 == 1 ? 24 : 32;
              std::vector<int64_t> lens;
              for (int b = 0; b < 3; ++b) lens.push_back(n_queries + static_cast<int64_t>(rng() % 70));
              lens[0] = n_queries;  // no prefix at all (decode at position 0 / a fresh prefill)
              Filled<L> f(lens, page_size, kv_heads, head_dim, opts(dtype), index, ++seed);
              const at::Tensor q = at::randn({3, n_queries, kv_heads * group, head_dim}, at::kFloat).to(opts(dtype));
              const auto view = f.cache.bind(f.page_table, f.lengths);
              const pagedkv::simd::ScopedIsa scoped_isa(isa);
              const at::Tensor out = paged_attention(view, 1, q);
              const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
              const double err = rel_error(out, reference(q, f.k, f.v, scale));
              EXPECT_LT(err, tolerance(dtype)) << L::name << " " << dtype << " P=" << page_size << " G=" << group
                                               << " Sq=" << n_queries << " index=" << index << " D=" << head_dim
                                               << " isa=" << pagedkv::simd::isa_name(isa);
              EXPECT_EQ(out.sizes(), q.sizes());
              EXPECT_EQ(out.scalar_type(), dtype);
              EXPECT_EQ(out.device(), q.device());
            });
          }
        }
      }
    }
  }
}

// Each vector path (AVX2, AVX-512: whichever this CPU has; skipped
// otherwise) against the portable loops on the same inputs: the same
// arithmetic in another order, so within float32 rounding of the result.
// Covers row groups of 1..4 query heads per kv head (G = 1, 2, 3, 5, 8), odd
// head_dims (the masked / scalar tails), both layouts (in place reads of
// NHD's strided rows and HND's runs) and every dtype.
TEST_P(AttentionTest, VectorPathsAgreeWithThePortableLoops) {
  using pagedkv::simd::Isa;
  using pagedkv::simd::ScopedIsa;
  const std::vector<KernelPath> paths = vector_kernel_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU runs no vector path (neither AVX2 nor AVX-512)";
  if (GetParam().backend == pagedkv::Backend::generic || GetParam().device != at::kCPU)
    GTEST_SKIP() << "the instruction sets are the CPU kernel's";
  uint64_t seed = 500;
  for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (int64_t group : {1, 2, 3, 5, 8}) {
      for (int64_t head_dim : {16, 20, 40, 128}) {
        for_each_layout([&](auto layout) {
          using L = decltype(layout);
          Filled<L> f({1, 37, 130}, 16, 2, head_dim, opts(dtype), at::kLong, ++seed);
          const at::Tensor q = at::randn({3, 1, 2 * group, head_dim}, at::kFloat).to(opts(dtype));
          const auto view = f.cache.bind(f.page_table, f.lengths);
          at::Tensor portable;
          {
            const ScopedIsa scoped(Isa::portable);
            portable = paged_attention(view, 1, q).to(at::kFloat);
          }
          for (const KernelPath& path : paths) {
            const ScopedKernelPath scoped(path);
            const at::Tensor out = paged_attention(view, 1, q).to(at::kFloat);
            const double diff = (out - portable).abs().max().item<double>();
            const double bound = dtype == at::kFloat ? 1e-5 : 1e-2;  // fp16/bf16: one rounding of the output
            EXPECT_LE(diff, bound * std::max(1.0, portable.abs().max().item<double>()))
                << path.name() << " " << L::name << " " << dtype << " G=" << group << " D=" << head_dim;
          }
        });
      }
    }
  }
}

TEST_P(AttentionTest, ChunkedPrefillOnTopOfAPrefixWrittenThroughTheView) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const int64_t kv_heads = 2, group = 4, head_dim = 16, page_size = 3, n_new = 7;
    const std::vector<int64_t> prefix = {10, 0, 23};
    Filled<L> f(prefix, page_size, kv_heads, head_dim, opts(), at::kLong, 77, /*layer=*/0, /*spare_cols=*/3);
    // The new chunk is written first (per-sequence starts), then attended to.
    at::manual_seed(5);
    const at::Tensor k_new = at::randn({3, n_new, kv_heads, head_dim}).to(opts());
    const at::Tensor v_new = at::randn({3, n_new, kv_heads, head_dim}).to(opts());
    auto writer = f.cache.bind(f.page_table, f.lengths);
    writer.write(0, ints(prefix).to(opts().device()), k_new, v_new);
    std::vector<int64_t> lens;
    std::vector<at::Tensor> k_all, v_all;
    for (int64_t b = 0; b < 3; ++b) {
      lens.push_back(prefix[static_cast<size_t>(b)] + n_new);
      k_all.push_back(at::cat({f.k[static_cast<size_t>(b)], k_new[b]}));
      v_all.push_back(at::cat({f.v[static_cast<size_t>(b)], v_new[b]}));
    }
    const auto view = f.cache.bind(f.page_table, ints(lens).to(opts().device()));
    // q as a slice of a fused QKV projection: non-contiguous.
    const at::Tensor qkv = at::randn({3, n_new, kv_heads * group + 2 * kv_heads, head_dim}).to(opts());
    const at::Tensor q = qkv.slice(2, 0, kv_heads * group);
    ASSERT_FALSE(q.is_contiguous());
    const double scale = 0.3;
    const at::Tensor out = paged_attention(view, 0, q, scale);
    EXPECT_LT(rel_error(out, reference(q, k_all, v_all, scale)), 1e-5) << L::name;
  });
}

// A decode or short chunk takes every kv head in one work item; with 8 of
// them (the benchmark's geometry), NHD blocks are read chunk by chunk, all
// 8 heads of a chunk in a row, each head's scores in its own scratch row
// (PieceOrder). Lengths end mid-chunk and mid-block; quantized pages go the
// same way (test_quantized).
TEST_P(AttentionTest, EightKvHeadsInOneItemMatchReference) {
  for (auto isa : isas_to_test()) {
    const pagedkv::simd::ScopedIsa scoped_isa(isa);
    for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
      for (int64_t group : {4, 8}) {
        for (int64_t n_queries : {1, 2}) {
          for_each_layout([&](auto layout) {
            using L = decltype(layout);
            Filled<L> f({n_queries, 45, 77}, 16, 8, 128, opts(dtype), at::kLong, 300 + group + n_queries);
            const at::Tensor q = at::randn({3, n_queries, 8 * group, 128}).to(opts(dtype));
            const at::Tensor out = paged_attention(f.cache.bind(f.page_table, f.lengths), 1, q);
            const double scale = 1.0 / std::sqrt(128.0);
            EXPECT_LT(rel_error(out, reference(q, f.k, f.v, scale)), tolerance(dtype))
                << L::name << " " << dtype << " G=" << group << " Sq=" << n_queries
                << " isa=" << pagedkv::simd::isa_name(isa);
          });
        }
      }
    }
  }
}

TEST_P(AttentionTest, LongContextsSplitAcrossThreadsMatch) {
  // Forces a multi-thread plan so that the split/merge path runs whatever
  // the machine (OpenMP: the thread count may change between regions).
  const int previous = at::get_num_threads();
  at::set_num_threads(4);
  for (auto isa : isas_to_test()) {
    const pagedkv::simd::ScopedIsa scoped_isa(isa);
    for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for_each_layout([&](auto layout) {
        using L = decltype(layout);
        const double scale = 1.0 / std::sqrt(32.0);
        // Decode (GQA 4, 2 kv heads in one item): one long and one short sequence.
        Filled<L> decode({2900, 17}, 16, 2, 32, opts(dtype), at::kInt, 99);
        const at::Tensor q1 = at::randn({2, 1, 8, 32}).to(opts(dtype));
        const at::Tensor out1 = paged_attention(decode.cache.bind(decode.page_table, decode.lengths), 1, q1);
        EXPECT_LT(rel_error(out1, reference(q1, decode.k, decode.v, scale)), tolerance(dtype)) << L::name;
        // Chunked prefill of 40 tokens on long prefixes: tiles x splits.
        Filled<L> prefill({2900, 1200}, 16, 1, 32, opts(dtype), at::kLong, 98);
        const at::Tensor q40 = at::randn({2, 40, 2, 32}).to(opts(dtype));
        const at::Tensor out40 = paged_attention(prefill.cache.bind(prefill.page_table, prefill.lengths), 1, q40);
        EXPECT_LT(rel_error(out40, reference(q40, prefill.k, prefill.v, scale)), tolerance(dtype)) << L::name;
      });
    }
  }
  at::set_num_threads(previous);
}

// AMD family 25 (Zen 3, Zen 4) has no core with two 512-bit FMA pipes: Zen 4
// splits a 512-bit FMA in two, and there the 512-bit decode step is 1.07-1.3x
// slower. cpu_has_wide_fmas once said yes on Zen 4 when built with -O3: its
// twelve timed chains started equal, g++ merged them into one, and the
// timing measured latency (a ratio of exactly 2) instead of throughput.
TEST(AttentionPaths, NoWideFmasOnAmdFamily25) {
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  ASSERT_NE(__get_cpuid(0, &eax, &ebx, &ecx, &edx), 0);
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  ASSERT_NE(__get_cpuid(1, &eax, &ebx, &ecx, &edx), 0);
  const unsigned family = ((eax >> 8) & 0xF) + (((eax >> 8) & 0xF) == 0xF ? (eax >> 20) & 0xFF : 0);
  if (std::strcmp(vendor, "AuthenticAMD") != 0 || family != 25) GTEST_SKIP() << "not AMD family 25 (" << vendor << ")";
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  // The sanitizer build is clang -O1: its timed loops are not the release
  // build's code, and under ctest -j2 the two widths' timings interleave
  // with other tests' (it failed once so, passing alone).
  GTEST_SKIP() << "the probe times clang -O1 code in sanitizer builds";
#endif
#endif
  EXPECT_FALSE(pagedkv::simd::cpu_has_wide_fmas());
#else
  GTEST_SKIP() << "no AVX-512 path in this build";
#endif
}

// Which decode step each vector path takes (bench/report prints it beside
// the kernel's path): AVX-512 machines take the AVX2 step, which on Zen 4
// decoded in 0.63-0.74x the time of the AVX-512 general loop, with bf16
// scores by dot products where the CPU has AVX-512 BF16; the 512-bit step
// where a 512-bit FMA does twice the work of a 256-bit one
// (cpu_has_wide_fmas), or where a ScopedDecodeStep asks for it.
TEST(AttentionPaths, DecodeStepOfEachPath) {
  using pagedkv::cpu::attention::decode_step_isa_name;
  using pagedkv::cpu::attention::DecodeStep;
  using pagedkv::simd::Isa;
  using pagedkv::cpu::attention::ScopedDecodeStep;
  EXPECT_EQ(decode_step_isa_name(Isa::portable), nullptr);
#ifdef PAGEDKV_ATTENTION_AVX2
  EXPECT_STREQ(decode_step_isa_name(Isa::avx2), "avx2");
  {
    const ScopedDecodeStep wide(DecodeStep::avx512);  // the AVX-512 path's choice only
    EXPECT_STREQ(decode_step_isa_name(Isa::avx2), "avx2");
  }
#endif
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
  const char* narrow = pagedkv::simd::cpu_has_avx512_bf16() ? "avx2, bf16 scores by avx512_bf16" : "avx2";
  EXPECT_STREQ(decode_step_isa_name(Isa::avx512),
               pagedkv::simd::cpu_has_wide_fmas() ? "avx512" : narrow);
  {
    const ScopedDecodeStep forced(DecodeStep::avx2);
    EXPECT_STREQ(decode_step_isa_name(Isa::avx512), narrow);
  }
  if (pagedkv::simd::cpu_has_avx512()) {
    const ScopedDecodeStep forced(DecodeStep::avx512);
    EXPECT_STREQ(decode_step_isa_name(Isa::avx512), "avx512");
  }
#endif
}

// The decode path (cpu/attention/decode.hpp: one query, native pages,
// head_dim a multiple of 16; AVX2, and AVX-512 machines) against the float64 reference where its
// frame has edges: pages longer than a step (24 > kDecodeKeys), odd steps
// (pages of 3 and 5 tokens), splits whose first token is inside a page (4
// threads; a split is a multiple of 32 tokens), one kv head per item and
// eight (NHD: every head of a token, read ahead as one run), groups of
// 1 / 3 / 4 / 8 query heads; and head_dims it does not take (24, 40).
// Not on the ATen fallback (cpu_generic), which has no such path: 9 s there
// (37 s under the sanitizers) for nothing the other cases do not check.
TEST_P(AttentionTest, DecodeStepsMatchReferenceAcrossPagesAndSplits) {
  if (GetParam().backend == pagedkv::Backend::generic) GTEST_SKIP() << "the decode path is the CPU kernel's";
  const int previous = at::get_num_threads();
  at::set_num_threads(4);
  uint64_t seed = 700;
  for (auto isa : isas_to_test()) {
    const pagedkv::simd::ScopedIsa scoped_isa(isa);
    for (at::ScalarType dtype : {at::kFloat, at::kHalf}) {
      for (int64_t page_size : {3, 5, 16, 24}) {
        for (int64_t head_dim : {16, 24, 40, 128}) {
          for_each_layout([&](auto layout) {
            using L = decltype(layout);
            const int64_t kv_heads = seed % 2 == 0 ? 8 : 1;
            const int64_t group = std::array<int64_t, 4>{1, 3, 4, 8}[seed % 4];
            Filled<L> f({1, 19, 1100}, page_size, kv_heads, head_dim, opts(dtype), at::kLong, ++seed);
            const at::Tensor q = at::randn({3, 1, kv_heads * group, head_dim}).to(opts(dtype));
            const at::Tensor out = paged_attention(f.cache.bind(f.page_table, f.lengths), 1, q);
            const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
            EXPECT_LT(rel_error(out, reference(q, f.k, f.v, scale)), tolerance(dtype))
                << L::name << " " << dtype << " P=" << page_size << " D=" << head_dim << " H=" << kv_heads
                << " G=" << group << " isa=" << pagedkv::simd::isa_name(isa);
          });
        }
      }
    }
  }
  at::set_num_threads(previous);
}

// Every step length of the decode path, 1 to 16 keys (the sequences'
// last, partial pages: lengths 17 to 32 on pages of 16): the step scores
// keys three at a time, then none, one or two pairs, and an odd length
// copies its last key's scores for the softmax's pairs. Every native page
// type (their loads differ), groups of 3 and 4 rows. One thread: every
// sequence is one work item, so each step is a page's run, not a split's.
TEST_P(AttentionTest, DecodeStepsOfEveryLength) {
  if (GetParam().backend == pagedkv::Backend::generic) GTEST_SKIP() << "the decode path is the CPU kernel's";
  const int previous = at::get_num_threads();
  at::set_num_threads(1);
  std::vector<int64_t> lengths;
  for (int64_t n = 17; n <= 32; ++n) lengths.push_back(n);
  uint64_t seed = 900;
  for (auto isa : isas_to_test()) {
    const pagedkv::simd::ScopedIsa scoped_isa(isa);
    for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (int64_t group : {3, 4}) {
        for_each_layout([&](auto layout) {
          using L = decltype(layout);
          const int64_t kv_heads = 2, head_dim = 32;
          Filled<L> f(lengths, 16, kv_heads, head_dim, opts(dtype), at::kLong, ++seed);
          const at::Tensor q = at::randn({static_cast<int64_t>(lengths.size()), 1, kv_heads * group, head_dim}).to(opts(dtype));
          const at::Tensor out = paged_attention(f.cache.bind(f.page_table, f.lengths), 1, q);
          const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
          const at::Tensor expected = reference(q, f.k, f.v, scale);
          for (int64_t b = 0; b < static_cast<int64_t>(lengths.size()); ++b) {
            EXPECT_LT(rel_error(out[b], expected[b]), tolerance(dtype))
                << L::name << " " << dtype << " G=" << group << " last step of " << lengths[static_cast<size_t>(b)] - 16
                << " keys, isa=" << pagedkv::simd::isa_name(isa);
          }
        });
      }
    }
  }
  at::set_num_threads(previous);
}

TEST_P(AttentionTest, PagedMatchesGatherThenAttentionInADecodeLoop) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const int64_t kv_heads = 2, group = 2, head_dim = 16, steps = 9;
    PagedCache<L> cache(1, 16, 4, kv_heads, head_dim, opts(at::kHalf));
    const auto pages = cache.alloc_n(6);
    const at::Tensor pt = table({{pages[5], pages[2], pages[0]}, {pages[1], pages[4], pages[3]}}).to(opts().device());
    std::vector<int64_t> lens = {3, 0};
    at::manual_seed(11);
    const at::Tensor prompt_k = at::randn({1, 3, kv_heads, head_dim}).to(opts(at::kHalf));
    cache.write(0, pt.slice(0, 0, 1), 0, prompt_k, prompt_k);
    for (int64_t step = 0; step < steps; ++step) {
      const at::Tensor k = at::randn({2, 1, kv_heads, head_dim}).to(opts(at::kHalf));
      const at::Tensor v = at::randn({2, 1, kv_heads, head_dim}).to(opts(at::kHalf));
      cache.write(0, pt, ints(lens).to(opts().device()), k, v);
      for (auto& l : lens) ++l;
      const auto view = cache.bind(pt, ints(lens).to(opts().device()));
      const at::Tensor q = at::randn({2, 1, kv_heads * group, head_dim}).to(opts(at::kHalf));
      const at::Tensor out = paged_attention(view, 0, q);
      const auto kv = view.gather(0);  // [B, T, H, D], zeros past each length
      std::vector<at::Tensor> ks, vs;
      for (int64_t b = 0; b < 2; ++b) {
        ks.push_back(kv.first[b].slice(0, 0, lens[static_cast<size_t>(b)]));
        vs.push_back(kv.second[b].slice(0, 0, lens[static_cast<size_t>(b)]));
      }
      EXPECT_LT(rel_error(out, reference(q, ks, vs, 1.0 / std::sqrt(16.0))), 2e-2) << L::name << " step " << step;
    }
  });
}

TEST_P(AttentionTest, EmptyBatchAndNoQueries) {
  PagedCache<NHD> cache(1, 4, 2, 1, 8, opts());
  const at::Tensor empty_table = at::empty({0, 3}, at::kLong).to(opts().device());
  const auto empty_view = cache.bind(empty_table, at::empty({0}, at::kLong).to(opts().device()));
  EXPECT_EQ(paged_attention(empty_view, 0, at::zeros({0, 1, 2, 8}, opts())).sizes(),
            (std::vector<int64_t>{0, 1, 2, 8}));
  const auto pages = cache.alloc_n(1);
  const auto view = cache.bind(table({{pages[0]}}).to(opts().device()), ints({0}).to(opts().device()));
  EXPECT_EQ(paged_attention(view, 0, at::zeros({1, 0, 2, 8}, opts())).sizes(), (std::vector<int64_t>{1, 0, 2, 8}));
}

// ---- bad input: c10::Error with a clear message, nothing changed ----

/// The cache, plus the input tensors: paged_attention must not change them either.
template <class L>
struct Snapshot {
  Snapshot(const PagedCache<L>& cache, const std::vector<at::Tensor>& tensors) : cache_state(cache) {
    for (const auto& t : tensors) inputs.push_back(t.clone());
    originals = tensors;
  }
  void expect_same_as(const PagedCache<L>& cache) const {
    cache_state.expect_same(cache);
    for (size_t i = 0; i < inputs.size(); ++i) EXPECT_TRUE(bitwise_equal(originals[i], inputs[i])) << "input changed";
  }
  CacheSnapshot cache_state;
  std::vector<at::Tensor> inputs, originals;
};

template <class L>
void expect_rejected(const PagedCache<L>& cache, const std::vector<at::Tensor>& inputs,
                     const std::function<void()>& call, const std::vector<std::string>& phrases) {
  const Snapshot<L> before(cache, inputs);
  EXPECT_THROW(
      {
        try {
          call();
        } catch (const c10::Error& e) {
          const std::string message = e.what_without_backtrace();
          for (const auto& phrase : phrases) EXPECT_NE(message.find(phrase), std::string::npos) << message;
          throw;
        }
      },
      c10::Error);
  before.expect_same_as(cache);
}

TEST_P(AttentionTest, BadInputThrowsAndChangesNothing) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const std::string fn = std::string("pagedkv::paged_attention<") + L::name + ">";
    Filled<L> f({5, 9}, 4, 2, 8, opts(), at::kLong, 3);
    const auto view = f.cache.bind(f.page_table, f.lengths);
    const at::Tensor q = at::randn({2, 2, 4, 8}).to(opts());
    const std::vector<at::Tensor> inputs = {q, f.page_table, f.lengths};
    auto& cache = f.cache;

    expect_rejected(cache, inputs, [&] { paged_attention(view, 2, q); }, {fn, "'layer'", "[0, 2)", "got 2"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, -1, q); }, {fn, "'layer'"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, q[0]); }, {fn, "'q'", "4-D", "got 3-D"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, at::randn({2, 2, 3, 8}).to(opts())); },
                    {fn, "'q'", "multiple of the cache's n_kv_heads 2", "[2, 2, 3, 8]"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, at::randn({2, 2, 1, 8}).to(opts())); },
                    {fn, "'q'", "multiple"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, at::randn({2, 2, 4, 6}).to(opts())); },
                    {fn, "'q'", "head_dim 8", "[2, 2, 4, 6]"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, at::randn({3, 2, 4, 8}).to(opts())); },
                    {fn, "'q'", "batch 2"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, q.to(at::kHalf)); },
                    {fn, "'q'", "dtype Float", "got Half"});
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, q, std::nan("")); }, {fn, "'scale'", "finite"});
    // Lengths missing: a view bound with a total length.
    const auto total_view = cache.bind(f.page_table, 5);
    expect_rejected(cache, inputs, [&] { paged_attention(total_view, 1, q); },
                    {fn, "bound with per-sequence lengths"});
    // Lengths shorter than Sq, or 0.
    const auto short_view = cache.bind(f.page_table, ints({1, 9}).to(opts().device()));
    expect_rejected(cache, inputs, [&] { paged_attention(short_view, 1, q); },
                    {fn, "'lengths'", "lengths[0] >= 2", "got 1"});
    const auto zero_view = cache.bind(f.page_table, ints({5, 0}).to(opts().device()));
    expect_rejected(cache, inputs, [&] { paged_attention(zero_view, 1, q.slice(1, 0, 1)); },
                    {fn, "'lengths'", "lengths[1] >= 1", "nothing to attend to", "got 0"});
    // The engine grew the bound lengths in place past the mapped pages.
    const at::Tensor lengths = ints({5, 9}).to(opts().device());
    const auto grown_view = cache.bind(f.page_table, lengths);
    lengths.fill_(20);
    expect_rejected(cache, inputs, [&] { paged_attention(grown_view, 1, q); }, {fn, "'lengths'"});
    // A page the lengths cover was freed (use after free).
    const int64_t page = f.page_table[1][2].template item<int64_t>();
    cache.free(page);
    expect_rejected(cache, inputs, [&] { paged_attention(view, 1, q); }, {fn, "use after free"});
    // An unsupported cache dtype.
    PagedCache<L> doubles(1, 2, 4, 2, 8, opts(at::kDouble));
    const auto pages = doubles.alloc_n(1);
    const auto dview = doubles.bind(table({{pages[0]}}).to(opts().device()), ints({1}).to(opts().device()));
    expect_rejected(doubles, {}, [&] { paged_attention(dview, 0, at::randn({1, 1, 2, 8}, opts(at::kDouble))); },
                    {fn, "float32, float16 or bfloat16", "got Double"});
  });
}

// ---- AttentionOptions: window, soft-cap, sinks, tree masks ----

/// softmax over AttentionOptions' rules in float64: scale, soft-cap,
/// causal within the window (the new tokens as the tree mask says), the
/// sinks as one more softmax column; a query that sees nothing gives 0.
/// q: [B, Sq, Hq, D]; k, v: [B, T, H, D] (gathered, T >= every length).
at::Tensor reference_options(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<int64_t>& lengths, const pagedkv::AttentionOptions& o) {
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2), D = q.size(3);
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<at::Tensor> outs;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = lengths[static_cast<size_t>(b)];
    const at::Tensor kb = k[b].narrow(0, 0, length).cpu().to(at::kDouble);  // [L, H, D]
    const at::Tensor vb = v[b].narrow(0, 0, length).cpu().to(at::kDouble);
    const int64_t group = n_heads / kb.size(1);
    const at::Tensor qb = q[b].cpu().to(at::kDouble).permute({1, 0, 2});                // [Hq, Sq, D]
    const at::Tensor ke = kb.repeat_interleave(group, 1).permute({1, 2, 0});            // [Hq, D, L]
    const at::Tensor ve = vb.repeat_interleave(group, 1).permute({1, 0, 2});            // [Hq, L, D]
    at::Tensor scores = at::matmul(qb, ke) * scale;                                     // [Hq, Sq, L]
    if (o.softcap > 0) scores = at::tanh(scores / o.softcap) * o.softcap;
    const int64_t first_new = length - n_queries;
    const at::Tensor pos = at::arange(length, at::kLong).view({1, length});
    const at::Tensor qpos = at::arange(n_queries, at::kLong).view({n_queries, 1}) + first_new;
    at::Tensor seen;  // [Sq, L]
    if (o.tree_mask.defined()) {
      const at::Tensor index = (pos - first_new).clamp(0, n_queries - 1).expand({n_queries, length});
      const at::Tensor mask = o.tree_mask[b].cpu().gather(1, index);
      seen = pos.lt(first_new).logical_or(pos.ge(first_new).logical_and(mask));
    } else {
      seen = pos.le(qpos);
    }
    if (o.window > 0) seen = seen.logical_and(pos.gt(qpos - o.window));
    const at::Tensor hidden = seen.logical_not().unsqueeze(0);
    scores.masked_fill_(hidden, -INFINITY);
    at::Tensor probs;
    if (o.sinks.defined()) {
      const at::Tensor sinks = o.sinks.cpu().to(at::kDouble).view({n_heads, 1, 1}).expand({n_heads, n_queries, 1});
      probs = at::softmax(at::cat({scores, sinks}, -1), -1).narrow(-1, 0, length);
    } else {
      probs = at::softmax(scores, -1);
    }
    probs = probs.masked_fill(hidden, 0.0);
    outs.push_back(at::matmul(probs, ve).permute({1, 0, 2}));  // [Sq, Hq, D]
  }
  return at::stack(outs);
}

/// The kernel paths attention runs on for this target: the portable loop
/// and every vector path (each decode step) on the cpu; the target alone
/// elsewhere.
std::vector<KernelPath> option_paths(const pagedkv_test::Target& target) {
  using pagedkv::cpu::attention::DecodeStep;
  if (target.device != at::kCPU || target.backend == pagedkv::Backend::generic) {
    return {KernelPath{pagedkv::simd::Isa::best, DecodeStep::best}};
  }
  std::vector<KernelPath> paths{KernelPath{pagedkv::simd::Isa::portable, DecodeStep::best}};
  for (const KernelPath& p : vector_kernel_paths()) paths.push_back(p);
  return paths;
}

/// A cache (one layer) holding random K/V of `lengths` tokens on shuffled
/// pages, and those K/V as its gather gives them (codes decoded): what the
/// reference reads.
template <class L>
struct OptionsCase {
  PagedCache<L> cache;
  std::vector<int64_t> lengths;
  at::Tensor page_table;  // [B, cols] int64
  at::Tensor length_t;    // [B] int64
  at::Tensor k, v;        // [B, max(lengths), H, D], the cache's dtype

  OptionsCase(std::vector<int64_t> lens, int64_t page_size, int64_t kv_heads, int64_t head_dim,
              at::TensorOptions options, pagedkv::KVQuant quant, uint64_t seed)
      : cache(1, Filled<L>::pages_needed(lens, page_size, 0) + 1, page_size, kv_heads, head_dim, options, quant),
        lengths(std::move(lens)) {
    const auto batch = static_cast<int64_t>(lengths.size());
    const int64_t cols = Filled<L>::max_cols(lengths, page_size);
    std::vector<int64_t> pages = cache.alloc_n(cache.n_pages() - 1);
    std::mt19937_64 rng(seed);
    std::shuffle(pages.begin(), pages.end(), rng);
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(batch), std::vector<int64_t>(cols, -1));
    size_t next = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t c = 0; c * page_size < lengths[static_cast<size_t>(b)]; ++c) {
        rows[static_cast<size_t>(b)][static_cast<size_t>(c)] = pages[next++];
      }
    }
    page_table = table(rows).to(options.device());
    length_t = ints(lengths).to(options.device());
    at::manual_seed(seed);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lengths[static_cast<size_t>(b)];
      cache.write(0, page_table.narrow(0, b, 1), 0, at::randn({1, len, kv_heads, head_dim}).to(options),
                  at::randn({1, len, kv_heads, head_dim}).to(options));
    }
    std::tie(k, v) = cache.gather(0, page_table, length_t);
  }

  at::Tensor attend(const at::Tensor& q, const pagedkv::AttentionOptions& o) {
    return paged_attention(cache.bind(page_table, length_t), 0, q, o);
  }
  at::Tensor expected(const at::Tensor& q, const pagedkv::AttentionOptions& o) const {
    return reference_options(q, k, v, lengths, o);
  }
};

pagedkv::AttentionOptions with_window(int64_t window) {
  pagedkv::AttentionOptions o;
  o.window = window;
  return o;
}

// The window's edge inside a page and on a page boundary, window 1, a
// window longer than the context, decode (the decode steps) and prefill
// chunks that cross the window, page sizes 1, 7, 16, on every kernel path.
TEST_P(AttentionTest, WindowMatchesReferenceAtEveryEdge) {
  uint64_t seed = 1200;
  for (const int64_t page_size : {1, 7, 16}) {
    for_each_layout([&](auto layout) {
      using L = decltype(layout);
      OptionsCase<L> c({9, 16, 23, 40}, page_size, 2, 32, opts(), {}, ++seed);
      for (const int64_t n_queries : {1, 9}) {
        const at::Tensor q = at::randn({4, n_queries, 4, 32}).to(opts());
        for (const int64_t window : {1, 7, 16, 17, 64}) {
          const at::Tensor expected = c.expected(q, with_window(window));
          for (const KernelPath& path : option_paths(GetParam())) {
            const ScopedKernelPath scoped(path);
            EXPECT_LT(rel_error(c.attend(q, with_window(window)), expected), 1e-5)
                << L::name << " P=" << page_size << " Sq=" << n_queries << " window=" << window << " " << path.name();
          }
        }
      }
    });
  }
}

// Long contexts split across threads: each split's partial result and
// their merge see only the window (and a split wholly before it none).
TEST_P(AttentionTest, WindowOverSplitContexts) {
  const int previous = at::get_num_threads();
  at::set_num_threads(4);
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    OptionsCase<L> c({1500, 700}, 16, 2, 32, opts(), {}, 1300);
    const at::Tensor q = at::randn({2, 3, 8, 32}).to(opts());
    for (const int64_t window : {100, 600, 5000}) {
      for (const KernelPath& path : option_paths(GetParam())) {
        const ScopedKernelPath scoped(path);
        EXPECT_LT(rel_error(c.attend(q, with_window(window)), c.expected(q, with_window(window))), 1e-5)
            << L::name << " window=" << window << " " << path.name();
      }
    }
  });
  at::set_num_threads(previous);
}

// A windowed SequenceTable's rows: pages wholly older than every query's
// window are -1 (and freed); attention with the window reads around them,
// through a bound view too. A -1 a query can see, or the same table without
// the window, throws and changes nothing.
TEST_P(AttentionTest, WindowReadsAroundUnmappedLeadingColumns) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const std::string fn = std::string("pagedkv::paged_attention<") + L::name + ">";
    OptionsCase<L> c({30, 13}, 4, 2, 32, opts(), {}, 1400);
    const at::Tensor q = at::randn({2, 2, 4, 32}).to(opts());
    const at::Tensor q_decode = at::randn({2, 1, 4, 32}).to(opts());
    const pagedkv::AttentionOptions o = with_window(6);
    const at::Tensor expected = c.expected(q, o);
    const at::Tensor expected_decode = c.expected(q_decode, o);
    // Earliest windows start at 28 - 6 + 1 = 23 (column 5) and 11 - 6 + 1 = 6
    // (column 1); a window of 10 starts at 19 (column 4, unmapped).
    at::Tensor windowed = c.page_table.cpu().clone();
    for (int64_t col = 0; col < 5; ++col) {
      c.cache.free(windowed[0][col].template item<int64_t>());
      windowed[0][col] = -1;
    }
    c.cache.free(windowed[1][0].template item<int64_t>());
    windowed[1][0] = -1;
    windowed = windowed.to(device());
    for (const KernelPath& path : option_paths(GetParam())) {
      const ScopedKernelPath scoped(path);
      EXPECT_LT(rel_error(paged_attention(c.cache.bind(windowed, c.length_t), 0, q, o), expected), 1e-5)
          << L::name << " " << path.name();
      EXPECT_LT(rel_error(paged_attention(c.cache.bind(windowed, c.length_t), 0, q_decode, o), expected_decode), 1e-5)
          << L::name << " decode, " << path.name();
    }
    const std::vector<at::Tensor> inputs = {q, windowed, c.length_t};
    expect_rejected(c.cache, inputs, [&] { paged_attention(c.cache.bind(windowed, c.length_t), 0, q, with_window(10)); },
                    {fn, "'page_table'", "page_table[0][4]", "got -1"});
    expect_rejected(c.cache, inputs, [&] { paged_attention(c.cache.bind(windowed, c.length_t), 0, q); },
                    {fn, "-1"});
  });
}

// Soft-capped logits in the hundreds (the cap bites), decode and prefill,
// every page dtype on every path (the decode step caps in vectors).
TEST_P(AttentionTest, SoftcapWithLargeLogitsMatchesReference) {
  uint64_t seed = 1500;
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for_each_layout([&](auto layout) {
      using L = decltype(layout);
      OptionsCase<L> c({5, 33, 70}, 16, 2, 32, opts(dtype), {}, ++seed);
      for (const int64_t n_queries : {1, 5}) {
        const at::Tensor q = (at::randn({3, n_queries, 8, 32}) * 30).to(opts(dtype));
        for (const double cap : {5.0, 50.0}) {
          pagedkv::AttentionOptions o;
          o.softcap = cap;
          const at::Tensor expected = c.expected(q, o);
          for (const KernelPath& path : option_paths(GetParam())) {
            const ScopedKernelPath scoped(path);
            EXPECT_LT(rel_error(c.attend(q, o), expected), tolerance(dtype))
                << L::name << " " << dtype << " Sq=" << n_queries << " cap=" << cap << " " << path.name();
          }
        }
      }
    });
  }
}

// Sinks that dominate the softmax (20 against logits ~1), that vanish
// (-20), and ordinary ones, per query head; over split contexts too.
TEST_P(AttentionTest, SinksMatchReference) {
  const int previous = at::get_num_threads();
  at::set_num_threads(4);
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    OptionsCase<L> c({3, 40, 1100}, 16, 2, 32, opts(), {}, 1600);
    pagedkv::AttentionOptions o;
    o.sinks = at::tensor({20.0f, -20.0f, 0.5f, 3.0f, 0.0f, 8.0f, -1.0f, 2.0f}).to(device());
    for (const int64_t n_queries : {1, 3}) {
      const at::Tensor q = at::randn({3, n_queries, 8, 32}).to(opts());
      const at::Tensor expected = c.expected(q, o);
      for (const KernelPath& path : option_paths(GetParam())) {
        const ScopedKernelPath scoped(path);
        EXPECT_LT(rel_error(c.attend(q, o), expected), 1e-5) << L::name << " Sq=" << n_queries << " " << path.name();
      }
    }
  });
  at::set_num_threads(previous);
}

/// [B, Sq, Sq] bool: query i sees new token j iff j is i or an ancestor of
/// i in a random tree (each node's parent one of the up to `width` nodes
/// before it, depth at most `depth`).
at::Tensor random_tree_mask(int64_t batch, int64_t n_queries, int64_t width, int64_t depth, std::mt19937_64& rng) {
  at::Tensor mask = at::zeros({batch, n_queries, n_queries}, at::kBool);
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int64_t> parent(static_cast<size_t>(n_queries), -1), level(static_cast<size_t>(n_queries), 0);
    for (int64_t i = 1; i < n_queries; ++i) {
      for (int tries = 0; tries < 16; ++tries) {
        const int64_t lo = std::max<int64_t>(0, i - width);
        const int64_t p = lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(i - lo));
        if (level[static_cast<size_t>(p)] + 1 < depth || tries == 15) {
          parent[static_cast<size_t>(i)] = level[static_cast<size_t>(p)] + 1 < depth ? p : parent[static_cast<size_t>(p)];
          break;
        }
      }
      level[static_cast<size_t>(i)] = parent[static_cast<size_t>(i)] < 0 ? 0 : level[static_cast<size_t>(parent[static_cast<size_t>(i)])] + 1;
    }
    for (int64_t i = 0; i < n_queries; ++i) {
      for (int64_t j = i; j >= 0; j = parent[static_cast<size_t>(j)]) mask[b][i][j] = true;
    }
  }
  return mask;
}

// Chains (the mask equals causal: the result of no mask), trees of depth 1
// to 5 and width up to 8, and masks that hide every new token (a query
// with no older token then returns zeros), on every path.
TEST_P(AttentionTest, TreeMasksMatchReference) {
  std::mt19937_64 rng(1700);
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    for (const int64_t n_queries : {1, 5, 9}) {
      // The first row has no older tokens: its whole context is the tree.
      OptionsCase<L> c({n_queries, 20 + n_queries, 50}, 7, 2, 32, opts(), {}, rng());
      const at::Tensor q = at::randn({3, n_queries, 4, 32}).to(opts());
      pagedkv::AttentionOptions chain;
      chain.tree_mask = at::ones({n_queries, n_queries}, at::kBool).tril().expand({3, n_queries, n_queries})
                            .contiguous().to(device());
      const at::Tensor plain = c.expected(q, pagedkv::AttentionOptions());
      for (const KernelPath& path : option_paths(GetParam())) {
        const ScopedKernelPath scoped(path);
        const at::Tensor with_chain = c.attend(q, chain);
        EXPECT_LT(rel_error(with_chain, plain), 1e-6) << L::name << " chain Sq=" << n_queries << " " << path.name();
        EXPECT_LT(rel_error(with_chain, c.attend(q, pagedkv::AttentionOptions()).cpu().to(at::kDouble)), 1e-6)
            << L::name << " chain against no mask, Sq=" << n_queries << " " << path.name();
        for (const int64_t depth : {1, 2, 5}) {
          pagedkv::AttentionOptions tree;
          tree.tree_mask = random_tree_mask(3, n_queries, 8, depth, rng).to(device());
          EXPECT_LT(rel_error(c.attend(q, tree), c.expected(q, tree)), 1e-5)
              << L::name << " tree depth " << depth << " Sq=" << n_queries << " " << path.name();
        }
        pagedkv::AttentionOptions none;
        none.tree_mask = at::zeros({3, n_queries, n_queries}, at::kBool).to(device());
        const at::Tensor hidden = c.attend(q, none);
        EXPECT_LT(rel_error(hidden, c.expected(q, none)), 1e-5) << L::name << " all hidden " << path.name();
        EXPECT_TRUE(at::equal(hidden[0].cpu(), at::zeros_like(hidden[0]).cpu()))
            << L::name << " a query that sees nothing returns zeros, " << path.name();
      }
    }
  });
}

// Every option at once, GQA 4, fp16, on native, fp8 and int8 pages
// (against the reference over the pages' decoded values).
TEST_P(AttentionTest, OptionsComposeOnEveryPageFormat) {
  using pagedkv::KVFormat;
  std::mt19937_64 rng(1800);
  for (const KVFormat format : {KVFormat::native, KVFormat::fp8_e4m3, KVFormat::int8}) {
    for_each_layout([&](auto layout) {
      using L = decltype(layout);
      OptionsCase<L> c({6, 29, 47}, 7, 2, 32, opts(at::kHalf), pagedkv::KVQuant{format, format}, rng());
      for (const int64_t n_queries : {1, 4}) {
        const at::Tensor q = (at::randn({3, n_queries, 8, 32}) * 4).to(opts(at::kHalf));
        pagedkv::AttentionOptions o;
        o.window = 9;
        o.softcap = 3.0;
        o.sinks = at::linspace(-2, 4, 8).to(device());
        const at::Tensor mask = random_tree_mask(3, n_queries, 8, 3, rng).to(device());
        o.tree_mask = mask;
        const at::Tensor expected = c.expected(q, o);
        pagedkv::AttentionOptions unmasked = o;  // the decode step's path too
        unmasked.tree_mask = at::Tensor();
        const at::Tensor expected_unmasked = c.expected(q, unmasked);
        for (const KernelPath& path : option_paths(GetParam())) {
          const ScopedKernelPath scoped(path);
          EXPECT_LT(rel_error(c.attend(q, o), expected), 2e-2)
              << L::name << " " << pagedkv::format_name(format) << " Sq=" << n_queries << " " << path.name();
          EXPECT_LT(rel_error(c.attend(q, unmasked), expected_unmasked), 2e-2)
              << L::name << " " << pagedkv::format_name(format) << " no mask, Sq=" << n_queries << " " << path.name();
        }
      }
    });
  }
}

TEST_P(AttentionTest, BadOptionsThrowAndChangeNothing) {
  for_each_layout([&](auto layout) {
    using L = decltype(layout);
    const std::string fn = std::string("pagedkv::paged_attention<") + L::name + ">";
    OptionsCase<L> c({5, 9}, 4, 2, 8, opts(), {}, 1900);
    const auto view = c.cache.bind(c.page_table, c.length_t);
    const at::Tensor q = at::randn({2, 2, 4, 8}).to(opts());
    const std::vector<at::Tensor> inputs = {q, c.page_table, c.length_t};
    const auto rejects = [&](const std::function<void(pagedkv::AttentionOptions&)>& set,
                             const std::vector<std::string>& phrases) {
      pagedkv::AttentionOptions o;
      set(o);
      expect_rejected(c.cache, inputs, [&] { paged_attention(view, 0, q, o); }, phrases);
    };
    rejects([](auto& o) { o.window = -1; }, {fn, "'options.window'", ">= 0", "got -1"});
    rejects([](auto& o) { o.softcap = -1.0; }, {fn, "'options.softcap'", "got -1"});
    rejects([](auto& o) { o.softcap = std::nan(""); }, {fn, "'options.softcap'", "finite"});
    rejects([](auto& o) { o.softcap = INFINITY; }, {fn, "'options.softcap'", "finite"});
    rejects([&](auto& o) { o.sinks = at::zeros({3}).to(device()); }, {fn, "'options.sinks'", "[4]", "got [3]"});
    rejects([&](auto& o) { o.sinks = at::zeros({4}, at::kDouble).to(device()); },
            {fn, "'options.sinks'", "float32", "Double"});
    rejects([&](auto& o) { o.tree_mask = at::ones({2, 2, 3}, at::kBool).to(device()); },
            {fn, "'options.tree_mask'", "[2, 2, 2]", "got [2, 2, 3]"});
    rejects([&](auto& o) { o.tree_mask = at::ones({2, 2, 2}, at::kByte).to(device()); },
            {fn, "'options.tree_mask'", "bool", "Byte"});
    rejects([&](auto& o) { o.scale = INFINITY; }, {fn, "'scale'", "finite"});
  });
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionTest, ::testing::ValuesIn(pagedkv_test::all_targets()),
                         pagedkv_test::target_name);

}  // namespace
