// The CUDA attention kernels (decode, prefill, merge) run under the CPU
// emulator (tests/cuda_emulator/) through the host planner the GPU path
// uses (cuda/attention.hpp), against the CPU kernel and a float64
// reference, within the tolerance of tests/test_attention.cpp: both
// layouts, float32 / float16 / bfloat16, fp8 and int8 pages (K and V alike,
// and mixed), page sizes 1 / 3 / 16, GQA groups 1 to 16 (head tiles with
// idle rows, several tiles), MQA, decode and chunked prefill, ragged
// lengths, contexts split across blocks and merged, int32 / int64 tables.
// This runs the kernels' text on the CPU: it says nothing about a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulator/kernels.hpp"
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

/// softmax(q k^T * scale + causal mask) v in float64, per sequence (as in
/// test_attention.cpp). q: [B, Sq, Hq, D]; k[b], v[b]: [lengths[b], H, D].
at::Tensor reference(const at::Tensor& q, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                     double scale) {
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
    const at::Tensor pos = at::arange(length, at::kLong).view({1, length});
    const at::Tensor last = at::arange(n_queries, at::kLong).view({n_queries, 1}) + (length - n_queries);
    scores.masked_fill_(pos.gt(last).unsqueeze(0), -INFINITY);
    outs.push_back(at::matmul(at::softmax(scores, -1), ve).permute({1, 0, 2}));
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

  std::string name() const {
    std::string l;
    for (const int64_t x : lengths) l += std::to_string(x) + ",";
    return std::string(c10::toString(dtype)) + " P=" + std::to_string(page_size) + " G=" + std::to_string(group) +
           " H=" + std::to_string(kv_heads) + " D=" + std::to_string(head_dim) + " Sq=" + std::to_string(n_queries) +
           " lengths=" + l + " K=" + pagedkv::format_name(quant.k) + " V=" + pagedkv::format_name(quant.v) + " " +
           c10::toString(index) + " SMs=" + std::to_string(sm_count);
  }
};

template <class L>
void check_attention(const Case& c) {
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
  const at::Tensor q = at::randn({B, c.n_queries, n_heads, c.head_dim}).to(c.dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));

  const auto view = cache.bind(page_table, lengths);
  const at::Tensor cpu = pagedkv::paged_attention(view, 0, q);
  pc::Side sides[2] = {{pc::pages_ref(cache.k_cache(), cache.k_scales(), 0, cache.geometry()), c.quant.k},
                       {pc::pages_ref(cache.v_cache(), cache.v_scales(), 0, cache.geometry()), c.quant.v}};
  emulator().set_sm_count(c.sm_count);
  emulator().launched.clear();
  pagedkv::AttentionOptions options;
  options.scale = scale;
  const at::Tensor out = pc::attention(emulator(), pc::table_ref(page_table), lengths.data_ptr<int64_t>(), q, sides,
                                       cache.geometry(), c.dtype, cache.n_pages(), options);
  ASSERT_EQ(out.sizes(), q.sizes());
  ASSERT_EQ(out.scalar_type(), c.dtype);
  const at::Tensor ref = reference(q, ks, vs, scale);
  EXPECT_LT(rel_error(out, ref), tolerance(c.dtype)) << "against float64";
  EXPECT_LT(rel_error(out, cpu.to(at::kDouble)), tolerance(c.dtype)) << "against the CPU kernel";
  std::string launched;
  for (const std::string& name : emulator().launched) launched += name + " ";
  SCOPED_TRACE("launched " + launched);
  const bool decode = c.n_queries == 1 && c.quant.k == c.quant.v;
  EXPECT_EQ(emulator().launched.front().rfind(decode ? "attention_decode<" : "attention_prefill", 0), 0u);
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

}  // namespace
