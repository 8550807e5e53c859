// Shared helpers for the pagedkv benchmarks (every bench/bench_*.cpp is
// linked into the one binary bench/pagedkv_bench).
//
// Naming convention (bench/report relies on it)
// ---------------------------------------------
// A data-moving benchmark is named `<case>/<variant>`: the variant is the
// last '/'-separated component, the case is everything before it (it may
// itself contain '/', e.g. `gather_decode/NHD/B32xT2048`). Google Benchmark
// appends suffixes such as `/real_time` or `/iterations:10`; bench/report
// drops every component that holds a `:` or is `real_time`, `manual_time`
// or `process_time` before splitting. Variants:
//
//   memcpy     the limit: memcpy (and memset, where the case must write
//              zeros) of exactly the bytes the case moves, between
//              pre-faulted buffers, on the same threads as `pagedkv`.
//   read       for cases that only read (decode attention): one vectorised
//              pass that reads the same bytes where they lie and writes
//              nothing, on the same threads: the limit of a kernel that
//              reads its bytes once (a memcpy also writes every byte).
//   reference  the baseline: a literal ATen port of the reference algorithm
//              (reference/paged_cache.py), or whatever the case compares to.
//   fma        for decode attention: the float32 multiply-adds it does (2 x
//              G x D per token and kv head) as FMAs in registers at the
//              core's peak, on the same threads (FmaLimit): the limit
//              where the arithmetic, not the reading, is the slower part.
//   sdpa       decode attention's peer: torch's scaled_dot_product_attention
//              on contiguous K/V (torch 2.5 and later; absent on 1.13).
//   pagedkv    the library call under test.
//
// Register them in that order (memcpy, read, fma, reference, sdpa, pagedkv):
// `timed_loop` records each variant's time per iteration, so the `pagedkv`
// (and `reference`, `sdpa`) benchmark can report, as counters of the same run,
//   x_memcpy       = its time / the memcpy time      (1.0 = at the limit)
//   x_read         = its time / the read time        (cases with a `read`)
//   x_fma          = its time / the fma time         (cases with an `fma`)
//   x_limit        = its time / the slower of read and fma: the tighter limit
//   x_faster_ref   = the reference time / its time   (pagedkv only)
//   x_faster_sdpa  = the sdpa time / its time        (pagedkv only)
// bench/report tables every case that has both a `pagedkv` and a `memcpy`
// variant (the read, reference and SDPA columns are blank when a case has
// none) and lists any other benchmark (e.g. `pool/...`) in a second table
// as plain times.
// All data-moving benchmarks measure wall time (UseRealTime): the kernels
// run on several threads.
//
// Threads: the suite runs with at::set_num_threads(hardware threads) (or
// PAGEDKV_BENCH_THREADS when set); cases whose name contains `/1thread`
// run with one thread (the "no regression at one thread" check).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bench_data.hpp"
#include "pagedkv/paged_cache.hpp"

namespace pagedkv_bench {

/// Google Benchmark's minimum time per benchmark (seconds); small so that
/// the whole suite runs in a few minutes on two cores. It is the default of
/// --benchmark_min_time (set before main parses the command line, so the
/// flag and the BENCHMARK_MIN_TIME variable still override it) rather than
/// a per-benchmark MinTime, which would forbid ->Iterations(n).
constexpr double kMinTime = 0.1;

}  // namespace pagedkv_bench

#if defined(PAGEDKV_BENCH_MIN_TIME_FLAG_IS_DOUBLE)  // Google Benchmark < 1.8 (bench/CMakeLists.txt)
namespace benchmark {
extern double FLAGS_benchmark_min_time;  // defined by libbenchmark, not declared by its 1.7 header
}  // namespace benchmark
namespace pagedkv_bench {
inline const bool kMinTimeDefaultSet = [] {
  if (std::getenv("BENCHMARK_MIN_TIME") == nullptr) benchmark::FLAGS_benchmark_min_time = kMinTime;
  return true;
}();
}  // namespace pagedkv_bench
#endif

