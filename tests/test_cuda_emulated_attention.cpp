// The CUDA attention kernels (decode, prefill, merge) run under the CPU
// emulator (tests/cuda_emulator/) through the host planner the GPU path
// uses (cuda/attention.hpp), against the CPU kernel and a float64
// reference, within the tolerance of tests/test_attention.cpp: both
// layouts, float32 / float16 / bfloat16, fp8 and int8 pages (K and V alike,
// and mixed), page sizes 1 / 3 / 16, GQA groups 1 to 16 (head tiles with
// idle rows, several tiles), MQA, decode and chunked prefill, ragged
// lengths, contexts split across blocks and merged, int32 / int64 tables;
// and each attention option (window, softcap, sinks, tree_mask), alone and
// composed, against a float64 reference on their edge cases.
// This runs the kernels' text on the CPU: it says nothing about a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulator/kernels.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/cuda/attention.hpp"
#include "test_support.hpp"

namespace {

using namespace pagedkv_test;
namespace pc = pagedkv::cuda;
using pagedkv::KVFormat;
using pagedkv::KVQuant;

/// The emulator with the kernels compiled in cuda_emulator/kernels.cpp
/// (the decode instantiations there are the ones cases() launch).
pkv_emu::EmulatedExecutor& emulator() {
  static pkv_emu::EmulatedExecutor ex = pkv_emu::kernels();
  return ex;
}

/// Whether query s of a sequence of `length` (Sq new tokens) sees the key at
/// position t under `o`, spelled out from AttentionOptions' words rather
/// than from the kernel's code.
bool reference_sees(const pagedkv::AttentionOptions& o, int64_t b, int64_t length, int64_t n_queries, int64_t s,
                    int64_t t) {
  const int64_t position = length - n_queries + s, new_start = length - n_queries;
  if (o.window > 0 && t < position - o.window + 1) return false;
  if (t < new_start) return true;
  if (o.tree_mask.defined()) return o.tree_mask[b][s][t - new_start].item<bool>();
  return t <= position;
}

/// softmax(cap(q k^T * scale) + mask, sinks) v in float64, per sequence
/// (as in test_attention.cpp, with the options). q: [B, Sq, Hq, D]; k[b],
/// v[b]: [lengths[b], H, D]. A query that sees no key gives zeros.
at::Tensor reference(const at::Tensor& q, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                     double scale, const pagedkv::AttentionOptions& o = {}) {
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2);
  std::vector<at::Tensor> outs;
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor kb = k[static_cast<size_t>(b)].to(at::kDouble);
    const at::Tensor vb = v[static_cast<size_t>(b)].to(at::kDouble);
    const int64_t length = kb.size(0), group = n_heads / kb.size(1);
    const at::Tensor qb = q[b].to(at::kDouble).permute({1, 0, 2});
    const at::Tensor ke = kb.repeat_interleave(group, 1).permute({1, 2, 0});
    const at::Tensor ve = vb.repeat_interleave(group, 1).permute({1, 0, 2});
    at::Tensor scores = at::matmul(qb, ke) * scale;
    if (o.softcap > 0.0) scores = at::tanh(scores / o.softcap) * o.softcap;
    at::Tensor visible = at::zeros({n_queries, length}, at::kBool);
    auto vis = visible.accessor<bool, 2>();
    for (int64_t s = 0; s < n_queries; ++s) {
      for (int64_t t = 0; t < length; ++t) vis[s][t] = reference_sees(o, b, length, n_queries, s, t);
    }
    scores.masked_fill_(visible.logical_not().unsqueeze(0), -INFINITY);
    at::Tensor probs;
    if (o.sinks.defined()) {
      const at::Tensor sink = o.sinks.to(at::kDouble).view({n_heads, 1, 1}).expand({n_heads, n_queries, 1});
      probs = at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, length);
    } else {
      probs = at::softmax(scores, -1);
    }
    probs = at::where(visible.any(-1, true).unsqueeze(0), probs, at::zeros_like(probs));  // no key: not NaN
    outs.push_back(at::matmul(probs, ve).permute({1, 0, 2}));
  }
  return at::stack(outs);
}

