// PagedCache and CacheView on the CUDA path, run on the CPU: a
// ScopedExecutor routes CPU caches through the host code a CUDA cache runs
// (bind's snapshots and uploads, the views' checks, stale-view detection,
// the launches) with the kernels under the CPU emulator. Compared with the
// same calls on a plain CPU cache: storage bit for bit, attention within
// the CPU kernel's tolerance. What this cannot show (streams, pinned
// uploads, graph capture, syncs) is in test_cuda.cpp, on a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_emulator/kernels.hpp"
#include "pagedkv/cuda/executor.hpp"
#include "test_support.hpp"

namespace {

using namespace pagedkv_test;
using pagedkv::BindBuffers;
using pagedkv::KVFormat;
using pagedkv::KVQuant;

pkv_emu::EmulatedExecutor& emulator() {
  static pkv_emu::EmulatedExecutor ex = pkv_emu::kernels();
  return ex;
}

constexpr int64_t kLayers = 2, kPageSize = 3, kHeads = 2, kHeadDim = 16, kGroup = 4;

double rel_error(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = out.to(at::kDouble), r = ref.to(at::kDouble);
  return (o - r).abs().max().item<double>() / std::max(1e-12, r.abs().max().item<double>());
}

/// Two caches alike: `cpu` runs the CPU kernels, `emu` the CUDA path under
/// the emulator (its calls made inside a ScopedExecutor).
template <class L>
struct Pair {
  PagedCache<L> cpu, emu;
  Pair(at::ScalarType dtype, KVQuant quant, int64_t n_pages = 40)
      : cpu(kLayers, n_pages, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(dtype), quant),
        emu(kLayers, n_pages, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(dtype), quant) {}
  std::vector<int64_t> alloc_n(int64_t n) {
    std::vector<int64_t> pages = cpu.alloc_n(n);
    EXPECT_EQ(emu.alloc_n(n), pages);
    return pages;
  }
};

/// A table of `rows` rows of `cols` pages each, from `pages` in order.
at::Tensor rows_of(const std::vector<int64_t>& pages, int64_t rows, int64_t cols, at::ScalarType index) {
  std::vector<std::vector<int64_t>> r(static_cast<size_t>(rows));
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t j = 0; j < cols; ++j) r[static_cast<size_t>(b)].push_back(pages[static_cast<size_t>(b * cols + j)]);
  return table(r, index);
}

at::Tensor random_kv(int64_t batch, int64_t tokens, at::ScalarType dtype, int64_t seed) {
  at::manual_seed(seed);
  return at::randn({batch, tokens, kHeads, kHeadDim}).to(dtype);
}

template <class L>
void expect_storage_equal(const Pair<L>& p) {
  EXPECT_TRUE(bitwise_equal(p.emu.k_cache(), p.cpu.k_cache())) << "k_cache";
  EXPECT_TRUE(bitwise_equal(p.emu.v_cache(), p.cpu.v_cache())) << "v_cache";
  if (p.cpu.k_scales().defined()) {
    EXPECT_TRUE(bitwise_equal(p.emu.k_scales(), p.cpu.k_scales())) << "k_scales";
  }
  if (p.cpu.v_scales().defined()) {
    EXPECT_TRUE(bitwise_equal(p.emu.v_scales(), p.cpu.v_scales())) << "v_scales";
  }
}

