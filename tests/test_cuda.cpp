// pagedkv's CUDA kernels on a GPU (every test skips with "no CUDA device"
// where none is visible, and in a build against a libtorch without CUDA):
// results equal to the CPU kernels' bit for bit (write, gather, page
// copies, codes and scales), attention within the CPU kernel's tolerance
// of it and of a float64 reference, the attention options against float64,
// a decode step under torch's sync debug mode set to error, a decode step
// captured once in a CUDA graph and replayed for later steps with other
// lengths and pages, stale views, and what may not happen inside a capture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

#if PAGEDKV_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <torch/cuda.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using namespace pagedkv_test;
using pagedkv::BindBuffers;
using pagedkv::KVFormat;
using pagedkv::KVQuant;

#define PAGEDKV_NEED_GPU()                                  \
  do {                                                      \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";   \
  } while (0)

#if !PAGEDKV_WITH_CUDA

TEST(CudaOnGpu, cuda_NotBuilt) {
  GTEST_SKIP() << "no CUDA device: this libtorch has no CUDA (PAGEDKV_WITH_CUDA is 0)";
}

#else

const at::Device kCuda(at::kCUDA, 0);

/// Not a check: prints what the kernels are built with on this machine
/// (NVRTC, the driver, the architecture), for the run's log.
TEST(CudaOnGpu, cuda_ReportsTheToolchain) {
  PAGEDKV_NEED_GPU();
  const pagedkv::cuda::Nvrtc& nv = pagedkv::cuda::nvrtc();
  const pagedkv::cuda::Driver& d = pagedkv::cuda::driver();
  auto& ex = pagedkv::cuda::DeviceExecutor::of(0);
  std::printf("NVRTC %d.%d (%s); driver CUDA %d.%d (%s); kernels for %s_%d; %d SMs, %d bytes of shared memory a block\n",
              nv.major, nv.minor, nv.path.c_str(), d.version / 1000, d.version % 1000 / 10, d.path.c_str(),
              ex.ptx() ? "compute" : "sm", ex.arch(), ex.sm_count(), ex.max_shared_bytes());
}

/// Random K or V [B, S, H, D] of dtype on the cpu; with `specials`, NaN,
/// infinities, zeros, tiny and huge values at a few places, and one
/// all-zero head vector (scale 0).
at::Tensor kv_values(at::IntArrayRef shape, at::ScalarType dtype, uint64_t seed, bool specials) {
  at::manual_seed(seed);
  at::Tensor x = (at::randn(shape) * 3).to(dtype);
  if (!specials) return x;
  const float values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), -0.0f, 1e-7f, -3e-6f, 60000.0f};
  int i = 0;
  for (const float v : values) {
    x[i % x.size(0)][(i * 2) % x.size(1)][i % x.size(2)][(i * 3) % x.size(3)] = v;
    ++i;
  }
  x[0][x.size(1) - 1][x.size(2) - 1].zero_();
  return x;
}

template <class L>
void expect_same_storage(const PagedCache<L>& cuda, const PagedCache<L>& cpu, const std::string& what) {
  EXPECT_TRUE(bitwise_equal(cuda.k_cache(), cpu.k_cache())) << what << ": k_cache";
  EXPECT_TRUE(bitwise_equal(cuda.v_cache(), cpu.v_cache())) << what << ": v_cache";
  if (cpu.k_scales().defined()) {
    EXPECT_TRUE(bitwise_equal(cuda.k_scales(), cpu.k_scales())) << what << ": k_scales";
  }
  if (cpu.v_scales().defined()) {
    EXPECT_TRUE(bitwise_equal(cuda.v_scales(), cpu.v_scales())) << what << ": v_scales";
  }
}