double rel_error(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = out.to(at::kDouble);
  return (o - ref).abs().max().item<double>() / std::max(1e-12, ref.abs().max().item<double>());
}

/// test_attention.cpp's tolerance against float64.
double tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 1e-5 : 2e-2; }

struct Case {
  at::ScalarType dtype;
  int64_t page_size;
  int64_t group;       ///< query heads per kv head
  int64_t kv_heads;
  int64_t head_dim;
  int64_t n_queries;   ///< Sq
  std::vector<int64_t> lengths;
  KVQuant quant;
  at::ScalarType index;
  int sm_count;        ///< what the emulated device reports: more SMs, more splits
  // The options beyond the scale (the table then maps no page wholly
  // before the earliest query's window: -1 there, as a windowed table's).
  int64_t window = 0;
  double softcap = 0.0;
  std::vector<float> sinks{};  ///< empty: none; else one per query head
  at::Tensor tree_mask{};      ///< [B, Sq, Sq] bool, or undefined
  double q_gain = 1.0;       ///< q's scale: large logits for the soft-cap
  /// Native pages: the columns older than the window map a page of NaN
  /// keys and values rather than -1, which poisons the output if read.
  bool poison = false;
  /// Option cases run in one layout (NHD and HND alternating: the options
  /// never touch the pages' strides, which the cases above cover), or both.
  bool both_layouts = false;

  std::string name() const {
    std::string l;
    for (const int64_t x : lengths) l += std::to_string(x) + ",";
    return std::string(c10::toString(dtype)) + " P=" + std::to_string(page_size) + " G=" + std::to_string(group) +
           " H=" + std::to_string(kv_heads) + " D=" + std::to_string(head_dim) + " Sq=" + std::to_string(n_queries) +
           " lengths=" + l + " K=" + pagedkv::format_name(quant.k) + " V=" + pagedkv::format_name(quant.v) + " " +
           c10::toString(index) + " SMs=" + std::to_string(sm_count) + " window=" + std::to_string(window) +
           " softcap=" + std::to_string(softcap) + " sinks=" + std::to_string(sinks.size()) +
           " tree_mask=" + (tree_mask.defined() ? "yes" : "no") + " q_gain=" + std::to_string(q_gain);
  }
};