/// A prefill then decode steps through views (write at the bound lengths'
/// tail, attention, gather), each step re-bound: the emulated CUDA path
/// equals the CPU's bit for bit in storage and gathers, and within the
/// attention tolerance.
template <class L>
void decode_steps(at::ScalarType dtype, KVQuant quant, BindBuffers buffers) {
  SCOPED_TRACE(std::string(L::name) + " " + c10::toString(dtype) + " K=" + pagedkv::format_name(quant.k) +
               " V=" + pagedkv::format_name(quant.v) + (buffers == BindBuffers::per_shape ? " per_shape" : " fresh"));
  Pair<L> p(dtype, quant);
  const int64_t batch = 3, cols = 4;
  const at::Tensor page_table = rows_of(p.alloc_n(batch * cols), batch, cols, at::kInt);
  std::vector<int64_t> lens = {5, 2, 7};
  // Prefill (per-row starts 0, tokens up to the longest: positions past a
  // row's length are written too, as an engine's padded prefill would).
  const at::Tensor k0 = random_kv(batch, 7, dtype, 1), v0 = random_kv(batch, 7, dtype, 2);
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    p.cpu.bind(page_table, ints(lens)).write(layer, ints({0, 0, 0}), k0, v0);
    pagedkv::cuda::ScopedExecutor scope(emulator());
    p.emu.bind(page_table, ints(lens), buffers).write(layer, ints({0, 0, 0}), k0, v0);
  }
  expect_storage_equal(p);
  for (int step = 0; step < 3; ++step) {
    for (int64_t& l : lens) ++l;
    const at::Tensor lengths = ints(lens);
    const at::Tensor tail = ints({lens[0] - 1, lens[1] - 1, lens[2] - 1});
    const auto cpu_view = p.cpu.bind(page_table, lengths);
    pagedkv::cuda::ScopedExecutor scope(emulator());
    const auto emu_view = p.emu.bind(page_table, lengths, buffers);
    ASSERT_NE(emu_view.bound_tables(), nullptr);
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const at::Tensor k = random_kv(batch, 1, dtype, 10 + step), v = random_kv(batch, 1, dtype, 20 + step);
      const at::Tensor q = at::randn({batch, 1, kHeads * kGroup, kHeadDim}).to(dtype);
      cpu_view.write(layer, tail, k, v);
      emulator().launched.clear();
      emu_view.write(layer, tail, k, v);
      ASSERT_FALSE(emulator().launched.empty());
      const at::Tensor out_cpu = pagedkv::paged_attention(cpu_view, layer, q);
      const at::Tensor out_emu = pagedkv::paged_attention(emu_view, layer, q);
      EXPECT_LT(rel_error(out_emu, out_cpu), dtype == at::kFloat ? 1e-5 : 2e-2) << "step " << step;
      const auto g_cpu = cpu_view.gather(layer);
      const auto g_emu = emu_view.gather(layer);
      EXPECT_TRUE(bitwise_equal(g_emu.first, g_cpu.first)) << "gather k, step " << step;
      EXPECT_TRUE(bitwise_equal(g_emu.second, g_cpu.second)) << "gather v, step " << step;
    }
  }
  expect_storage_equal(p);
}

