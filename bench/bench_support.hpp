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
//   reference  the baseline: a literal ATen port of the reference algorithm
//              (reference/paged_cache.py), or whatever the case compares to.
//   pagedkv    the library call under test.
//
// Register them in that order (memcpy, reference, pagedkv): `timed_loop`
// records each variant's time per iteration, so the `pagedkv` (and
// `reference`) benchmark can report, as counters of the same run,
//   x_memcpy      = its time / the memcpy time      (1.0 = at the limit)
//   x_faster_ref  = the reference time / its time   (pagedkv only)
// bench/report tables every case that has both a `pagedkv` and a `memcpy`
// variant (the reference column is blank when a case has none) and lists
// any other benchmark (e.g. `pool/...`) in a second table as plain times.
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

/// The CPU's model name and the vector extensions pagedkv's kernels can
/// use (from /proc/cpuinfo where there is one), and the instruction set the
/// attention kernel picks, as custom context of the benchmark's output, so
/// that bench/report names the machine the numbers come from (never the
/// machine the report is made on).
inline std::pair<std::string, std::string> cpu_model_and_extensions() {
  std::string model = "unknown", flags;
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
      if (l.rfind("model name", 0) == 0 && model == "unknown") model = value();
      if (l.rfind("flags", 0) == 0 && flags.empty()) {
        // Appended, not `" " + value() + " "`: g++ 12 -Werror=restrict trips on that (a false positive).
        flags += ' ';
        flags += value();
        flags += ' ';
      }
    }
    std::fclose(f);
  }
  std::string extensions;
  for (const char* ext : {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
                          "amx_tile", "neon", "asimd"}) {
    std::string needle(" ");
    needle += ext;
    needle += ' ';
    if (flags.find(needle) == std::string::npos) continue;
    if (!extensions.empty()) extensions += ' ';
    extensions += ext;
  }
  return {model, extensions.empty() ? "none of avx2/avx512" : extensions};
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

/// Bytes per at::parallel_for chunk of the memcpy baseline: a copy of at
/// most this runs on one thread. Measured (bench/NOTES.md, "threads"): two
/// threads lose below 64 KiB and win from 128 KiB, as for the kernels'
/// pagedkv::kernels::kChunkBytes.
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
  if (variant != "memcpy") {
    const auto limit = times.find(std::make_pair(case_name, std::string("memcpy")));
    if (limit != times.end()) state.counters["x_memcpy"] = per_iter / limit->second;
  }
  if (variant == "pagedkv") {
    const auto reference = times.find(std::make_pair(case_name, std::string("reference")));
    if (reference != times.end()) state.counters["x_faster_ref"] = reference->second / per_iter;
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