/// write, gather and page copies on a CUDA cache equal the CPU kernels'
/// bit for bit: both layouts, three dtypes, native / fp8 / int8 / mixed
/// sides (with NaN and infinities), page sizes 1 and 16, int32 and int64
/// tables, a fused-QKV source, per-row starts.
template <class L>
void check_bit_equality(at::ScalarType dtype, KVQuant quant, int64_t page_size, at::ScalarType index) {
  SCOPED_TRACE(std::string(L::name) + " " + c10::toString(dtype) + " K=" + pagedkv::format_name(quant.k) +
               " V=" + pagedkv::format_name(quant.v) + " P=" + std::to_string(page_size));
  const int64_t layers = 2, heads = 4, head_dim = 64, batch = 3, tokens = 9, cols = 24 / page_size + 2;
  const int64_t n_pages = batch * cols + 4;
  const auto options = at::TensorOptions().dtype(dtype);
  PagedCache<L> cpu(layers, n_pages, page_size, heads, head_dim, options, quant);
  PagedCache<L> gpu(layers, n_pages, page_size, heads, head_dim, options.device(kCuda), quant);
  std::vector<int64_t> pages = cpu.alloc_n(batch * cols);
  ASSERT_EQ(gpu.alloc_n(batch * cols), pages);
  std::mt19937 rng(static_cast<uint32_t>(page_size));
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<std::vector<int64_t>> rows(batch);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < cols; ++j) rows[static_cast<size_t>(b)].push_back(pages[static_cast<size_t>(b * cols + j)]);
  const at::Tensor page_table = table(rows, index);
  const at::Tensor starts = ints({0, page_size + 1, 13});
  const at::Tensor qkv = kv_values({batch, tokens, 3 * heads, head_dim}, dtype, 1, is_quantized(quant));
  const at::Tensor k = qkv.narrow(2, heads, heads), v = qkv.narrow(2, 2 * heads, heads);
  for (int64_t layer = 0; layer < layers; ++layer) {
    cpu.write(layer, page_table, starts, k, v);
    gpu.write(layer, page_table.to(kCuda), starts, k.to(kCuda), v.to(kCuda));  // table and k, v on the device
  }
  expect_same_storage(gpu, cpu, "write");
  const at::Tensor lengths = ints({9, page_size + 10, 22});
  const auto expected = cpu.gather(1, page_table, lengths);
  const auto got = gpu.bind(page_table, lengths).gather(1);
  EXPECT_TRUE(bitwise_equal(got.first, expected.first)) << "gather k";
  EXPECT_TRUE(bitwise_equal(got.second, expected.second)) << "gather v";
  // copies: within the device cache, host -> device and device -> host, across layouts
  const at::Tensor src = ints({rows[0][0], rows[1][1], rows[2][2]}), dst = ints({rows[0][5], rows[1][6], rows[2][7]});
  cpu.copy_pages(src, dst);
  gpu.copy_pages(src, dst);
  expect_same_storage(gpu, cpu, "copy_pages");
  using Other = typename std::conditional<std::is_same<L, NHD>::value, HND, NHD>::type;
  PagedCache<Other> host(layers, n_pages, page_size, heads, head_dim, options, quant);
  const std::vector<int64_t> host_pages = host.alloc_n(3);
  host.copy_pages_from(gpu, src, ints(host_pages));
  PagedCache<Other> host_ref(layers, n_pages, page_size, heads, head_dim, options, quant);
  ASSERT_EQ(host_ref.alloc_n(3), host_pages);
  host_ref.copy_pages_from(cpu, src, ints(host_pages));
  EXPECT_TRUE(bitwise_equal(host.k_cache(), host_ref.k_cache())) << "device -> host copy";
  gpu.copy_pages_from(host, ints(host_pages), ints({rows[0][9 % cols], rows[1][10 % cols], rows[2][11 % cols]}));
  cpu.copy_pages_from(host_ref, ints(host_pages), ints({rows[0][9 % cols], rows[1][10 % cols], rows[2][11 % cols]}));
  expect_same_storage(gpu, cpu, "host -> device copy");
}