TEST(CudaCacheEmulated, DecodeStepsThroughViewsEqualTheCpuPath) {
  for_each_layout([](auto tag) {
    using L = decltype(tag);
    decode_steps<L>(at::kHalf, {}, BindBuffers::fresh);
    decode_steps<L>(at::kFloat, {KVFormat::int8, KVFormat::int8}, BindBuffers::per_shape);
    decode_steps<L>(at::kBFloat16, {KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, BindBuffers::fresh);
  });
}

/// Writes at other positions than the bound lengths' tail (per-row and
/// scalar start_pos), gathers of views bound with a total length, and the
/// direct (unbound) write and gather: all equal the CPU path.
TEST(CudaCacheEmulated, OtherStartsTotalLengthViewsAndDirectCallsEqualTheCpuPath) {
  for_each_layout([](auto tag) {
    using L = decltype(tag);
    for (const KVQuant quant : {KVQuant{}, KVQuant{KVFormat::fp8_e4m3, KVFormat::native}}) {
      Pair<L> p(at::kHalf, quant);
      const at::Tensor page_table = rows_of(p.alloc_n(8), 2, 4, at::kLong);
      const at::Tensor k = random_kv(2, 4, at::kHalf, 3), v = random_kv(2, 4, at::kHalf, 4);
      const at::Tensor starts = ints({1, 6});
      p.cpu.bind(page_table, ints({4, 3})).write(0, starts, k, v);
      p.cpu.bind(page_table, 0).write(1, 2, k, v);
      p.cpu.write(0, page_table, ints({7, 0}), k, v);
      {
        pagedkv::cuda::ScopedExecutor scope(emulator());
        p.emu.bind(page_table, ints({4, 3})).write(0, starts, k, v);  // not the tail: uploaded starts
        p.emu.bind(page_table, 0).write(1, 2, k, v);                   // scalar start
        p.emu.write(0, page_table, ints({7, 0}), k, v);                // direct
      }
      expect_storage_equal(p);
      at::Tensor holes = page_table.clone();
      holes[1][2] = -1;
      for (const int64_t total : {int64_t{0}, int64_t{5}}) {
        const auto expected = p.cpu.bind(holes, total).gather(1);
        pagedkv::cuda::ScopedExecutor scope(emulator());
        const auto got = p.emu.bind(holes, total).gather(1);
        EXPECT_TRUE(bitwise_equal(got.first, expected.first)) << "total_len " << total;
        EXPECT_TRUE(bitwise_equal(got.second, expected.second)) << "total_len " << total;
      }
      const auto direct_cpu = p.cpu.gather(0, page_table, ints({9, 4}));
      pagedkv::cuda::ScopedExecutor scope(emulator());
      const auto direct_emu = p.emu.gather(0, page_table, ints({9, 4}));
      EXPECT_TRUE(bitwise_equal(direct_emu.first, direct_cpu.first));
      EXPECT_TRUE(bitwise_equal(direct_emu.second, direct_cpu.second));
    }
  });
}

/// copy_pages (a swap: lists that overlap) and copy_pages_from across
/// layouts, native and quantized, equal the CPU path.
TEST(CudaCacheEmulated, PageCopiesEqualTheCpuPath) {
  for (const KVQuant quant : {KVQuant{}, KVQuant{KVFormat::fp8_e4m3, KVFormat::int8}}) {
    Pair<NHD> p(at::kBFloat16, quant, 12);
    PagedCache<HND> other_cpu(kLayers, 12, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(at::kBFloat16), quant);
    PagedCache<HND> other_emu(kLayers, 12, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(at::kBFloat16), quant);
    const std::vector<int64_t> pages = p.alloc_n(12);
    ASSERT_EQ(other_cpu.alloc_n(4), other_emu.alloc_n(4));
    const at::Tensor all = rows_of(pages, 1, 12, at::kLong);
    const at::Tensor k = random_kv(1, 12 * kPageSize, at::kBFloat16, 11), v = random_kv(1, 12 * kPageSize, at::kBFloat16, 12);
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      p.cpu.write(layer, all, 0, k, v);
      other_cpu.write(layer, all.narrow(1, 0, 4), 0, k.narrow(1, 0, 4 * kPageSize), v.narrow(1, 0, 4 * kPageSize));
      other_emu.write(layer, all.narrow(1, 0, 4), 0, k.narrow(1, 0, 4 * kPageSize), v.narrow(1, 0, 4 * kPageSize));
    }
    p.emu.copy_pages_from(p.cpu, ints(pages), ints(pages));  // the same contents in both
    const at::Tensor src = ints({pages[3], pages[7], pages[1]}), dst = ints({pages[7], pages[3], pages[9]});
    p.cpu.copy_pages(src, dst);
    p.cpu.copy_pages_from(other_cpu, ints({0, 2}), ints({pages[0], pages[11]}));
    {
      pagedkv::cuda::ScopedExecutor scope(emulator());
      emulator().launched.clear();
      p.emu.copy_pages(src, dst);
      p.emu.copy_pages_from(other_emu, ints({0, 2}), ints({pages[0], pages[11]}));
      EXPECT_FALSE(emulator().launched.empty());
    }
    expect_storage_equal(p);
  }
}

