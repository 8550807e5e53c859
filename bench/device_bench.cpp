// pagedkv_device_bench: pagedkv's per-layer calls on any device, each
// beside a limit measured in the same run. It needs only torch, not Google
// Benchmark, so that scripts/gpu-check can run it on a lent GPU machine;
// ctest runs it on the CPU (--quick) so that it stays working.
//
//   pagedkv_device_bench [--device cpu|cuda] [--reps N] [--quick]
//
// Geometry as in bench/pagedkv_bench: fp16, 8 kv heads x 128, page 16,
// page tables shuffled over the pool, 32 query heads for attention. Calls
// go through views bound with host tables, as an engine makes them (on a
// CUDA cache the sync-free path). Times are the median over 5 batches of N
// pipelined calls (one device sync per batch), so launch latency is
// amortised the same way for every column.
//
// Tables printed:
// - data movement: write (prefill, decode), gather, page copies beside a
//   same-device copy_ of the same bytes (for CUDA a device-to-device copy):
//   "x copy" is the time over the copy's, "% copy bw" the bandwidth as a
//   share of the copy's;
// - decode attention beside reading its K and V once at the copy's
//   bandwidth ("x read-once"), torch's scaled_dot_product_attention on
//   contiguous K/V of the same shape, and that plus the gather it would need;
//   fp8 pages beside fp16;
// - targets (issue 32, for an H200): each row's target and whether this run
//   met it. On other devices they are printed for reference only.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_data.hpp"
#include "pagedkv/attention.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/torch_compat.hpp"

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
  body();  // warm-up: allocations, first touches and kernel loading stay out of the timing
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

/// A same-device copy of `bytes`: the limit every data row is compared with.
struct DeviceCopy {
  DeviceCopy(int64_t bytes, const at::Device& device)
      : src(at::ones({bytes}, at::TensorOptions().dtype(at::kByte).device(device))),
        dst(at::zeros({bytes}, at::TensorOptions().dtype(at::kByte).device(device))) {}
  void operator()() { dst.copy_(src); }
  at::Tensor src;  // [bytes]
  at::Tensor dst;  // [bytes]
};

/// One line of the targets table.
struct Target {
  std::string row;
  std::string goal;
  std::string got;
  bool met;
};
std::vector<Target>& targets() {
  static std::vector<Target> t;
  return t;
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, x);
  return buf;
}

void data_row(const std::string& name, int64_t bytes, double pagedkv_us, double copy_us) {
  const double share = 100.0 * copy_us / pagedkv_us;  // bandwidth as a share of the copy's
  std::printf("| %-36s | %10.1f | %9.1f | %6.2fx | %8.2f | %7.1f %% |\n", name.c_str(), pagedkv_us, copy_us,
              pagedkv_us / copy_us, static_cast<double>(bytes) / pagedkv_us / 1e3, share);
  std::fflush(stdout);
  targets().push_back({name, ">= 80 % of the copy's bandwidth", fmt("%.1f %%", share), share >= 80.0});
}

/// A cache of `pages` pages of `layers` layers filled with a pattern, on the device.
template <class Layout>
pagedkv::PagedCache<Layout> filled_cache(const Options& opt, int64_t layers, int64_t pages,
                                         pagedkv::KVQuant quant = {}) {
  pagedkv::PagedCache<Layout> cache(layers, pages, kPageSize, kHeads, kHeadDim, half().device(opt.device), quant);
  if (!pagedkv::is_quantized(quant)) {
    at::Tensor pattern = at::empty(cache.k_cache().sizes(), half());
    fill_pattern(pattern, 1);
    cache.k_cache().copy_(pattern);
    fill_pattern(pattern, 2);
    cache.v_cache().copy_(pattern);
  }
  return cache;
}

at::Tensor random_half(const Options& opt, std::vector<int64_t> sizes) {
  return at::randn(sizes, at::TensorOptions().dtype(at::kFloat)).to(opt.device, at::kHalf);
}

/// Each row's tokens at [start, start + tokens), through a view bound with
/// lengths start + tokens (the tail: what a decode step or a prefill writes).
template <class Layout>
void write_rows(const Options& opt, const std::string& name, int64_t batch, int64_t tokens, int64_t start) {
  auto cache = filled_cache<Layout>(opt, 1, batch * pages_for(start + tokens));
  const at::Tensor table = shuffled_page_table(cache.pool(), batch, pages_for(start + tokens), 7);
  const at::Tensor lengths = at::full({batch}, start + tokens, at::kLong);
  const at::Tensor starts = at::full({batch}, start, at::kLong);
  const auto view = cache.bind(table, lengths);
  const at::Tensor k = random_half(opt, {batch, tokens, kHeads, kHeadDim});  // [B, S, H, D]
  const at::Tensor v = random_half(opt, {batch, tokens, kHeads, kHeadDim});  // [B, S, H, D]
  const int64_t bytes = 2 * batch * tokens * kTokenBytes;
  DeviceCopy copy(bytes, opt.device);
  data_row(name, bytes, time_us(opt, [&] { view.write(0, starts, k, v); }), time_us(opt, copy));
}