namespace pagedkv_bench {

// ---- the machine, in the JSON output ----

/// The microarchitecture that /proc/cpuinfo's vendor, family and model
/// name ("Zen 3"), for the CPUs these benchmarks have met and their
/// neighbours; empty when the numbers are not in the table. A guest may be
/// handed an id that is not its host's: an Intel id without AMX whose flags
/// list amx_tile is named by its flags instead ("Sapphire Rapids class").
inline std::string microarchitecture_of(const std::string& vendor, int family, int model, const std::string& flags) {
  const auto in = [model](int first, int last) { return model >= first && model <= last; };
  if (vendor == "AuthenticAMD") {
    if (family == 0x17) return model < 0x30 ? "Zen / Zen+" : "Zen 2";
    if (family == 0x19) {
      if (in(0x00, 0x0F) || in(0x20, 0x5F)) return "Zen 3";
      if (in(0x10, 0x1F) || in(0x60, 0xAF)) return "Zen 4";
    }
    if (family == 0x1A) return "Zen 5";
    return "";
  }
  if (vendor == "GenuineIntel" && family == 6) {
    std::string name;
    switch (model) {
      case 0x55: name = "Skylake-SP / Cascade Lake"; break;
      case 0x6A: case 0x6C: name = "Ice Lake-SP"; break;
      case 0x8F: name = "Sapphire Rapids"; break;
      case 0xCF: name = "Emerald Rapids"; break;
      case 0xAD: case 0xAE: name = "Granite Rapids"; break;
      case 0xAF: name = "Sierra Forest"; break;
      case 0x8C: case 0x8D: name = "Tiger Lake"; break;
      case 0x97: case 0x9A: name = "Alder Lake"; break;
      case 0xB7: case 0xBA: case 0xBF: name = "Raptor Lake"; break;
      case 0xA7: name = "Rocket Lake"; break;
      default: break;
    }
    const bool amx_id = model == 0x8F || model == 0xCF || model == 0xAD || model == 0xAE;
    if (!amx_id && flags.find(" amx_tile ") != std::string::npos) {
      return "Sapphire Rapids class (by its flags: amx_tile" +
             std::string(flags.find(" avx512_fp16 ") != std::string::npos ? ", avx512_fp16" : "") + ")";
    }
    return name;
  }
  return "";
}

/// What the benchmarks say about the machine they ran on (from
/// /proc/cpuinfo where there is one), as custom context of the JSON output,
/// so that bench/report names the machine the numbers come from (never the
/// machine the report is made on).
struct CpuDescription {
  std::string model = "unknown";  ///< "model name"
  std::string extensions;         ///< the vector extensions pagedkv's kernels can use
  std::string microarchitecture;  ///< "Zen 3 (AuthenticAMD family 25 model 1)", or the ids alone
};

inline CpuDescription describe_cpu() {
  CpuDescription cpu;
  std::string flags, vendor;
  int family = -1, model = -1;
  if (FILE* f = std::fopen("/proc/cpuinfo", "r")) {
    char line[8192];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      const std::string l(line);
      const auto value = [&] {
        std::string v = l.substr(l.find(':') + 1);
        v.erase(0, v.find_first_not_of(" \t"));
        v.erase(v.find_last_not_of(" \t\n") + 1);
        return v;
      };
      const auto starts = [&](const char* key) { return l.rfind(key, 0) == 0; };
      if (starts("model name") && cpu.model == "unknown") cpu.model = value();
      if (starts("vendor_id") && vendor.empty()) vendor = value();
      if (starts("cpu family") && family < 0) family = std::atoi(value().c_str());
      if (starts("model") && !starts("model name") && model < 0) model = std::atoi(value().c_str());
      if (starts("flags") && flags.empty()) {
        // Appended, not `" " + value() + " "`: g++ 12 -Werror=restrict trips on that (a false positive).
        flags += ' ';
        flags += value();
        flags += ' ';
      }
    }
    std::fclose(f);
  }
  for (const char* ext : {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
                          "amx_tile", "neon", "asimd"}) {
    std::string needle(" ");
    needle += ext;
    needle += ' ';
    if (flags.find(needle) == std::string::npos) continue;
    if (!cpu.extensions.empty()) cpu.extensions += ' ';
    cpu.extensions += ext;
  }
  if (cpu.extensions.empty()) cpu.extensions = "none of avx2/avx512";
  if (!vendor.empty() && family >= 0 && model >= 0) {
    const std::string ids = vendor + " family " + std::to_string(family) + " model " + std::to_string(model);
    const std::string name = microarchitecture_of(vendor, family, model, flags);
    cpu.microarchitecture = name.empty() ? ids : name + " (" + ids + ")";
  }
  return cpu;
}