/// A view of the CUDA path holds bind's snapshot: changing the table tensor
/// afterwards does not move its writes (on the CPU it would).
TEST(CudaCacheEmulated, ViewsAreSnapshotsOfBind) {
  Pair<NHD> p(at::kFloat, {});
  at::Tensor page_table = rows_of(p.alloc_n(4), 1, 4, at::kLong);
  const at::Tensor k = random_kv(1, 1, at::kFloat, 5), v = random_kv(1, 1, at::kFloat, 6);
  pagedkv::cuda::ScopedExecutor scope(emulator());
  const auto view = p.emu.bind(page_table, ints({1}));
  const int64_t bound_page = page_table[0][0].item<int64_t>();
  page_table[0][0] = page_table[0][1].item<int64_t>();  // the engine edits its tensor in place
  view.write(0, 0, k, v);
  EXPECT_TRUE(bitwise_equal(p.emu.k_cache()[0][bound_page][0], k[0][0])) << "the write went to bind's page";
}

template <class Call>
void expect_stale(PagedCache<NHD>& cache, Call&& call, const std::string& what) {
  const CacheSnapshot before(cache);
  expect_error(call, {what});
  before.expect_same(cache, what);
}

/// A view whose pages were freed, or freed and reallocated, throws before
/// it touches memory; one whose per-shape buffers a later bind reused
/// throws; others are unaffected.
TEST(CudaCacheEmulated, StaleViewsThrowBeforeTouchingMemory) {
  PagedCache<NHD> cache(1, 16, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(at::kHalf));
  const std::vector<int64_t> pages = cache.alloc_n(8);
  const at::Tensor page_table = rows_of(pages, 2, 4, at::kInt);
  const at::Tensor k = random_kv(2, 1, at::kHalf, 7), v = random_kv(2, 1, at::kHalf, 8);
  const at::Tensor q = at::randn({2, 1, kHeads * kGroup, kHeadDim}).to(at::kHalf);
  pagedkv::cuda::ScopedExecutor scope(emulator());
  const auto view = cache.bind(page_table, ints({4, 9}));
  const auto other_pages = cache.alloc_n(2);
  cache.free(other_pages[0]);  // a page the view does not map: the view stays usable
  view.write(0, ints({3, 8}), k, v);
  (void)pagedkv::paged_attention(view, 0, q);
  (void)view.gather(0);

  cache.free(pages[4]);  // row 1's first page
  expect_stale(cache, [&] { (void)view.gather(0); }, "which was freed since");
  expect_stale(cache, [&] { (void)pagedkv::paged_attention(view, 0, q); }, "which was freed since");
  expect_stale(cache, [&] { view.write(0, ints({3, 0}), k, v); }, "expected an allocated page");  // as on the CPU
  view.write(0, ints({3, 3}), k, v);  // touches row 1's second page only: allowed
  ASSERT_EQ(cache.alloc(), pages[4]);  // reallocated (another sequence's now)
  expect_stale(cache, [&] { (void)view.gather(0); }, "which was freed and reallocated since");
  expect_stale(cache, [&] { view.write(0, ints({3, 0}), k, v); }, "which was freed and reallocated since");

  const auto fresh = cache.bind(page_table, ints({4, 9}));
  (void)pagedkv::paged_attention(fresh, 0, q);

  const auto first = cache.bind(page_table, ints({4, 9}), BindBuffers::per_shape);
  (void)pagedkv::paged_attention(first, 0, q);
  const auto second = cache.bind(page_table, ints({5, 9}), BindBuffers::per_shape);
  expect_stale(cache, [&] { (void)pagedkv::paged_attention(first, 0, q); }, "reused");
  expect_stale(cache, [&] { first.write(0, 1, k, v); }, "reused");
  expect_stale(cache, [&] { (void)first.gather(0); }, "reused");
  (void)pagedkv::paged_attention(second, 0, q);
  (void)pagedkv::paged_attention(fresh, 0, q);  // a view with buffers of its own is unaffected
  const auto other_shape = cache.bind(page_table.narrow(0, 0, 1), ints({4}), BindBuffers::per_shape);
  (void)pagedkv::paged_attention(second, 0, q);  // another shape: another set
  (void)other_shape;
}