TEST(CudaOnGpu, cuda_KernelsEqualTheCpuKernelsBitForBit) {
  PAGEDKV_NEED_GPU();
  for_each_layout([](auto tag) {
    using L = decltype(tag);
    check_bit_equality<L>(at::kHalf, {}, 16, at::kInt);
    check_bit_equality<L>(at::kFloat, {KVFormat::fp8_e4m3, KVFormat::int8}, 1, at::kLong);
    check_bit_equality<L>(at::kBFloat16, {KVFormat::int8, KVFormat::native}, 16, at::kLong);
    check_bit_equality<L>(at::kHalf, {KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, 16, at::kInt);
  });
}

/// softmax(q k^T * scale + causal mask) v in float64 (test_attention.cpp's).
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& lens,
                     double scale) {
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2);
  std::vector<at::Tensor> outs;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = lens[static_cast<size_t>(b)];
    const at::Tensor kb = k[b].narrow(0, 0, length).cpu().to(at::kDouble);
    const at::Tensor vb = v[b].narrow(0, 0, length).cpu().to(at::kDouble);
    const int64_t group = n_heads / kb.size(1);
    const at::Tensor qb = q[b].cpu().to(at::kDouble).permute({1, 0, 2});
    at::Tensor scores = at::matmul(qb, kb.repeat_interleave(group, 1).permute({1, 2, 0})) * scale;
    const at::Tensor pos = at::arange(length, at::kLong).view({1, length});
    const at::Tensor last = at::arange(n_queries, at::kLong).view({n_queries, 1}) + (length - n_queries);
    scores.masked_fill_(pos.gt(last).unsqueeze(0), -INFINITY);
    outs.push_back(at::matmul(at::softmax(scores, -1), vb.repeat_interleave(group, 1).permute({1, 0, 2}))
                       .permute({1, 0, 2}));
  }
  return at::stack(outs);
}

double rel_error(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = out.cpu().to(at::kDouble), r = ref.cpu().to(at::kDouble);
  return (o - r).abs().max().item<double>() / std::max(1e-12, r.abs().max().item<double>());
}