// ---- threads ----

/// Threads the suite runs with: PAGEDKV_BENCH_THREADS, else every hardware thread.
inline int suite_threads() {
  if (const char* env = std::getenv("PAGEDKV_BENCH_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// Sets at::set_num_threads(n) for one scope.
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : previous_(at::get_num_threads()) {
    if (n != previous_) at::set_num_threads(n);
  }
  ~ScopedThreads() {
    if (at::get_num_threads() != previous_) at::set_num_threads(previous_);
  }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int previous_;
};

/// Threads for a benchmark named `name`: 1 when the name holds "/1thread".
inline int threads_for(const std::string& name) {
  return name.find("/1thread") != std::string::npos ? 1 : suite_threads();
}

// ---- naming ----

/// Splits `<case>/<variant>` at the last '/'.
inline std::pair<std::string, std::string> split_name(const std::string& name) {
  const size_t slash = name.rfind('/');
  if (slash == std::string::npos) return {name, ""};
  return {name.substr(0, slash), name.substr(slash + 1)};
}

// ---- one shared fixture at a time ----

/// Returns the fixture for `key`, building it with `make` when the current
/// one has another key. Only one fixture lives at a time (the old one is
/// freed before the new one is built), so peak memory is one case's.
/// Variants of one case are registered together, so each case is built once.
inline std::pair<std::string, std::shared_ptr<void>>& fixture_slot() {
  static std::pair<std::string, std::shared_ptr<void>> slot;
  return slot;
}

template <class T>
T& fixture(const std::string& key, const std::function<std::unique_ptr<T>()>& make) {
  auto& [current_key, current] = fixture_slot();
  if (current == nullptr || current_key != key) {
    current.reset();
    current_key = key;
    current = std::shared_ptr<T>(make());
  }
  return *static_cast<T*>(current.get());
}

// ---- the memcpy limit ----

/// Bytes per at::parallel_for chunk of the memcpy baseline: a copy of at most
/// this runs on one thread. Measured (bench/NOTES.md, "Threads and grain
/// sizes (issue 3, change 8)"): two threads lose below 64 KiB and win from
/// 128 KiB, as for the kernels' pagedkv::cpu::kChunkBytes.
constexpr int64_t kMemcpyGrain = int64_t{64} << 10;

/// memcpy of `copy_bytes` plus memset of `zero_bytes`, between buffers that
/// are allocated and touched once up front (no page faults while timed).
class CopyLimit {
 public:
  explicit CopyLimit(int64_t copy_bytes, int64_t zero_bytes = 0)
      : copy_bytes_(copy_bytes),
        zero_bytes_(zero_bytes),
        src_(at::empty({std::max<int64_t>(copy_bytes, 1)}, at::kByte)),
        dst_(at::empty({std::max<int64_t>(copy_bytes + zero_bytes, 1)}, at::kByte)) {
    std::memset(src_.data_ptr(), 1, static_cast<size_t>(src_.numel()));
    std::memset(dst_.data_ptr(), 0, static_cast<size_t>(dst_.numel()));
  }

  /// One copy (parallel over kMemcpyGrain-byte chunks).
  void run() const {
    char* dst = static_cast<char*>(dst_.data_ptr());
    const char* src = static_cast<const char*>(src_.data_ptr());
    const int64_t copy = copy_bytes_;
    at::parallel_for(0, copy_bytes_ + zero_bytes_, kMemcpyGrain, [&](int64_t begin, int64_t end) {
      if (begin < copy) {
        const int64_t stop = std::min(end, copy);
        std::memcpy(dst + begin, src + begin, static_cast<size_t>(stop - begin));
        begin = stop;
      }
      if (begin < end) std::memset(dst + begin, 0, static_cast<size_t>(end - begin));
    });
    benchmark::DoNotOptimize(dst);
    benchmark::ClobberMemory();
  }

  int64_t bytes() const { return copy_bytes_ + zero_bytes_; }

 private:
  int64_t copy_bytes_;
  int64_t zero_bytes_;
  at::Tensor src_;
  at::Tensor dst_;
};

// ---- the read-only limit ----

/// A vectorised pass that reads `spans` (a kernel's input bytes, where they
/// lie) and writes nothing but one word per chunk: the limit of a kernel
/// that reads each byte once and writes little (decode attention). Parallel
/// over kMemcpyGrain-byte chunks of the spans taken end to end, as the
/// memcpy is, so each thread reads a contiguous share in memory order. The
/// words read are XOR-ed together and kept, so no load can be dropped.
class ReadLimit {
 public:
  struct Span {
    const char* data;  // [bytes]
    int64_t bytes;
  };

  explicit ReadLimit(std::vector<Span> spans) : spans_(std::move(spans)) {
    for (const Span& s : spans_) bytes_ += s.bytes;
  }

  /// One pass; returns the XOR of everything read (kept by the caller).
  uint64_t run() const {
    std::atomic<uint64_t> folded{0};
    at::parallel_for(0, bytes_, kMemcpyGrain, [&](int64_t begin, int64_t end) {
      uint64_t x = 0;
      int64_t base = 0;  // offset of the span `s` in the spans taken end to end
      for (const Span& s : spans_) {
        const int64_t from = std::max(begin, base), to = std::min(end, base + s.bytes);
        if (from < to) x ^= read_bytes(s.data + (from - base), to - from);
        base += s.bytes;
      }
      folded.fetch_xor(x, std::memory_order_relaxed);
    });
    const uint64_t result = folded.load();
    benchmark::DoNotOptimize(result);
    return result;
  }

  int64_t bytes() const { return bytes_; }

 private:
  /// XOR of the bytes at p[0, n), with AVX2 where the CPU has it (16-byte
  /// SSE2 loads read 256 MiB 10-20 % slower on the Zen 3 guest in a scratch
  /// test, under load: a hint only; a limit must not be slowed by its loop).
  static uint64_t read_bytes(const char* p, int64_t n) noexcept {
#if defined(__GNUC__) && defined(__x86_64__)
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) return read_bytes_avx2(p, n);
#endif
    return read_bytes_portable(p, n);
  }

  /// Four independent accumulators of 16 bytes (SSE2 on any x86-64; the
  /// compiler's 16-byte vectors elsewhere).
  static uint64_t read_bytes_portable(const char* p, int64_t n) noexcept {
    using Lanes = uint64_t __attribute__((vector_size(16)));
    const auto load = [p](int64_t at) {
      Lanes v;
      std::memcpy(&v, p + at, sizeof(v));
      return v;
    };
    Lanes a = {}, b = {}, c = {}, d = {};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      a ^= load(i);
      b ^= load(i + 16);
      c ^= load(i + 32);
      d ^= load(i + 48);
    }
    const Lanes all = a ^ b ^ c ^ d;
    uint64_t x = all[0] ^ all[1];
    for (; i < n; ++i) x ^= static_cast<uint8_t>(p[i]);
    return x;
  }

#if defined(__GNUC__) && defined(__x86_64__)
  __attribute__((target("avx2"))) static uint64_t read_bytes_avx2(const char* p, int64_t n) noexcept {
    const auto* v = reinterpret_cast<const __m256i*>(p);
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    int64_t i = 0;
    for (; i + 128 <= n; i += 128, v += 4) {
      a = _mm256_xor_si256(a, _mm256_loadu_si256(v));
      b = _mm256_xor_si256(b, _mm256_loadu_si256(v + 1));
      c = _mm256_xor_si256(c, _mm256_loadu_si256(v + 2));
      d = _mm256_xor_si256(d, _mm256_loadu_si256(v + 3));
    }
    a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    const __m128i half = _mm_xor_si128(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    uint64_t x = static_cast<uint64_t>(_mm_cvtsi128_si64(half)) ^ static_cast<uint64_t>(_mm_extract_epi64(half, 1));
    for (; i < n; ++i) x ^= static_cast<uint8_t>(p[i]);
    return x;
  }
#endif

  std::vector<Span> spans_;
  int64_t bytes_ = 0;
};

// ---- the arithmetic limit ----

/// The float32 multiply-adds of a kernel at the core's peak: `multiply_adds`
/// of them as FMAs on independent chains in registers, on the same threads,
/// with no loads, conversions or reductions. Decode attention multiplies
/// every K and V element into each query row of its GQA group (2 x G x D
/// per token and kv head); where that arithmetic at peak takes longer than
/// the read pass (two 256-bit FMA pipes against one core's read bandwidth:
/// Zen 3, Zen 4; bench/NOTES.md), it is the tighter limit of the two. The
/// vector width is whichever of 256 and 512 bits runs more multiply-adds
/// per second here, timed once per process on one thread: 512-bit FMAs
/// double the rate on cores with two 512-bit pipes, not on cores that split
/// them in two (Zen 4).
class FmaLimit {
 public:
  explicit FmaLimit(int64_t multiply_adds) : multiply_adds_(multiply_adds) {}

  /// Whether this CPU has FMAs to measure (x86-64 with AVX2 and FMA).
  static bool available() noexcept {
#if defined(__GNUC__) && defined(__x86_64__)
    static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return has;
#else
    return false;
#endif
  }

  /// The width run() uses, 256 or 512 (0 where !available()).
  static int width_bits() {
    static const int bits = faster_width();
    return bits;
  }

  /// One pass over every multiply-add; returns a sum of the chains (kept by
  /// the caller).
  float run() const {
    const int bits = width_bits();
    const int64_t per_block = bits == 512 ? kChains * 16 : kChains * 8;
    const int64_t blocks = (multiply_adds_ + per_block - 1) / per_block;
    std::atomic<uint32_t> folded{0};
    at::parallel_for(0, blocks, kBlocksPerGrain, [&](int64_t begin, int64_t end) {
      const float x = chains(bits, end - begin);
      uint32_t bits_of_x = 0;
      std::memcpy(&bits_of_x, &x, sizeof(x));
      folded.fetch_xor(bits_of_x, std::memory_order_relaxed);
    });
    const uint32_t result = folded.load();
    benchmark::DoNotOptimize(result);
    float out = 0.0f;
    std::memcpy(&out, &result, sizeof(out));
    return out;
  }

 private:
  /// Independent chains per block: more than FMA latency x pipes (4 x 2) on
  /// every core here, and few enough for AVX2's 16 registers.
  static constexpr int kChains = 12;
  /// Blocks per parallel chunk (~1.5 M multiply-adds at 256 bits).
  static constexpr int64_t kBlocksPerGrain = int64_t{1} << 14;

  /// `blocks` rounds of kChains FMAs of `bits`-bit vectors.
  static float chains(int bits, int64_t blocks) noexcept {
#if defined(__GNUC__) && defined(__x86_64__)
    if (bits == 512) return chains_avx512(blocks);
    if (bits == 256) return chains_avx2(blocks);
#endif
    (void)blocks;
    return 0.0f;
  }

  /// 256 or 512, whichever ran 2^26 multiply-adds faster on this thread
  /// (best of three each).
  static int faster_width() {
    if (!available()) return 0;
#if defined(__GNUC__) && defined(__x86_64__)
    if (!__builtin_cpu_supports("avx512f")) return 256;
    const auto best_seconds = [](int bits) {
      const int64_t blocks = (int64_t{1} << 26) / (bits == 512 ? kChains * 16 : kChains * 8);
      double best = 1e30;
      for (int i = 0; i < 3; ++i) {
        const auto start = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(chains(bits, blocks));
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      return best;
    };
    return best_seconds(512) < best_seconds(256) ? 512 : 256;
#else
    return 0;
#endif
  }

#if defined(__GNUC__) && defined(__x86_64__)
  // acc = acc * c + d converges to 1 (no overflow, no subnormals) and keeps
  // each chain's FMAs dependent on the last, as an accumulation's are.
  __attribute__((target("avx2,fma"))) static float chains_avx2(int64_t blocks) noexcept {
    const __m256 c = _mm256_set1_ps(0.999f), d = _mm256_set1_ps(0.001f);
    __m256 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
    for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], c, d);
    }
    __m256 sum = acc[0];
    for (int i = 1; i < kChains; ++i) sum = _mm256_add_ps(sum, acc[i]);
    return _mm_cvtss_f32(_mm256_castps256_ps128(sum));
  }

  __attribute__((target("avx512f"))) static float chains_avx512(int64_t blocks) noexcept {
    const __m512 c = _mm512_set1_ps(0.999f), d = _mm512_set1_ps(0.001f);
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
    for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], c, d);
    }
    __m512 sum = acc[0];
    for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
    return _mm512_cvtss_f32(sum);
  }