/// Runs case `c` through the emulated kernels and checks it; returns the output.
template <class L>
at::Tensor check_attention(const Case& c) {
  SCOPED_TRACE(std::string(L::name) + " " + c.name());
  const int64_t P = c.page_size, B = static_cast<int64_t>(c.lengths.size());
  int64_t cols = 0, n_pages = 2;
  for (const int64_t len : c.lengths) {
    cols = std::max(cols, (len + P - 1) / P + 1);  // one spare column
    n_pages += (len + P - 1) / P + 1;
  }
  PagedCache<L> cache(1, n_pages, P, c.kv_heads, c.head_dim, at::TensorOptions().dtype(c.dtype), c.quant);
  std::vector<int64_t> pages = cache.alloc_n(n_pages - 1);
  std::mt19937 rng(static_cast<uint32_t>(P * 131 + c.head_dim * 7 + c.group));
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(B), std::vector<int64_t>(static_cast<size_t>(cols), -1));
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (c.lengths[static_cast<size_t>(b)] + P - 1) / P + 1;
    for (int64_t j = 0; j < used; ++j) rows[static_cast<size_t>(b)][static_cast<size_t>(j)] = pages[next++];
  }
  const at::Tensor page_table = table(rows, c.index);
  const at::Tensor lengths = ints(c.lengths);
  // What attention reads: no page wholly older than every query's window.
  const int64_t spare = pages[next];
  if (c.poison) {
    const at::Tensor nan = at::full({1, P, c.kv_heads, c.head_dim}, NAN).to(c.dtype);
    cache.write(0, table({{spare}}, c.index), 0, nan, nan);
  }
  std::vector<std::vector<int64_t>> read_rows = rows;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = pagedkv::checks::first_visible(c.lengths[static_cast<size_t>(b)], c.n_queries, c.window);
    for (int64_t j = 0; j < first / P; ++j) {
      read_rows[static_cast<size_t>(b)][static_cast<size_t>(j)] = c.poison ? spare : -1;
    }
  }
  const at::Tensor read_table = table(read_rows, c.index);
  at::manual_seed(static_cast<uint64_t>(c.head_dim * 1000 + P));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = c.lengths[static_cast<size_t>(b)];
    const at::Tensor k = (at::randn({1, len, c.kv_heads, c.head_dim}) * 2).to(c.dtype);
    const at::Tensor v = at::randn({1, len, c.kv_heads, c.head_dim}).to(c.dtype);
    cache.write(0, page_table.slice(0, b, b + 1), 0, k, v);
  }
  // The keys and values as the cache holds them (dequantized), for the reference.
  const auto kv = cache.gather(0, page_table, lengths);
  std::vector<at::Tensor> ks, vs;
  for (int64_t b = 0; b < B; ++b) {
    ks.push_back(kv.first[b].narrow(0, 0, c.lengths[static_cast<size_t>(b)]));
    vs.push_back(kv.second[b].narrow(0, 0, c.lengths[static_cast<size_t>(b)]));
  }
  const int64_t n_heads = c.group * c.kv_heads;
  const at::Tensor q = (at::randn({B, c.n_queries, n_heads, c.head_dim}) * c.q_gain).to(c.dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  pagedkv::AttentionOptions options;
  options.scale = scale;
  options.window = c.window;
  options.softcap = c.softcap;
  if (!c.sinks.empty()) {
    EXPECT_EQ(static_cast<int64_t>(c.sinks.size()), n_heads);
    // Strided (every other float of a [n_heads, 2]): the kernels take the stride.
    options.sinks = at::stack({at::tensor(c.sinks), at::zeros({n_heads})}, 1).select(1, 0);
  }
  options.tree_mask = c.tree_mask;

  // The CPU kernel as a second witness (over the fully mapped table).
  const at::Tensor cpu = pagedkv::paged_attention(cache.bind(page_table, lengths), 0, q, options);
  pc::Side sides[2] = {{pc::pages_ref(cache.k_cache(), cache.k_scales(), 0, cache.geometry()), c.quant.k},
                       {pc::pages_ref(cache.v_cache(), cache.v_scales(), 0, cache.geometry()), c.quant.v}};
  emulator().set_sm_count(c.sm_count);
  emulator().launched.clear();
  const at::Tensor out = pc::attention(emulator(), pc::table_ref(read_table), lengths.data_ptr<int64_t>(), q, sides,
                                       cache.geometry(), c.dtype, cache.n_pages(), options);
  EXPECT_EQ(out.sizes(), q.sizes());
  EXPECT_EQ(out.scalar_type(), c.dtype);
  const at::Tensor ref = reference(q, ks, vs, scale, options);
  EXPECT_LT(rel_error(out, ref), tolerance(c.dtype)) << "against float64";
  EXPECT_LT(rel_error(out, cpu.to(at::kDouble)), tolerance(c.dtype)) << "against the CPU kernel";
  // Rows the reference gives as zeros (no key seen) are exactly zeros.
  EXPECT_TRUE(at::equal(out.to(at::kDouble).masked_fill(ref.ne(0), 0), at::zeros_like(ref))) << "zero rows";
  std::string launched;
  for (const std::string& name : emulator().launched) launched += name + " ";
  SCOPED_TRACE("launched " + launched);
  const bool decode = c.n_queries == 1 && c.quant.k == c.quant.v;
  EXPECT_EQ(emulator().launched.front().rfind(decode ? "attention_decode<" : "attention_prefill", 0), 0u);
  return out;
}

