// Scratch driver for profiling one kernel case outside Google Benchmark:
// callgrind (the benchmark binary is slow under valgrind) and quick A/B
// timings on a noisy machine (it prints the minimum, 25th percentile and
// median of N single calls). Not part of the build; bench/NOTES.md quotes it.
//
// Build (from the repository root), e.g. against another include tree:
//   g++ -std=c++17 -O3 -DNDEBUG -g -fopenmp -Iinclude -Ibench
//       bench/tools/kernel_driver.cpp -o /tmp/kernel_driver -ltorch_cpu -lc10 -lbenchmark
// Run:   /tmp/kernel_driver <NHD|HND> <kind> B S ctx calls threads [format [isa]]
//        format: native (default), fp8 or int8 pages (K and V alike; the
//        memcpy kinds then copy codes + scales); isa: best (default),
//        portable, avx2 or avx512 (simd::ScopedIsa).
// Kinds: write (scalar start ctx), write_ragged (per-sequence starts),
//        write_adv (start ctx + call % 512: a slot not written for 512 calls),
//        gather (B x ctx tokens), gather_ragged, validate (checks::write_range
//        of every row only), raw_write (the scattered memcpys alone),
//        memcpy_write / memcpy_gather (the CopyLimit of the write / gather).
// Callgrind: valgrind --tool=callgrind --toggle-collect='void run_case<*'
//              /tmp/kernel_driver NHD write 256 1 1000 20 1
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "pagedkv/simd/isa.hpp"
#include "pagedkv/kv_format.hpp"

using namespace pagedkv_bench;

template <class L>
struct Case {
  std::unique_ptr<CopyLimit> limit;
  std::unique_ptr<pagedkv::PagedCache<L>> cache;
  at::Tensor table, k, v, starts, lengths;
  int64_t start = 0;
  int64_t calls = 0;
  std::string kind;
};

template <class L>
__attribute__((noinline)) void run_case(Case<L>& c, int iters) {
  for (int i = 0; i < iters; ++i) {
    if (c.kind == "write") {
      c.cache->write(0, c.table, c.start, c.k, c.v);
    } else if (c.kind == "write_adv") {
      c.cache->write(0, c.table, c.start + c.calls++ % 512, c.k, c.v);
    } else if (c.kind == "write_ragged") {
      c.cache->write(0, c.table, c.starts, c.k, c.v);
    } else if (c.kind == "gather") {
      benchmark::DoNotOptimize(c.cache->gather(0, c.table));
    } else if (c.kind == "gather_ragged") {
      benchmark::DoNotOptimize(c.cache->gather(0, c.table, c.lengths));
    } else if (c.kind.rfind("memcpy", 0) == 0) {
      c.limit->run();
    } else if (c.kind == "validate") {
      const pagedkv::checks::Caller caller{"PagedCache", L::name, "write"};
      pagedkv::visit_page_table(c.table, [&](const auto& t) {
        for (int64_t row = 0; row < t.rows; ++row)
          pagedkv::checks::write_range(caller, t, row, c.start, c.k.size(1), kPageSize, c.cache->pool());
      });
    } else if (c.kind == "raw_write") {  // NHD only: the scattered copies, no checks, no tensors
      const int64_t* t = c.table.template data_ptr<int64_t>();
      const int64_t cols = c.table.size(1);
      char* kc = static_cast<char*>(c.cache->k_cache().data_ptr());
      char* vc = static_cast<char*>(c.cache->v_cache().data_ptr());
      const char* k = static_cast<const char*>(c.k.data_ptr());
      const char* v = static_cast<const char*>(c.v.data_ptr());
      for (int64_t b = 0; b < c.table.size(0); ++b) {
        const int64_t page = t[b * cols + c.start / kPageSize];
        const int64_t off = (page * kPageSize + c.start % kPageSize) * kTokenBytes;
        std::memcpy(kc + off, k + b * kTokenBytes, kTokenBytes);
        std::memcpy(vc + off, v + b * kTokenBytes, kTokenBytes);
      }
      benchmark::ClobberMemory();
    }
  }
}