/// paged_attention on the GPU against the CPU kernel and float64: decode
/// and prefill, GQA and MQA, quantized pages, contexts long enough to split.
TEST(CudaOnGpu, cuda_AttentionMatchesTheCpuKernelAndFloat64) {
  PAGEDKV_NEED_GPU();
  struct Case {
    at::ScalarType dtype;
    KVQuant quant;
    int64_t page_size, kv_heads, group, head_dim, n_queries;
    std::vector<int64_t> lengths;
  };
  const Case cases[] = {
      {at::kHalf, {}, 16, 8, 4, 128, 1, {2048, 17, 700}},
      {at::kBFloat16, {KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, 16, 2, 8, 128, 1, {4000, 1}},
      {at::kFloat, {KVFormat::int8, KVFormat::int8}, 3, 2, 1, 64, 1, {600, 5}},
      {at::kHalf, {KVFormat::fp8_e4m3, KVFormat::int8}, 16, 2, 4, 128, 1, {900, 31}},
      {at::kHalf, {}, 16, 2, 4, 128, 37, {300, 37}},
      {at::kFloat, {}, 5, 1, 16, 80, 9, {100, 64}},
      {at::kBFloat16, {KVFormat::int8, KVFormat::int8}, 16, 4, 2, 256, 5, {1500, 8}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c10::toString(c.dtype)) + " K=" + pagedkv::format_name(c.quant.k) + " D=" +
                 std::to_string(c.head_dim) + " G=" + std::to_string(c.group) + " Sq=" + std::to_string(c.n_queries));
    const int64_t batch = static_cast<int64_t>(c.lengths.size());
    int64_t cols = 0;
    for (const int64_t l : c.lengths) cols = std::max(cols, (l + c.page_size - 1) / c.page_size + 1);
    const auto options = at::TensorOptions().dtype(c.dtype);
    PagedCache<HND> cpu(1, batch * cols, c.page_size, c.kv_heads, c.head_dim, options, c.quant);
    PagedCache<HND> gpu(1, batch * cols, c.page_size, c.kv_heads, c.head_dim, options.device(kCuda), c.quant);
    std::vector<int64_t> pages = cpu.alloc_n(batch * cols);
    gpu.alloc_n(batch * cols);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(3));
    std::vector<std::vector<int64_t>> rows(batch);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < cols; ++j) rows[static_cast<size_t>(b)].push_back(pages[static_cast<size_t>(b * cols + j)]);
    const at::Tensor page_table = table(rows, at::kInt);
    const int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
    const at::Tensor k = kv_values({batch, longest, c.kv_heads, c.head_dim}, c.dtype, 4, false);
    const at::Tensor v = kv_values({batch, longest, c.kv_heads, c.head_dim}, c.dtype, 5, false);
    cpu.write(0, page_table, 0, k, v);
    gpu.write(0, page_table, 0, k.to(kCuda), v.to(kCuda));
    const at::Tensor lengths = ints(c.lengths);
    const at::Tensor q = kv_values({batch, c.n_queries, c.kv_heads * c.group, c.head_dim}, c.dtype, 6, false);
    const at::Tensor out_cpu = pagedkv::paged_attention(cpu.bind(page_table, lengths), 0, q);
    const at::Tensor out_gpu = pagedkv::paged_attention(gpu.bind(page_table, lengths), 0, q.to(kCuda));
    const auto kv = cpu.gather(0, page_table, lengths);  // dequantized, as the kernels see it
    const double tolerance = c.dtype == at::kFloat ? 1e-5 : 2e-2;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    EXPECT_LT(rel_error(out_gpu, reference(q, kv.first, kv.second, c.lengths, scale)), tolerance) << "float64";
    EXPECT_LT(rel_error(out_gpu, out_cpu), tolerance) << "CPU kernel";
  }
}

/// reference() with AttentionOptions, spelled out from their words: query
/// s (position p = length - Sq + s) sees key t iff t >= p - window + 1 and,
/// among the new tokens, as the tree mask says (causal without one);
/// logits soft-capped after the scale; a sink per head in the denominator;
/// zeros where a query sees nothing. Options' tensors may be on any device.
at::Tensor reference_with(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::vector<int64_t>& lens, const pagedkv::AttentionOptions& o) {
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2);
  const at::Tensor mask = o.tree_mask.defined() ? o.tree_mask.cpu() : at::Tensor();
  std::vector<at::Tensor> outs;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = lens[static_cast<size_t>(b)], new_start = length - n_queries;
    const at::Tensor kb = k[b].narrow(0, 0, length).cpu().to(at::kDouble);
    const at::Tensor vb = v[b].narrow(0, 0, length).cpu().to(at::kDouble);
    const int64_t group = n_heads / kb.size(1);
    const at::Tensor qb = q[b].cpu().to(at::kDouble).permute({1, 0, 2});
    at::Tensor scores = at::matmul(qb, kb.repeat_interleave(group, 1).permute({1, 2, 0})) * o.scale;
    if (o.softcap > 0.0) scores = at::tanh(scores / o.softcap) * o.softcap;
    at::Tensor visible = at::zeros({n_queries, length}, at::kBool);
    auto vis = visible.accessor<bool, 2>();
    for (int64_t s = 0; s < n_queries; ++s) {
      const int64_t position = new_start + s;
      for (int64_t t = o.window > 0 ? std::max<int64_t>(0, position - o.window + 1) : 0; t < length; ++t) {
        vis[s][t] = t < new_start || (mask.defined() ? mask[b][s][t - new_start].item<bool>() : t <= position);
      }
    }
    scores.masked_fill_(visible.logical_not().unsqueeze(0), -INFINITY);
    at::Tensor probs;
    if (o.sinks.defined()) {
      const at::Tensor sink = o.sinks.cpu().to(at::kDouble).view({n_heads, 1, 1}).expand({n_heads, n_queries, 1});
      probs = at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, length);
    } else {
      probs = at::softmax(scores, -1);
    }
    probs = at::where(visible.any(-1, true).unsqueeze(0), probs, at::zeros_like(probs));
    outs.push_back(at::matmul(probs, vb.repeat_interleave(group, 1).permute({1, 0, 2})).permute({1, 0, 2}));
  }
  return at::stack(outs);
}