template <class Layout>
double gather_us(const Options& opt, const pagedkv::CacheView<Layout>& view) {
  return time_us(opt, [&] { (void)view.gather(0); });
}

template <class Layout>
void gather_rows(const Options& opt, const std::string& name, int64_t batch, int64_t tokens) {
  auto cache = filled_cache<Layout>(opt, 1, batch * pages_for(tokens));
  const at::Tensor table = shuffled_page_table(cache.pool(), batch, pages_for(tokens), 7);
  const auto view = cache.bind(table, at::full({batch}, tokens, at::kLong));
  const int64_t bytes = 2 * batch * tokens * kTokenBytes;
  DeviceCopy copy(bytes, opt.device);
  data_row(name, bytes, gather_us(opt, view), time_us(opt, copy));
}

/// copy_pages of `n` shuffled pages (every layer, k and v) within one cache.
template <class Layout>
void copy_rows(const Options& opt, const std::string& name, int64_t layers, int64_t n) {
  auto cache = filled_cache<Layout>(opt, layers, 2 * n);
  std::vector<int64_t> pages = cache.alloc_n(2 * n);
  std::shuffle(pages.begin(), pages.end(), std::mt19937_64(3));
  const at::Tensor src = at::tensor(std::vector<int64_t>(pages.begin(), pages.begin() + n));
  const at::Tensor dst = at::tensor(std::vector<int64_t>(pages.begin() + n, pages.end()));
  const int64_t bytes = 2 * layers * n * kPageSize * kTokenBytes;
  DeviceCopy copy(bytes, opt.device);
  data_row(name, bytes, time_us(opt, [&] { cache.copy_pages(src, dst); }), time_us(opt, copy));
}

/// Decode attention over `tokens` tokens of `batch` sequences: pagedkv
/// beside the time to read its K and V once at the copy's bandwidth, and
/// torch's scaled_dot_product_attention on contiguous K/V [B, H, T, D]
/// (plus the gather that would make them from the pages).
template <class Layout>
double attention_rows(const Options& opt, const std::string& name, int64_t batch, int64_t tokens,
                      pagedkv::KVQuant quant, double fp16_us) {
  auto cache = filled_cache<Layout>(opt, 1, batch * pages_for(tokens), quant);
  const at::Tensor table = shuffled_page_table(cache.pool(), batch, pages_for(tokens), 7);
  const at::Tensor lengths = at::full({batch}, tokens, at::kLong);
  const auto view = cache.bind(table, lengths);
  if (pagedkv::is_quantized(quant)) {  // codes and scales from a write of random values
    const at::Tensor k = random_half(opt, {batch, tokens, kHeads, kHeadDim});
    view.write(0, 0, k, k);
  }
  const at::Tensor q = random_half(opt, {batch, 1, kQueryHeads, kHeadDim});  // [B, 1, n_heads, D]
  const int64_t bytes = 2 * batch * tokens * page_token_bytes(quant);        // the K/V it reads
  DeviceCopy copy(bytes, opt.device);
  const double us = time_us(opt, [&] { (void)pagedkv::paged_attention(view, 0, q); });
  const double read_once = time_us(opt, copy) / 2;  // a copy reads and writes each byte: half is the read
  std::string sdpa = "n/a", with_gather = "n/a";
#if PAGEDKV_TORCH_AT_LEAST(2, 5)
  if (!pagedkv::is_quantized(quant)) {
    const at::Tensor k = random_half(opt, {batch, kHeads, tokens, kHeadDim});
    const at::Tensor v = random_half(opt, {batch, kHeads, tokens, kHeadDim});
    const at::Tensor qs = q.transpose(1, 2);  // [B, n_heads, 1, D]
    const double sdpa_us = time_us(opt, [&] {
      (void)at::scaled_dot_product_attention(qs, k, v, {}, 0.0, false, std::nullopt, /*enable_gqa=*/true);
    });
    const double total = sdpa_us + gather_us(opt, view);
    sdpa = fmt("%.1f", sdpa_us);
    with_gather = fmt("%.1f", total);
    targets().push_back({name, "faster than SDPA on contiguous K/V + its gather", fmt("%.2fx of it", us / total),
                         us < total});
  }
#endif
  std::printf("| %-36s | %10.1f | %12.1f | %9.2fx | %9s | %14s |\n", name.c_str(), us, read_once, us / read_once,
              sdpa.c_str(), with_gather.c_str());
  std::fflush(stdout);
  if (pagedkv::is_quantized(quant)) {
    targets().push_back({name, "<= 0.6x the time of fp16 pages", fmt("%.2fx", us / fp16_us), us <= 0.6 * fp16_us});
  } else {
    targets().push_back({name, "<= 1.4x reading K and V once", fmt("%.2fx", us / read_once), us <= 1.4 * read_once});
  }
  return us;
}