#endif

  int64_t multiply_adds_;
};

// ---- timing and ratio counters ----

/// Seconds per iteration of each (case, variant) measured so far in this run.
inline std::map<std::pair<std::string, std::string>, double>& recorded_times() {
  static std::map<std::pair<std::string, std::string>, double> times;
  return times;
}

/// Runs the benchmark loop over `body` (on the case's threads), reports
/// `bytes` per iteration as bytes processed, records the wall time per
/// iteration, and sets the ratio counters of the naming convention.
template <class F>
void timed_loop(benchmark::State& state, const std::string& name, int64_t bytes, F&& body) {
  const auto [case_name, variant] = split_name(name);
  ScopedThreads threads(threads_for(name));
  body();  // warm-up: first-touch effects stay out of the timing
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) body();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double per_iter = seconds / static_cast<double>(std::max<int64_t>(1, state.iterations()));
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["threads"] = at::get_num_threads();
  auto& times = recorded_times();
  times[std::make_pair(case_name, variant)] = per_iter;
  const auto recorded = [&](const char* other) {
    const auto it = times.find(std::make_pair(case_name, std::string(other)));
    return it == times.end() ? 0.0 : it->second;
  };
  if (variant != "memcpy" && variant != "read" && variant != "fma") {
    if (const double limit = recorded("memcpy"); limit > 0) state.counters["x_memcpy"] = per_iter / limit;
    if (const double limit = recorded("read"); limit > 0) state.counters["x_read"] = per_iter / limit;
    if (const double limit = recorded("fma"); limit > 0) {
      state.counters["x_fma"] = per_iter / limit;
      state.counters["x_limit"] = per_iter / std::max(limit, recorded("read"));
    }
  }
  if (variant == "pagedkv") {
    if (const double reference = recorded("reference"); reference > 0) {
      state.counters["x_faster_ref"] = reference / per_iter;
    }
    if (const double sdpa = recorded("sdpa"); sdpa > 0) state.counters["x_faster_sdpa"] = sdpa / per_iter;
  }
}

/// Registers one variant with the suite's settings (wall time, microseconds);
/// `fn` gets the benchmark's name (for timed_loop: Google Benchmark 1.7's
/// State does not know it).
inline benchmark::internal::Benchmark* add(const std::string& name,
                                           std::function<void(benchmark::State&, const std::string&)> fn) {
  return benchmark::RegisterBenchmark(name.c_str(), [fn, name](benchmark::State& state) { fn(state, name); })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace pagedkv_bench