/// paged_attention's options on the GPU against float64 (not yet run on a
/// GPU when written: the CUDA-grid emulator ran the same kernel text,
/// tests/test_cuda_emulated_attention.cpp): a windowed decode over a long
/// context whose table is -1 before the window (as a windowed
/// SequenceTable's), soft-cap and sinks on fp8 pages, a tree mask in a
/// prefill chunk with a window, all through bind and the checks.
TEST(CudaOnGpu, cuda_AttentionOptionsMatchFloat64) {
  PAGEDKV_NEED_GPU();
  struct Case {
    at::ScalarType dtype;
    KVQuant quant;
    int64_t page_size, kv_heads, group, head_dim, n_queries;
    std::vector<int64_t> lengths;
    int64_t window;
    double softcap;
    bool sinks, tree;
  };
  const Case cases[] = {
      {at::kHalf, {}, 16, 8, 4, 128, 1, {4000, 17, 1500}, 1024, 0.0, false, false},
      {at::kBFloat16, {KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, 16, 2, 8, 128, 1, {3000, 1}, 700, 50.0, true, false},
      {at::kFloat, {KVFormat::int8, KVFormat::int8}, 7, 2, 2, 64, 1, {600, 5}, 0, 30.0, true, false},
      {at::kHalf, {}, 16, 2, 4, 128, 7, {900, 7}, 300, 20.0, true, true},
      {at::kFloat, {}, 5, 1, 16, 80, 7, {100, 64}, 0, 0.0, false, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c10::toString(c.dtype)) + " K=" + pagedkv::format_name(c.quant.k) + " D=" +
                 std::to_string(c.head_dim) + " Sq=" + std::to_string(c.n_queries) + " window=" +
                 std::to_string(c.window) + " softcap=" + std::to_string(c.softcap));
    const int64_t batch = static_cast<int64_t>(c.lengths.size()), n_heads = c.kv_heads * c.group;
    int64_t cols = 0;
    for (const int64_t l : c.lengths) cols = std::max(cols, (l + c.page_size - 1) / c.page_size + 1);
    PagedCache<NHD> gpu(1, batch * cols, c.page_size, c.kv_heads, c.head_dim,
                        at::TensorOptions().dtype(c.dtype).device(kCuda), c.quant);
    std::vector<int64_t> pages = gpu.alloc_n(batch * cols);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(5));
    std::vector<std::vector<int64_t>> rows(batch), read_rows(batch);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t first =
          pagedkv::checks::first_visible(c.lengths[static_cast<size_t>(b)], c.n_queries, c.window) / c.page_size;
      for (int64_t j = 0; j < cols; ++j) {
        rows[static_cast<size_t>(b)].push_back(pages[static_cast<size_t>(b * cols + j)]);
        read_rows[static_cast<size_t>(b)].push_back(j < first ? -1 : pages[static_cast<size_t>(b * cols + j)]);
      }
    }
    const at::Tensor page_table = table(rows, at::kInt);
    const int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
    const at::Tensor k = kv_values({batch, longest, c.kv_heads, c.head_dim}, c.dtype, 7, false);
    const at::Tensor v = kv_values({batch, longest, c.kv_heads, c.head_dim}, c.dtype, 8, false);
    gpu.write(0, page_table, 0, k.to(kCuda), v.to(kCuda));
    const at::Tensor lengths = ints(c.lengths);
    const at::Tensor q = kv_values({batch, c.n_queries, n_heads, c.head_dim}, c.dtype, 9, false);
    pagedkv::AttentionOptions o;
    o.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    o.window = c.window;
    o.softcap = c.softcap;
    if (c.sinks) o.sinks = (at::arange(n_heads, at::kFloat) * 1.5 - 4.0).to(kCuda);
    if (c.tree) {  // a root, then two chains of 3; the last row of every sequence sees no new token
      at::Tensor m = at::zeros({batch, c.n_queries, c.n_queries}, at::kBool);
      auto a = m.accessor<bool, 3>();
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i + 1 < c.n_queries; ++i) {
          for (int64_t j = 0; j <= i; ++j) a[b][i][j] = j == 0 || j % 2 == i % 2;
        }
      }
      o.tree_mask = m.to(kCuda);
    }
    const auto kv = gpu.gather(0, page_table, lengths);  // dequantized, as the kernels see it
    const at::Tensor out = pagedkv::paged_attention(gpu.bind(table(read_rows, at::kInt), lengths), 0, q.to(kCuda), o);
    const double tolerance = c.dtype == at::kFloat ? 1e-5 : 2e-2;
    EXPECT_LT(rel_error(out, reference_with(q, kv.first, kv.second, c.lengths, o)), tolerance) << "float64";
  }
}