std::vector<Case> cases() {
  const KVQuant native{}, fp8{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, int8{KVFormat::int8, KVFormat::int8},
      mixed{KVFormat::fp8_e4m3, KVFormat::int8};
  const auto ragged = [](int64_t n_queries) { return std::vector<int64_t>{n_queries + 36, n_queries, 70}; };
  // dtype, page size, group, kv heads, head_dim, Sq, lengths, formats, index type, SMs
  std::vector<Case> out = {
      // decode: every dtype, format, head tile (1, 2, 4 with an idle row, 8 with idle rows, 2 x 8)
      {at::kFloat, 1, 1, 2, 16, 1, ragged(1), native, at::kLong, 4},
      {at::kHalf, 3, 2, 2, 16, 1, ragged(1), fp8, at::kInt, 4},
      {at::kBFloat16, 16, 3, 2, 16, 1, ragged(1), int8, at::kLong, 4},
      {at::kHalf, 16, 6, 1, 16, 1, ragged(1), native, at::kInt, 4},
      {at::kFloat, 3, 16, 1, 16, 1, ragged(1), fp8, at::kLong, 4},
      {at::kBFloat16, 1, 4, 2, 16, 1, ragged(1), native, at::kInt, 4},
      {at::kFloat, 16, 4, 2, 3, 1, ragged(1), native, at::kInt, 4},
      {at::kHalf, 3, 2, 2, 3, 1, ragged(1), fp8, at::kLong, 4},
      {at::kBFloat16, 16, 8, 1, 64, 1, ragged(1), int8, at::kInt, 4},
      {at::kHalf, 16, 4, 2, 64, 1, ragged(1), native, at::kLong, 4},
      {at::kFloat, 1, 1, 2, 64, 1, ragged(1), int8, at::kInt, 4},
      // decode with K and V of different formats: the prefill kernel
      {at::kHalf, 3, 4, 2, 16, 1, ragged(1), mixed, at::kLong, 4},
      // chunked prefill
      {at::kFloat, 1, 1, 2, 16, 3, ragged(3), native, at::kInt, 4},
      {at::kHalf, 3, 4, 2, 3, 7, ragged(7), fp8, at::kLong, 4},
      {at::kBFloat16, 16, 16, 1, 64, 7, ragged(7), int8, at::kInt, 4},
      {at::kHalf, 16, 6, 2, 16, 3, ragged(3), mixed, at::kLong, 4},
      // contexts split across blocks (and a short one in the same batch), merged
      {at::kHalf, 16, 4, 2, 16, 1, {1100, 5, 700}, native, at::kInt, 64},
      {at::kHalf, 16, 4, 2, 16, 1, {1100, 5, 700}, fp8, at::kInt, 64},
      {at::kHalf, 16, 4, 2, 16, 1, {1100, 5, 700}, int8, at::kInt, 64},
      {at::kHalf, 16, 4, 2, 16, 1, {1100, 5, 700}, mixed, at::kInt, 64},
      {at::kFloat, 3, 2, 1, 16, 1, {900, 513}, int8, at::kLong, 64},
      {at::kFloat, 3, 2, 1, 16, 1, {900, 513}, fp8, at::kInt, 64},
      {at::kBFloat16, 16, 2, 2, 16, 5, {800, 9}, native, at::kLong, 64},
      {at::kFloat, 16, 1, 2, 64, 1, {600, 1}, int8, at::kLong, 64},
  };
  return out;
}

TEST(CudaAttentionEmulated, MatchesTheCpuKernelAndAFloat64Reference) {
  for (const Case& c : cases()) {
    check_attention<NHD>(c);
    check_attention<HND>(c);
  }
}

/// Splits come from the page table's capacity, never the lengths: the same
/// shapes launch the same grid whatever the lengths (a CUDA graph replays).
TEST(CudaAttentionEmulated, GridsComeFromShapesNotLengths) {
  Case c{at::kHalf, 16, 4, 2, 16, 1, {1100, 5, 700}, {}, at::kInt, 64};
  std::vector<std::string> first;
  for (const std::vector<int64_t>& lengths : {std::vector<int64_t>{1100, 5, 700}, std::vector<int64_t>{12, 1100, 3}}) {
    c.lengths = lengths;
    check_attention<NHD>(c);
    if (first.empty()) {
      first = emulator().launched;
      EXPECT_EQ(first.size(), 2u) << "decode and merge";
    } else {
      EXPECT_EQ(emulator().launched, first);
    }
  }
}

/// A [B, Sq, Sq] tree mask from one row of `sees` lists per sequence:
/// masks[b][i] lists the new tokens query i sees.
at::Tensor mask_of(const std::vector<std::vector<std::vector<int64_t>>>& masks) {
  const int64_t B = static_cast<int64_t>(masks.size()), n = static_cast<int64_t>(masks[0].size());
  at::Tensor m = at::zeros({B, n, n}, at::kBool);
  auto a = m.accessor<bool, 3>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      for (const int64_t j : masks[static_cast<size_t>(b)][static_cast<size_t>(i)]) a[b][i][j] = true;
    }
  }
  return m;
}