template <class L>
int go(const std::string& kind, int64_t B, int64_t S, int64_t ctx, int iters, pagedkv::KVQuant quant) {
  Case<L> c;
  c.kind = kind;
  c.start = ctx;
  const bool writes =
      kind.rfind("write", 0) == 0 || kind == "validate" || kind == "memcpy_write" || kind == "raw_write";
  const int64_t cols = writes ? pages_for(ctx + S + (kind == "write_adv" ? 512 : 0)) : pages_for(ctx);
  c.cache = std::make_unique<pagedkv::PagedCache<L>>(1, B * cols, kPageSize, kHeads, kHeadDim, half(), quant);
  c.table = shuffled_page_table(c.cache->pool(), B, cols, 11);
  const bool quantized = pagedkv::is_quantized(quant.k);
  at::manual_seed(5);  // an encoder's time depends on its inputs: gaussian, as a model's K/V
  c.k = quantized ? at::randn({B, S, kHeads, kHeadDim}).to(at::kHalf) : at::ones({B, S, kHeads, kHeadDim}, half());
  c.v = quantized ? at::randn({B, S, kHeads, kHeadDim}).to(at::kHalf) : at::ones({B, S, kHeads, kHeadDim}, half());
  std::vector<int64_t> starts, lengths;
  for (int64_t b = 0; b < B; ++b) {
    starts.push_back((b * 37) % (ctx + 1));
    lengths.push_back(1 + (b * 977) % std::max<int64_t>(ctx, 1));
  }
  c.starts = at::tensor(starts, at::kLong);
  c.lengths = at::tensor(lengths, at::kLong);
  const int64_t tokens = kind == "memcpy_gather" ? B * ctx : B * S;
  c.limit = std::make_unique<CopyLimit>(2 * tokens * page_token_bytes(quant));
  run_case(c, 2);
  std::vector<double> ts;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run_case(c, 1);
    ts.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  double mean = 0;
  for (double t : ts) mean += t / static_cast<double>(ts.size());
  std::sort(ts.begin(), ts.end());
  std::printf("%s %s %s %s B=%ld S=%ld ctx=%ld threads=%d: min %.1f p25 %.1f median %.1f p90 %.1f mean %.1f us\n",
              L::name, kind.c_str(), pagedkv::format_name(quant.k),
              pagedkv::simd::isa_name(pagedkv::simd::selected_isa()), static_cast<long>(B),
              static_cast<long>(S), static_cast<long>(ctx), at::get_num_threads(), ts[0], ts[ts.size() / 4],
              ts[ts.size() / 2], ts[ts.size() * 9 / 10], mean);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 8 || argc > 10) {
    std::fprintf(stderr, "usage: %s <NHD|HND> <kind> B S ctx calls threads [native|fp8|int8 [best|portable|avx2|avx512]]\n",
                 argv[0]);
    return 2;
  }
  const std::string format = argc > 8 ? argv[8] : "native";
  const pagedkv::KVFormat f = format == "fp8"    ? pagedkv::KVFormat::fp8_e4m3
                              : format == "int8" ? pagedkv::KVFormat::int8
                                                 : pagedkv::KVFormat::native;
  const std::string isa = argc > 9 ? argv[9] : "best";
  using pagedkv::simd::Isa;
  const pagedkv::simd::ScopedIsa scoped_isa(isa == "portable" ? Isa::portable
                                                         : isa == "avx2"   ? Isa::avx2
                                                         : isa == "avx512" ? Isa::avx512
                                                                           : Isa::best);
  const std::string layout = argv[1];
  const std::string kind = argv[2];
  at::set_num_threads(std::atoi(argv[7]));
  const int64_t B = std::atol(argv[3]), S = std::atol(argv[4]), ctx = std::atol(argv[5]);
  const int iters = std::atoi(argv[6]);
  return layout == "NHD" ? go<pagedkv::NHD>(kind, B, S, ctx, iters, {f, f})
                         : go<pagedkv::HND>(kind, B, S, ctx, iters, {f, f});
}