/// A decode step's tables as an engine builds them (SequenceTable::batch:
/// on the cpu), for `lengths` of one new token each.
struct Step {
  at::Tensor page_table;  // [B, cols] int32, cpu
  at::Tensor lengths;     // [B] int64, cpu
  at::Tensor tail;        // [B] int64, cpu: lengths - 1
};
Step step_of(const std::vector<std::vector<int64_t>>& rows, const std::vector<int64_t>& lens) {
  std::vector<int64_t> tail(lens);
  for (int64_t& t : tail) --t;
  return {table(rows, at::kInt), ints(lens), ints(tail)};
}

/// bind, then every layer's write at the tail and attention, under torch's
/// sync debug mode set to error: nothing synchronises with the device.
TEST(CudaOnGpu, cuda_DecodeStepNeverSynchronizes) {
  PAGEDKV_NEED_GPU();
  const int64_t layers = 4, batch = 8, heads = 8, group = 4, head_dim = 128, page_size = 16, cols = 8;
  PagedCache<NHD> cache(layers, batch * cols, page_size, heads, head_dim,
                        at::TensorOptions().dtype(at::kHalf).device(kCuda), {KVFormat::fp8_e4m3, KVFormat::fp8_e4m3});
  const std::vector<int64_t> pages = cache.alloc_n(batch * cols);
  std::vector<std::vector<int64_t>> rows(batch);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < cols; ++j) rows[static_cast<size_t>(b)].push_back(pages[static_cast<size_t>(b * cols + j)]);
  const at::Tensor k = at::randn({batch, 1, heads, head_dim}, at::TensorOptions().dtype(at::kHalf).device(kCuda));
  const at::Tensor q = at::randn({batch, 1, heads * group, head_dim}, at::TensorOptions().dtype(at::kHalf).device(kCuda));
  const Step warm = step_of(rows, std::vector<int64_t>(batch, 5));
  const auto view0 = cache.bind(warm.page_table, warm.lengths);  // compiles and loads the kernels
  for (int64_t layer = 0; layer < layers; ++layer) {
    view0.write(layer, warm.tail, k, k);
    (void)pagedkv::paged_attention(view0, layer, q);
  }
  const at::Tensor device_table = warm.page_table.to(kCuda);
  torch::cuda::synchronize();
  auto& state = c10::cuda::warning_state();
  const auto previous = state.get_sync_debug_mode();
  state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    // The check can fail: the ATen path copies a device table to the host.
    {
      pagedkv::ScopedBackend generic(pagedkv::Backend::generic);
      expect_error([&] { (void)cache.gather(0, device_table, warm.lengths); }, {"synchroniz"});
    }
    for (int64_t step = 0; step < 3; ++step) {
      const Step s = step_of(rows, std::vector<int64_t>(batch, 6 + step));
      const auto view = cache.bind(s.page_table, s.lengths);
      for (int64_t layer = 0; layer < layers; ++layer) {
        view.write(layer, s.tail, k, k);
        (void)pagedkv::paged_attention(view, layer, q);
        (void)view.gather(layer);
      }
    }
  } catch (...) {
    state.set_sync_debug_mode(previous);
    throw;
  }
  state.set_sync_debug_mode(previous);
}