/// The causal mask of Sq new tokens, for `batch` sequences: what no mask means.
at::Tensor chain_mask(int64_t batch, int64_t n) {
  return at::ones({n, n}, at::kBool).tril().unsqueeze(0).expand({batch, n, n}).contiguous();
}

/// A token tree of depth 3 and width 2 (a root, its 2 children, their 4
/// children), each node seeing its ancestors and itself.
std::vector<std::vector<int64_t>> tree_depth3() {
  return {{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 2, 6}};
}

/// Not a tree: query 0 sees a later token (the mask replaces causality),
/// query 2 sees no new token (and, with no older ones, nothing), query 5
/// skips itself.
std::vector<std::vector<int64_t>> odd_mask() {
  return {{0, 4}, {1}, {}, {0, 3}, {2, 4, 6}, {0, 1, 2}, {6}};
}

std::vector<Case> option_cases() {
  const KVQuant native{}, fp8{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, int8{KVFormat::int8, KVFormat::int8},
      mixed{KVFormat::fp8_e4m3, KVFormat::int8};
  const auto poisoned = [](Case c) {
    c.poison = true;
    return c;
  };
  const auto both = [](Case c) {
    c.both_layouts = true;
    return c;
  };
  const auto with = [](Case c, int64_t window, double softcap, std::vector<float> sinks, at::Tensor mask) {
    c.window = window;
    c.softcap = softcap;
    c.sinks = std::move(sinks);
    c.tree_mask = std::move(mask);
    return c;
  };
  // A strided mask (stored transposed): the kernels take its strides.
  const at::Tensor odd = mask_of({tree_depth3(), odd_mask()}).transpose(1, 2).contiguous().transpose(1, 2);
  const std::vector<std::vector<int64_t>> hidden(1), itself{std::vector<int64_t>{0}};  // one query's rows
  Case big_logits{at::kFloat, 16, 1, 2, 16, 1, {40, 3}, native, at::kLong, 4};
  big_logits.q_gain = 100.0;  // logits ~ +-200
  Case big_prefill{at::kFloat, 7, 2, 1, 16, 3, {19, 3}, native, at::kInt, 4};
  big_prefill.q_gain = 100.0;
  // dtype, page size, group, kv heads, head_dim, Sq, lengths, formats, index type, SMs; then the options
  return {
      // windows: the edge inside a page (22), on a page boundary (14), longer than the context (5); decode
      both(poisoned(with({at::kHalf, 7, 4, 2, 16, 1, {30, 5, 22}, native, at::kInt, 4}, 8, 0, {}, {}))),
      // window 1 (only the query's own key), pages of 1 token
      with({at::kFloat, 1, 1, 2, 16, 1, {9, 1, 4}, native, at::kLong, 4}, 1, 0, {}, {}),
      // prefill chunks that cross the window (and a window longer than a short row), fp8 pages
      with({at::kHalf, 16, 2, 1, 16, 7, {40, 7, 21}, fp8, at::kLong, 4}, 5, 0, {}, {}),
      with({at::kFloat, 1, 2, 1, 16, 5, {12, 5}, int8, at::kInt, 4}, 3, 0, {}, {}),
      // windows split across blocks and merged (decode and prefill), with the other options
      // (2 splits of a window of 260, or of 258 + 4 new tokens)
      with({at::kHalf, 16, 4, 1, 16, 1, {600, 5}, int8, at::kInt, 64}, 260, 20.0, {9, -1, 0.5f, 3}, {}),
      poisoned(with({at::kBFloat16, 16, 2, 1, 16, 5, {400, 9}, native, at::kLong, 64}, 258, 10.0, {2, -3}, {})),
      // soft-cap of logits ~ +-200: decode and prefill
      with(big_logits, 0, 30.0, {}, {}),
      with(big_prefill, 0, 25.0, {}, {}),
      // sinks that dominate the softmax (and one far below it)
      with({at::kFloat, 7, 2, 1, 16, 4, {12, 4}, native, at::kInt, 4}, 0, 0, {20, -40}, {}),
      with({at::kFloat, 7, 2, 2, 16, 1, {12, 1, 30}, fp8, at::kLong, 4}, 0, 0, {60, 0.25f, -2, 15}, {}),
      // tree masks: depth 3 x width 2 over older tokens; a mask that is not a tree, hiding every
      // key of a query with no older token (the second row's length is Sq); pages of 16, 7, 1
      with({at::kHalf, 16, 2, 1, 16, 7, {25, 7}, native, at::kLong, 4}, 0, 0, {}, odd),
      with({at::kHalf, 7, 2, 1, 16, 7, {25, 7}, fp8, at::kInt, 4}, 0, 0, {1, -1}, odd),
      // everything at once: window, soft-cap, sinks, tree mask, GQA, quantized pages
      both(with({at::kFloat, 1, 2, 2, 16, 7, {25, 7}, int8, at::kLong, 4}, 4, 5.0, {1, -2, 0.5f, 4}, odd)),
      both(with({at::kBFloat16, 7, 2, 1, 16, 7, {40, 9}, mixed, at::kInt, 64}, 6, 8.0, {0, 3},
                mask_of({tree_depth3(), tree_depth3()}))),
      // decode under a tree mask: the query hides itself (nothing left in the first row)
      with({at::kFloat, 16, 2, 1, 16, 1, {1, 9, 5}, int8, at::kLong, 4}, 0, 0, {}, mask_of({hidden, hidden, itself})),
      with({at::kHalf, 7, 4, 1, 16, 1, {1, 9}, native, at::kInt, 4}, 3, 4.0, {0, 1, 2, 3}, mask_of({hidden, hidden})),
  };
}

TEST(CudaAttentionEmulated, HonoursWindowSoftcapSinksAndTreeMasks) {
  const std::vector<Case> cases = option_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    if (c.both_layouts || i % 2 == 0) check_attention<NHD>(c);
    if (c.both_layouts || i % 2 == 1) check_attention<HND>(c);
    if (c.window >= 256) {
      EXPECT_EQ(emulator().launched.size(), 2u) << "split and merged: " << c.name();
    }
  }
}

/// A tree mask that equals causality gives the unmasked result bit for bit
/// (decode and prefill, with and without a window).
TEST(CudaAttentionEmulated, AChainMaskIsCausality) {
  for (Case c : {Case{at::kHalf, 7, 2, 2, 16, 6, {20, 6}, KVQuant{}, at::kInt, 4},
                 Case{at::kFloat, 16, 4, 1, 16, 3, {40, 3}, KVQuant{}, at::kLong, 4},
                 Case{at::kFloat, 16, 1, 2, 16, 1, {30, 1}, KVQuant{}, at::kInt, 4}}) {
    c.window = c.n_queries == 3 ? 5 : 0;
    const at::Tensor plain = check_attention<NHD>(c);
    c.tree_mask = chain_mask(static_cast<int64_t>(c.lengths.size()), c.n_queries);
    EXPECT_TRUE(at::equal(check_attention<NHD>(c), plain)) << c.name();
  }
}

}  // namespace
