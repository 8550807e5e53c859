// pagedkv_device_bench: the suite's write, gather and attention rows on any
// device, each beside a same-device copy of the bytes it moves (for CUDA: a
// device-to-device copy_, i.e. cudaMemcpy). It needs only torch, not Google
// Benchmark, so that scripts/gpu-check can run it on a lent GPU machine;
// ctest runs it on the CPU (--quick) so that it stays working.
//
//   pagedkv_device_bench [--device cpu|cuda] [--reps N] [--quick]
//
// Geometry as in bench/pagedkv_bench: fp16, 8 kv heads x 128, page 16,
// page tables shuffled over the pool, 32 query heads for attention. Times
// are the median over 5 batches of N pipelined calls (one device sync per
// batch), so launch latency is amortised the same way for both columns.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_data.hpp"
#include "pagedkv/attention.hpp"
#include "pagedkv/paged_cache.hpp"

namespace {

using namespace pagedkv_bench;

constexpr int64_t kQueryHeads = 32;

struct Options {
  at::Device device = at::kCPU;
  int reps = 20;
  bool quick = false;  ///< small shapes: a smoke run, not a measurement
};

void synchronize(const at::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

/// Median over 5 batches of `reps` calls of `body`, in microseconds per call.
double time_us(const Options& opt, const std::function<void()>& body) {
  body();  // warm-up: allocations and first touches stay out of the timing
  synchronize(opt.device);
  std::vector<double> per_call;
  for (int batch = 0; batch < 5; ++batch) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < opt.reps; ++i) body();
    synchronize(opt.device);
    const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
    per_call.push_back(took.count() / opt.reps);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

/// A same-device copy of `bytes`: the limit every row is compared with.
struct DeviceCopy {
  DeviceCopy(int64_t bytes, const at::Device& device)
      : src(at::ones({bytes}, at::TensorOptions().dtype(at::kByte).device(device))),
        dst(at::zeros({bytes}, at::TensorOptions().dtype(at::kByte).device(device))) {}
  void operator()() { dst.copy_(src); }
  at::Tensor src;  // [bytes]
  at::Tensor dst;  // [bytes]
};

void row(const char* name, int64_t bytes, double pagedkv_us, double copy_us) {
  std::printf("| %-34s | %10.1f | %9.1f | %6.2fx | %8.2f |\n", name, pagedkv_us, copy_us, pagedkv_us / copy_us,
              static_cast<double>(bytes) / pagedkv_us / 1e3);
  std::fflush(stdout);
}

/// A cache of `pages_per_row * batch` pages (one layer) filled with a
/// pattern, and a shuffled page table mapping them, both on the device.
template <class Layout>
struct Fixture {
  Fixture(const Options& opt, int64_t batch, int64_t pages_per_row)
      : cache(1, batch * pages_per_row, kPageSize, kHeads, kHeadDim, half().device(opt.device)) {
    table = shuffled_page_table(cache.pool(), batch, pages_per_row, 7).to(opt.device);
    at::Tensor pattern = at::empty(cache.k_cache().sizes(), half());
    fill_pattern(pattern, 1);
    cache.k_cache().copy_(pattern);
    fill_pattern(pattern, 2);
    cache.v_cache().copy_(pattern);
  }
  pagedkv::PagedCache<Layout> cache;
  at::Tensor table;  // [batch, pages_per_row]
};

at::Tensor random_half(const Options& opt, std::vector<int64_t> sizes) {
  return at::randn(sizes, at::TensorOptions().dtype(at::kFloat)).to(opt.device, at::kHalf);
}

template <class Layout>
void write_rows(const Options& opt, const char* name, int64_t batch, int64_t tokens, int64_t start) {
  Fixture<Layout> f(opt, batch, pages_for(start + tokens));
  const at::Tensor k = random_half(opt, {batch, tokens, kHeads, kHeadDim});  // [B, S, H, D]
  const at::Tensor v = random_half(opt, {batch, tokens, kHeads, kHeadDim});  // [B, S, H, D]
  const int64_t bytes = 2 * batch * tokens * kTokenBytes;
  DeviceCopy copy(bytes, opt.device);
  row(name, bytes, time_us(opt, [&] { f.cache.write(0, f.table, start, k, v); }), time_us(opt, copy));
}

template <class Layout>
void gather_rows(const Options& opt, const char* name, int64_t batch, int64_t tokens) {
  Fixture<Layout> f(opt, batch, pages_for(tokens));
  const int64_t bytes = 2 * batch * tokens * kTokenBytes;
  DeviceCopy copy(bytes, opt.device);
  row(name, bytes, time_us(opt, [&] { (void)f.cache.gather(0, f.table); }), time_us(opt, copy));
}

template <class Layout>
void attention_rows(const Options& opt, const char* name, int64_t batch, int64_t tokens) {
  Fixture<Layout> f(opt, batch, pages_for(tokens));
  const at::Tensor lengths = at::full({batch}, tokens, at::kLong);
  const auto view = f.cache.bind(f.table, lengths);
  const at::Tensor q = random_half(opt, {batch, 1, kQueryHeads, kHeadDim});  // [B, 1, n_heads, D]
  const int64_t bytes = 2 * batch * tokens * kTokenBytes;  // the K/V it reads
  DeviceCopy copy(bytes, opt.device);
  row(name, bytes, time_us(opt, [&] { (void)pagedkv::paged_attention(view, 0, q); }), time_us(opt, copy));
}

template <class Layout>
void all_rows(const Options& opt) {
  const std::string l = Layout::name;
  const int64_t decode_batch = opt.quick ? 8 : 256, ctx = opt.quick ? 64 : 2048;
  const int64_t prefill_batch = opt.quick ? 2 : 4, gather_batch = opt.quick ? 2 : 32;
  write_rows<Layout>(opt, ("write_decode/" + l + "/B" + std::to_string(decode_batch)).c_str(), decode_batch, 1, ctx);
  write_rows<Layout>(opt, ("write_prefill/" + l + "/B" + std::to_string(prefill_batch) + "xS" + std::to_string(ctx)).c_str(),
                     prefill_batch, ctx, 0);
  gather_rows<Layout>(opt, ("gather_decode/" + l + "/B" + std::to_string(gather_batch) + "xT" + std::to_string(ctx)).c_str(),
                      gather_batch, ctx);
  attention_rows<Layout>(
      opt, ("attention_decode/" + l + "/B" + std::to_string(gather_batch) + "xT" + std::to_string(ctx)).c_str(),
      gather_batch, ctx);
}

int usage(const char* argv0, int rc) {
  std::fprintf(rc == 0 ? stdout : stderr,
               "usage: %s [--device cpu|cuda] [--reps N] [--quick]\n"
               "  Times pagedkv's write, gather and paged attention on a device beside a\n"
               "  same-device copy of the bytes each moves; prints a markdown table.\n"
               "  --device  cpu (default) or cuda (exit 77, skipped, when no GPU is visible)\n"
               "  --reps    calls per timed batch (default 20; median of 5 batches)\n"
               "  --quick   small shapes: checks the tool runs, measures nothing\n",
               argv0);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--help" || arg == "-h") return usage(argv[0], 0);
    if (arg == "--quick") {
      opt.quick = true;
    } else if (arg == "--device" && has_value) {
      const std::string d = argv[++i];
      if (d != "cpu" && d != "cuda") return usage(argv[0], 2);
      opt.device = d == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
    } else if (arg == "--reps" && has_value) {
      opt.reps = std::atoi(argv[++i]);
      if (opt.reps < 1) return usage(argv[0], 2);
    } else {
      return usage(argv[0], 2);
    }
  }
  if (opt.device.is_cuda() && !at::hasCUDA()) {
    std::printf("pagedkv_device_bench: skipped: --device cuda, but this torch sees no CUDA device\n");
    return 77;
  }
  std::printf("pagedkv_device_bench on %s, fp16, %ld kv heads x %ld, page %ld, %d calls per batch%s\n\n",
              opt.device.str().c_str(), static_cast<long>(kHeads), static_cast<long>(kHeadDim),
              static_cast<long>(kPageSize), opt.reps, opt.quick ? " (--quick: smoke run, not a measurement)" : "");
  std::printf("| %-34s | %10s | %9s | %7s | %8s |\n", "case", "pagedkv us", "copy us", "x copy", "GB/s");
  std::printf("|%s|%s|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(12, '-').c_str(),
              std::string(11, '-').c_str(), std::string(9, '-').c_str(), std::string(10, '-').c_str());
  all_rows<pagedkv::NHD>(opt);
  all_rows<pagedkv::HND>(opt);
  return 0;
}