/// A decode step captured once in a CUDA graph (bind outside, every
/// layer's write and attention inside) and replayed for later steps with
/// other lengths and pages (re-bound into the same buffers) equals eager
/// runs of the same steps on a twin cache.
TEST(CudaOnGpu, cuda_CapturedDecodeStepReplaysLaterSteps) {
  PAGEDKV_NEED_GPU();
  const int64_t layers = 3, batch = 4, heads = 2, group = 4, head_dim = 64, page_size = 16, cols = 6;
  const auto options = at::TensorOptions().dtype(at::kHalf).device(kCuda);
  PagedCache<HND> graphed(layers, batch * cols + 8, page_size, heads, head_dim, options);
  PagedCache<HND> eager(layers, batch * cols + 8, page_size, heads, head_dim, options);
  std::vector<int64_t> pages = graphed.alloc_n(batch * cols + 8);
  ASSERT_EQ(eager.alloc_n(batch * cols + 8), pages);
  std::vector<std::vector<int64_t>> rows(batch);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < cols; ++j) rows[static_cast<size_t>(b)].push_back(pages[static_cast<size_t>(b * cols + j)]);
  // Static inputs the graph reads; each step copies new values into them.
  std::vector<at::Tensor> k_in, v_in, q_in, out;
  for (int64_t l = 0; l < layers; ++l) {
    k_in.push_back(at::empty({batch, 1, heads, head_dim}, options));
    v_in.push_back(at::empty({batch, 1, heads, head_dim}, options));
    q_in.push_back(at::empty({batch, 1, heads * group, head_dim}, options));
  }
  const auto fill_inputs = [&](int64_t step) {
    at::manual_seed(100 + step);
    for (int64_t l = 0; l < layers; ++l) {
      k_in[static_cast<size_t>(l)].copy_(at::randn(k_in[0].sizes()).to(at::kHalf));
      v_in[static_cast<size_t>(l)].copy_(at::randn(v_in[0].sizes()).to(at::kHalf));
      q_in[static_cast<size_t>(l)].copy_(at::randn(q_in[0].sizes()).to(at::kHalf));
    }
  };
  const auto run_eager = [&](const Step& s) {
    std::vector<at::Tensor> outs;
    const auto view = eager.bind(s.page_table, s.lengths);
    for (int64_t l = 0; l < layers; ++l) {
      view.write(l, s.tail, k_in[static_cast<size_t>(l)], v_in[static_cast<size_t>(l)]);
      outs.push_back(pagedkv::paged_attention(view, l, q_in[static_cast<size_t>(l)]));
    }
    return outs;
  };
  std::vector<int64_t> lens{3, 17, 40, 1};
  // Step 0, eager on both caches (and the kernels loaded).
  fill_inputs(0);
  Step s = step_of(rows, lens);
  (void)run_eager(s);
  {
    const auto view = graphed.bind(s.page_table, s.lengths, BindBuffers::per_shape);
    for (int64_t l = 0; l < layers; ++l) {
      view.write(l, s.tail, k_in[static_cast<size_t>(l)], v_in[static_cast<size_t>(l)]);
      (void)pagedkv::paged_attention(view, l, q_in[static_cast<size_t>(l)]);
    }
  }
  // Step 1: captured, then replayed.
  for (int64_t& l : lens) ++l;
  fill_inputs(1);
  s = step_of(rows, lens);
  at::cuda::CUDAGraph graph;
  {
    const auto view = graphed.bind(s.page_table, s.lengths, BindBuffers::per_shape);
    torch::cuda::synchronize();
    const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    for (int64_t l = 0; l < layers; ++l) {
      view.write(l, s.tail, k_in[static_cast<size_t>(l)], v_in[static_cast<size_t>(l)]);
      out.push_back(pagedkv::paged_attention(view, l, q_in[static_cast<size_t>(l)]));
    }
    graph.capture_end();
  }
  graph.replay();
  std::vector<at::Tensor> expected = run_eager(s);
  for (int64_t l = 0; l < layers; ++l) {
    EXPECT_TRUE(bitwise_equal(out[static_cast<size_t>(l)], expected[static_cast<size_t>(l)])) << "step 1 layer " << l;
  }
  // Steps 2-5: new lengths (one sequence restarted short), then rows on other pages.
  for (int64_t step = 2; step <= 5; ++step) {
    for (int64_t& l : lens) ++l;
    if (step == 3) lens[1] = 2;
    if (step == 4) std::swap(rows[0][2], rows[3][5]);  // row 0's third page moves: a different table, same shape
    fill_inputs(step);
    s = step_of(rows, lens);
    (void)graphed.bind(s.page_table, s.lengths, BindBuffers::per_shape);
    graph.replay();
    expected = run_eager(s);
    for (int64_t l = 0; l < layers; ++l) {
      EXPECT_TRUE(bitwise_equal(out[static_cast<size_t>(l)], expected[static_cast<size_t>(l)]))
          << "step " << step << " layer " << l;
    }
  }
  EXPECT_TRUE(bitwise_equal(graphed.k_cache(), eager.k_cache())) << "k_cache after the replays";
  EXPECT_TRUE(bitwise_equal(graphed.v_cache(), eager.v_cache())) << "v_cache after the replays";
}