template <class Layout>
void all_rows(const Options& opt) {
  const std::string l = Layout::name;
  const int64_t decode_batch = opt.quick ? 8 : 256, ctx = opt.quick ? 64 : 2048;
  const int64_t prefill_batch = opt.quick ? 2 : 4, gather_batch = opt.quick ? 2 : 32;
  const int64_t long_ctx = opt.quick ? 256 : 32768;
  std::printf("\n%s pages: data movement\n\n", l.c_str());
  std::printf("| %-36s | %10s | %9s | %7s | %8s | %9s |\n", "case", "pagedkv us", "copy us", "x copy", "GB/s",
              "% copy bw");
  std::printf("|%s|%s|%s|%s|%s|%s|\n", std::string(38, '-').c_str(), std::string(12, '-').c_str(),
              std::string(11, '-').c_str(), std::string(9, '-').c_str(), std::string(10, '-').c_str(),
              std::string(11, '-').c_str());
  write_rows<Layout>(opt, "write_decode/" + l + "/B" + std::to_string(decode_batch), decode_batch, 1, ctx);
  write_rows<Layout>(opt, "write_prefill/" + l + "/B" + std::to_string(prefill_batch) + "xS" + std::to_string(ctx),
                     prefill_batch, ctx, 0);
  gather_rows<Layout>(opt, "gather/" + l + "/B" + std::to_string(gather_batch) + "xT" + std::to_string(ctx),
                      gather_batch, ctx);
  const int64_t copy_layers = opt.quick ? 2 : 8, copy_pages = opt.quick ? 4 : 64;  // 64 x 8 x 64 KiB = 32 MiB
  copy_rows<Layout>(opt, "copy_pages/" + l + "/" + std::to_string(copy_pages) + "x" + std::to_string(copy_layers) + "L",
                    copy_layers, copy_pages);
  std::printf("\n%s pages: decode attention, %ld query heads\n\n", l.c_str(), static_cast<long>(kQueryHeads));
  std::printf("| %-36s | %10s | %12s | %10s | %9s | %14s |\n", "case", "pagedkv us", "read-once us", "x read-once",
              "SDPA us", "SDPA+gather us");
  std::printf("|%s|%s|%s|%s|%s|%s|\n", std::string(38, '-').c_str(), std::string(12, '-').c_str(),
              std::string(14, '-').c_str(), std::string(12, '-').c_str(), std::string(11, '-').c_str(),
              std::string(16, '-').c_str());
  const pagedkv::KVQuant fp8{pagedkv::KVFormat::fp8_e4m3, pagedkv::KVFormat::fp8_e4m3};
  for (const auto& shape : {std::make_pair(gather_batch, ctx), std::make_pair(int64_t{1}, long_ctx)}) {
    const std::string s = "/B" + std::to_string(shape.first) + "xT" + std::to_string(shape.second);
    const double fp16 = attention_rows<Layout>(opt, "attention_decode/" + l + s, shape.first, shape.second, {}, 0);
    (void)attention_rows<Layout>(opt, "attention_decode_fp8/" + l + s, shape.first, shape.second, fp8, fp16);
  }
}

int usage(const char* argv0, int rc) {
  std::fprintf(rc == 0 ? stdout : stderr,
               "usage: %s [--device cpu|cuda] [--reps N] [--quick]\n"
               "  Times pagedkv's write, gather, page copies and decode attention on a device,\n"
               "  beside a same-device copy of the bytes each moves (and attention beside\n"
               "  torch's SDPA); prints markdown tables and the issue's targets.\n"
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
      opt.device = d == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
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
  std::printf("pagedkv_device_bench on %s, fp16, %ld kv heads x %ld, page %ld, %d calls per batch%s\n",
              opt.device.str().c_str(), static_cast<long>(kHeads), static_cast<long>(kHeadDim),
              static_cast<long>(kPageSize), opt.reps, opt.quick ? " (--quick: smoke run, not a measurement)" : "");
  all_rows<pagedkv::NHD>(opt);
  all_rows<pagedkv::HND>(opt);
  std::printf("\ntargets (issue 32: an H200; %s)\n\n",
              opt.quick ? "--quick shapes: not the targets' shapes" : "this run's device and shapes");
  std::printf("| %-36s | %-48s | %-12s | %-4s |\n", "row", "target", "got", "met");
  std::printf("|%s|%s|%s|%s|\n", std::string(38, '-').c_str(), std::string(50, '-').c_str(),
              std::string(14, '-').c_str(), std::string(6, '-').c_str());
  int met = 0;
  for (const Target& t : targets()) {
    std::printf("| %-36s | %-48s | %-12s | %-4s |\n", t.row.c_str(), t.goal.c_str(), t.got.c_str(), t.met ? "yes" : "NO");
    met += t.met ? 1 : 0;
  }
  std::printf("\n%d of %zu targets met\n", met, targets().size());
  return 0;
}