/// Bad input on views of the CUDA path throws c10::Error naming the
/// function and argument, and changes nothing, as on the CPU.
TEST(CudaCacheEmulated, BadInputThrowsAndChangesNothing) {
  PagedCache<HND> cache(2, 16, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(at::kFloat),
                        {KVFormat::int8, KVFormat::native});
  const at::Tensor page_table = rows_of(cache.alloc_n(4), 2, 2, at::kLong);
  const at::Tensor k = random_kv(2, 1, at::kFloat, 9), v = random_kv(2, 1, at::kFloat, 10);
  const at::Tensor q = at::randn({2, 1, kHeads * kGroup, kHeadDim});
  pagedkv::cuda::ScopedExecutor scope(emulator());
  const auto view = cache.bind(page_table, ints({2, 6}));
  const CacheSnapshot before(cache);
  expect_error([&] { view.write(2, 0, k, v); }, {"PagedCache<HND>::write", "'layer'"});
  expect_error([&] { view.write(0, -1, k, v); }, {"'start_pos' expected >= 0"});
  expect_error([&] { view.write(0, 6, k, v); }, {"a write past the last column"});
  expect_error([&] { view.write(0, ints({0}), k, v); }, {"'start_pos' expected shape [2]"});
  expect_error([&] { view.write(0, 0, k.to(at::kHalf), v); }, {"'k' expected dtype Float"});
  expect_error([&] { view.write(0, 0, k.narrow(3, 0, 8), v.narrow(3, 0, 8)); }, {"'k' expected head_dim"});
  expect_error([&] { (void)view.gather(5); }, {"PagedCache<HND>::gather", "'layer'"});
  expect_error([&] { (void)pagedkv::paged_attention(view, 0, at::randn({2, 3, kHeads * kGroup, kHeadDim})); },
               {"lengths[0] >= 3"});
  expect_error([&] { (void)pagedkv::paged_attention(view, 0, q.to(at::kHalf)); }, {"'q' expected dtype Float"});
  expect_error([&] { (void)pagedkv::paged_attention(cache.bind(page_table, 0), 0, q); }, {"bound with per-sequence"});
  expect_error([&] { (void)cache.bind(page_table, ints({2, 7})); }, {"PagedCache<HND>::bind", "lengths[1] <= 6"});
  before.expect_same(cache, "bad input");
}

/// A windowed table's rows (leading -1 columns) bind on the CUDA path too;
/// a gather or attention without a window, which read every position below
/// the length, throws there as on the CPU (bind no longer refused the row,
/// so the per-layer calls check it), and writes into held pages work.
TEST(CudaCacheEmulated, WindowedRowsBindAndReadsWithoutAWindowThrow) {
  PagedCache<NHD> cache(2, 16, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(at::kFloat));
  const std::vector<int64_t> pages = cache.alloc_n(3);
  const at::Tensor page_table = table({{-1, pages[0], pages[1]}, {pages[2], -1, -1}});
  const at::Tensor k = random_kv(2, 1, at::kFloat, 9), v = random_kv(2, 1, at::kFloat, 10);
  const at::Tensor q = at::randn({2, 1, kHeads * kGroup, kHeadDim});
  pagedkv::cuda::ScopedExecutor scope(emulator());
  const auto view = cache.bind(page_table, ints({8, 2}));
  ASSERT_NE(view.bound_tables(), nullptr);
  view.write(0, ints({7, 1}), k, v);
  const CacheSnapshot before(cache);
  expect_error([&] { (void)view.gather(0); }, {"PagedCache<NHD>::gather", "'lengths'", "first -1 at column 0"});
  expect_error([&] { (void)pagedkv::paged_attention(view, 0, q); },
               {"paged_attention<NHD>", "'lengths'", "first -1 at column 0"});
  expect_error([&] { view.write(0, 0, k, v); }, {"PagedCache<NHD>::write", "(unmapped)"});
  expect_error([&] { (void)cache.bind(table({{-1, -1, pages[1]}, {pages[2], -1, -1}}), ints({5, 2})); },
               {"PagedCache<NHD>::bind", "'page_table'", "page_table[0][1]"});
  before.expect_same(cache, "reads of a windowed row without a window");
  // Rows without -1 below their lengths still read without a recheck.
  const auto plain = cache.bind(table({{pages[0], pages[1]}}), ints({5}));
  EXPECT_EQ(plain.gather(0).first.size(1), 5);
}

}  // namespace