/// Inside a capture, bind (an upload) and a write whose start positions
/// are not the bound lengths' tail (another upload) throw before anything
/// is captured; a view whose pages were freed throws on the GPU as in the
/// emulator.
TEST(CudaOnGpu, cuda_CaptureRejectsUploadsAndStaleViewsThrow) {
  PAGEDKV_NEED_GPU();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(kCuda);
  PagedCache<NHD> cache(1, 8, 4, 2, 32, options);
  const std::vector<int64_t> pages = cache.alloc_n(4);
  const at::Tensor page_table = table({{pages[0], pages[1]}, {pages[2], pages[3]}}, at::kInt);
  const at::Tensor k = at::randn({2, 1, 2, 32}, options);
  const auto view = cache.bind(page_table, ints({3, 5}));
  view.write(0, ints({2, 4}), k, k);  // loads the kernels
  torch::cuda::synchronize();
  {
    at::cuda::CUDAGraph graph;
    const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    expect_error([&] { (void)cache.bind(page_table, ints({3, 5})); }, {"outside a CUDA graph capture"});
    expect_error([&] { view.write(0, ints({1, 1}), k, k); }, {"expected to equal the bound lengths"});
    view.write(0, ints({2, 4}), k, k);  // the tail: allowed
    graph.capture_end();
  }
  cache.free(pages[3]);
  const CacheSnapshot before(cache);
  expect_error([&] { (void)view.gather(0); }, {"which was freed since"});
  expect_error([&] { (void)pagedkv::paged_attention(view, 0, at::randn({2, 1, 2, 32}, options)); },
               {"which was freed since"});
  before.expect_same(cache, "stale view");
}

#endif  // PAGEDKV_WITH_CUDA

}  // namespace
