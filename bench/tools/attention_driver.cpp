// Scratch driver for the CPU decode attention kernel, outside Google
// Benchmark: times paged_attention on one decode case (fp16 or bf16, 8 kv
// heads x 128, 32 query heads, pages of 16, a shuffled page table, as
// bench/bench_attention.cpp) and prints the minimum and median of N calls.
// Cases small enough to stay in the caches (B2xT2048 = 16 MiB, B1xT256)
// give the kernel's arithmetic speed; B32xT2048 (256 MiB) its speed from
// memory. Not part of the build; bench/NOTES.md quotes it ("Where decode
// attention's time goes on Zen 3").
//
// Build (from the repository root), e.g. against Debian's libtorch:
//   g++ -std=c++17 -O3 -DNDEBUG -g -fopenmp -Iinclude -I/usr/include/torch/csrc/api/include
//       bench/tools/attention_driver.cpp -o /tmp/attention_driver -ltorch_cpu -lc10
// Run:   /tmp/attention_driver <NHD|HND> B T calls threads [fp16|bf16|fp8|int8] [query heads] [queries]
// (fp8 and int8: fp16 in and out over pages of those codes; query heads:
// 32 by default, 64 for a GQA group of 8; queries: per sequence, 1 by
// default (decode), more for a chunk of prefill: the general item loop).
// ISA=avx2 (or portable, avx512) in the environment picks the kernel path
// (ScopedIsa; at one thread, where the calls run on the calling thread);
// DECODE_STEP=avx2 or avx512 the AVX-512 path's decode step (ScopedDecodeStep).
// With bench/tools/attention_touch_only.patch applied to the headers first
// and TOUCH_ONLY=1 in the environment, the AVX2 score and value loops only
// load each 64-byte line of K and V once: what is left is the kernel's
// frame (block rows, softmax, prefetch) and its order of reading memory.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "pagedkv/attention.hpp"
#include "pagedkv/paged_cache.hpp"

template <class Layout>
void run(int64_t batch, int64_t tokens, at::ScalarType dtype, pagedkv::KVFormat format, int64_t query_heads,
         int64_t queries, int calls) {
  constexpr int64_t kPageSize = 16, kHeads = 8, kHeadDim = 128;
  const int64_t cols = (tokens + kPageSize - 1) / kPageSize;
  pagedkv::PagedCache<Layout> cache(1, batch * cols, kPageSize, kHeads, kHeadDim, at::TensorOptions().dtype(dtype),
                                    pagedkv::KVQuant{format, format});
  std::vector<int64_t> ids = cache.pool().alloc_n(batch * cols);
  std::mt19937_64 rng(17);
  std::shuffle(ids.begin(), ids.end(), rng);
  const at::Tensor table = at::tensor(ids, at::kLong).view({batch, cols});
  at::manual_seed(21);
  cache.write(0, table, 0, at::randn({batch, tokens, kHeads, kHeadDim}).to(dtype),
              at::randn({batch, tokens, kHeads, kHeadDim}).to(dtype));
  const at::Tensor lengths = at::full({batch}, tokens, at::kLong);
  const char* isa_env = std::getenv("ISA");
  const std::string isa = isa_env ? isa_env : "best";
  const pagedkv::simd::Isa chosen = isa == "avx2" ? pagedkv::simd::Isa::avx2
                              : isa == "avx512" ? pagedkv::simd::Isa::avx512
                              : isa == "portable" ? pagedkv::simd::Isa::portable
                                                  : pagedkv::simd::Isa::best;
  const pagedkv::simd::ScopedIsa scoped(chosen);
  const char* step_env = std::getenv("DECODE_STEP");
  const std::string step = step_env ? step_env : "best";
  const pagedkv::cpu::attention::ScopedDecodeStep scoped_step(
      step == "avx2"     ? pagedkv::cpu::attention::DecodeStep::avx2
      : step == "avx512" ? pagedkv::cpu::attention::DecodeStep::avx512
                         : pagedkv::cpu::attention::DecodeStep::best);
  const at::Tensor q = at::randn({batch, queries, query_heads, kHeadDim}).to(dtype);
  const auto view = cache.bind(table, lengths);
  std::vector<double> ms;
  at::Tensor out;
  for (int i = 0; i < calls; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    out = pagedkv::paged_attention(view, 0, q, 0.088);
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double bytes = static_cast<double>(batch * tokens * kHeads * kHeadDim * 2) *
                       (pagedkv::is_quantized(format) ? 1.0 : static_cast<double>(at::elementSize(dtype)));
  std::printf("%s %s B%ldxT%ld: min %.3f ms  median %.3f ms  %.1f GB/s (min)  checksum %.6f\n",
              Layout::name, isa.c_str(), static_cast<long>(batch), static_cast<long>(tokens), ms[0], ms[ms.size() / 2],
              bytes / ms[0] / 1e6, out.to(at::kFloat).abs().sum().item<double>());
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s <NHD|HND> B T calls threads [fp16|bf16|fp8|int8] [query heads] [queries]\n",
                 argv[0]);
    return 2;
  }
  const std::string layout = argv[1];
  const int64_t batch = std::atol(argv[2]), tokens = std::atol(argv[3]);
  const int calls = std::max(1, std::atoi(argv[4]));
  at::set_num_threads(std::atoi(argv[5]));
  const std::string kind = argc > 6 ? argv[6] : "fp16";
  const at::ScalarType dtype = kind == "bf16" ? at::kBFloat16 : at::kHalf;
  const pagedkv::KVFormat format = kind == "fp8"    ? pagedkv::KVFormat::fp8_e4m3
                                   : kind == "int8" ? pagedkv::KVFormat::int8
                                                    : pagedkv::KVFormat::native;
  const int64_t query_heads = argc > 7 ? std::atol(argv[7]) : 32;
  const int64_t queries = argc > 8 ? std::max(1L, std::atol(argv[8])) : 1;
  if (layout == "NHD") {
    run<pagedkv::NHD>(batch, tokens, dtype, format, query_heads, queries, calls);
  } else {
    run<pagedkv::HND>(batch, tokens, dtype, format, query_heads, queries, calls);
  }
  return 0;
}
