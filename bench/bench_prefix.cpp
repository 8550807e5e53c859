// PrefixCache at a pool of 1M pages (page_size 16) with 100k cached pages
// (391 prompts of 4096 random tokens, registered and released, so every
// cached page is reclaimable). Bookkeeping only: bench/report lists these as
// plain times; `ns_per_page` is the figure of merit.
//   prefix/acquire_hit/P255     acquire of a cached 4096-token prompt: 255
//                               pages match (the last token is recomputed)
//   prefix/acquire_miss/P255    acquire of a 4096-token prompt whose first
//                               page misses (an empty sequence)
//   prefix/insert/P256          insert of a sequence's 256 written pages, all new
//   prefix/evict/P256           evict(256): the least recently used prompt's
//                               chain, leaf to root
// Each iteration times only that call (manual time, steady_clock around
// it); the bookkeeping that restores the state (release of the acquired
// sequence, a new sequence to insert, eviction back to 100k cached pages)
// runs outside the timing.
//
// Restores from the prefix tiers (issue 53): a 48-page prefix of a cache of
// 16 layers, 8 kv heads of 128, bfloat16, pages of 16 tokens (1 MiB of K/V
// per page), evicted into one tier (clear(), then the store's flush(),
// untimed), then loaded back by acquire (timed: every entry read, verified
// and copied into its page), beside the limit of the same bytes in the same
// run:
//   prefix_restore/host/P48/{memcpy,pagedkv}       host_store; memcpy of the entries' bytes
//   prefix_restore/disk/P48/{reference,pagedkv}    disk_store in a temporary directory;
//                                                  reference: open + read() + close of each
//                                                  entry's file into a pre-faulted buffer
//                                                  (the page cache is warm for both)
//   prefix_restore/disk/P48/read_copy              the floor of a restore that leaves the
//                                                  bytes in the pool: the reference's reads,
//                                                  each file then copied (streaming stores,
//                                                  as a restore copies) into its own slot of
//                                                  a pre-faulted 48-page destination
//   prefix_restore/disk_cold/P48/{reference,pagedkv}
//                                                  the same with the page cache dropped
//                                                  before each iteration (untimed: each
//                                                  file fdatasync'ed, then
//                                                  POSIX_FADV_DONTNEED; mincore confirms
//                                                  none of it stayed, else the rows error):
//                                                  both read from the disk
//   prefix_restore/redis/P48/{reference,pagedkv}   redis_store on a redis-server the suite
//                                                  starts on 127.0.0.1 (a free port);
//                                                  reference: one raw hiredis GET per entry
// Evictions into the tiers, on the same fixtures (the 48 pages cached on the
// device first, untimed: a restore, then the sequence released):
//   prefix_evict/{host,disk}/P48/{memcpy,pagedkv}  clear() of the 48 pages (timed: each
//                                                  page copied out of the pool into a new
//                                                  entry, checksummed and put; a disk
//                                                  store queues it for its thread, which
//                                                  writes while the next pages are copied);
//                                                  memcpy of the entries' bytes
// The redis rows exist when the suite is built with hiredis (pagedkv::redis)
// and redis-server is found; a server that does not start skips them with an
// error row. x_memcpy / x_faster_ref / x_faster_floor: the restore against
// its limit (the limit's time over pagedkv's: 0.5 = half the limit's speed).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "pagedkv/pagedkv.hpp"

#if defined(PAGEDKV_BENCH_REDIS)
#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "pagedkv/stores/redis.hpp"
#endif

namespace {

using namespace pagedkv_bench;  // NOLINT: the suite's helpers
using pagedkv::NHD;
using pagedkv::PagedCache;
using pagedkv::PrefixCache;
using pagedkv::SequenceTable;

constexpr int64_t kPoolPages = int64_t{1} << 20;
constexpr int64_t kPromptTokens = 4096;
constexpr int64_t kPromptPages = kPromptTokens / kPageSize;
constexpr int64_t kCachedPrompts = 391;  // 391 x 256 = 100,096 cached pages

/// The pool, table and prefix cache with 100k cached pages, and a source of
/// fresh random prompts (int64, as a tokenizer hands them over).
struct PrefixFixture {
  PrefixFixture()
      : cache(1, kPoolPages, kPageSize, 1, 1, half()), table(cache), prefix(table), rng(17) {
    for (int64_t p = 0; p < kCachedPrompts; ++p) {
      prompts.push_back(new_prompt());
      register_prompt(prompts.back());
    }
    TORCH_CHECK(prefix.n_cached() == kCachedPrompts * kPromptPages, "bench: setup cached ", prefix.n_cached());
  }

  at::Tensor new_prompt() { return at::randint(1, 32000, {kPromptTokens}, at::kLong); }

  /// A sequence that has written `tokens` (the K/V contents do not matter here).
  int64_t written(const at::Tensor& tokens) {
    const int64_t s = table.create();
    TORCH_CHECK(table.prepare_append(s, tokens.size(0)), "bench: pool too small");
    table.commit_append(s, tokens.size(0));
    return s;
  }

  void register_prompt(const at::Tensor& tokens) {
    const int64_t s = written(tokens);
    prefix.insert(s, tokens);
    table.release(s);
  }

  PagedCache<NHD> cache;
  SequenceTable<NHD> table;
  PrefixCache<NHD> prefix;
  std::vector<at::Tensor> prompts;
  std::mt19937_64 rng;
};

/// Times one call for the iteration and adds it to `total`.
class CallTimer {
 public:
  template <class F>
  void time(benchmark::State& state, F&& f) {
    const auto start = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(s);
    total_ += s;
  }
  /// Pages per call -> items processed and the mean ns per page.
  void report(benchmark::State& state, int64_t pages) const {
    const auto n = static_cast<double>(std::max<int64_t>(1, state.iterations()) * pages);
    state.SetItemsProcessed(state.iterations() * pages);
    state.counters["ns_per_page"] = total_ * 1e9 / n;
  }

 private:
  double total_ = 0;
};

void acquire_hit(benchmark::State& state) {
  PrefixFixture f;
  const at::Tensor prompt = f.prompts[f.prompts.size() / 2];
  CallTimer timer;
  for (auto _ : state) {
    std::pair<int64_t, int64_t> hit;
    timer.time(state, [&] { hit = f.prefix.acquire(prompt); });
    if (hit.second != kPromptTokens - kPageSize) std::abort();
    f.table.release(hit.first);
  }
  timer.report(state, kPromptPages - 1);
}

void acquire_miss(benchmark::State& state) {
  PrefixFixture f;
  const at::Tensor prompt = f.new_prompt();
  CallTimer timer;
  for (auto _ : state) {
    std::pair<int64_t, int64_t> hit;
    timer.time(state, [&] { hit = f.prefix.acquire(prompt); });
    if (hit.second != 0) std::abort();
    f.table.release(hit.first);
  }
  timer.report(state, kPromptPages - 1);
}

void insert(benchmark::State& state) {
  PrefixFixture f;
  CallTimer timer;
  for (auto _ : state) {
    const at::Tensor prompt = f.new_prompt();
    const int64_t s = f.written(prompt);
    int64_t fresh = 0;
    timer.time(state, [&] { fresh = f.prefix.insert(s, prompt); });
    if (fresh != kPromptPages) std::abort();
    f.table.release(s);
    f.prefix.evict(kPromptPages);  // back to 100k cached pages
  }
  timer.report(state, kPromptPages);
}

void evict(benchmark::State& state) {
  PrefixFixture f;
  CallTimer timer;
  for (auto _ : state) {
    f.register_prompt(f.new_prompt());  // 100k + 256 cached
    int64_t freed = 0;
    timer.time(state, [&] { freed = f.prefix.evict(kPromptPages); });
    if (freed != kPromptPages) std::abort();
  }
  timer.report(state, kPromptPages);
}

// ---- restores from the tiers ----

constexpr int64_t kTierPages = 48;

/// A pool holding one 48-page prompt of random K/V, a prefix cache over one
/// tier, and what the limits need.
struct TierFixture {
  explicit TierFixture(std::shared_ptr<pagedkv::PageStore> tier)
      : cache(16, kTierPages + 8, kPageSize, 8, 128, at::TensorOptions().dtype(at::kBFloat16)),
        table(cache),
        store(std::move(tier)),
        prefix(table, {store}),
        prompt(at::randint(1, 32000, {kTierPages * kPageSize + 1}, at::kLong)) {
    cache.k_cache().uniform_(-4, 4);
    cache.v_cache().uniform_(-4, 4);
    const int64_t s = table.create();
    TORCH_CHECK(table.prepare_append(s, prompt.size(0)), "bench: pool too small");
    table.commit_append(s, prompt.size(0));
    prefix.insert(s, prompt);
    table.release(s);
    evict();
    const auto g = pagedkv::page_store::Geometry::of(cache);
    for (int64_t j = 1; j <= kTierPages; ++j) bytes += static_cast<int64_t>(g.entry_bytes(j * kPageSize));
  }

  /// Every page of the prompt out of the pool and in the tier (written, for a disk or a server).
  void evict() {
    prefix.clear();
    flush();
  }

  /// Waits until the tier's entries are written (a disk, a server).
  void flush() {
    if (auto* disk = dynamic_cast<pagedkv::DiskStore*>(store.get())) disk->flush();
#if defined(PAGEDKV_BENCH_REDIS)
    if (auto* redis = dynamic_cast<pagedkv::stores::RedisStore*>(store.get())) redis->flush();
#endif
  }

  PagedCache<NHD> cache;
  SequenceTable<NHD> table;
  std::shared_ptr<pagedkv::PageStore> store;
  PrefixCache<NHD> prefix;
  at::Tensor prompt;
  int64_t bytes = 0;  // the entries' bytes: what a restore reads
};

/// Manual-time loop: `timed` per iteration, `untimed` after it; records the
/// time per iteration and the ratio counters (bench_support.hpp's convention).
template <class Timed, class Untimed>
void tier_loop(benchmark::State& state, const std::string& name, int64_t bytes, Timed&& timed, Untimed&& untimed) {
  const auto [case_name, variant] = split_name(name);
  ScopedThreads threads(threads_for(name));
  timed();  // warm-up
  untimed();
  double total = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    timed();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(s);
    total += s;
    untimed();
  }
  const double per_iter = total / static_cast<double>(std::max<int64_t>(1, state.iterations()));
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["threads"] = at::get_num_threads();
  auto& times = recorded_times();
  times[std::make_pair(case_name, variant)] = per_iter;
  if (variant != "pagedkv") return;
  const auto memcpy_time = times.find(std::make_pair(case_name, std::string("memcpy")));
  if (memcpy_time != times.end()) state.counters["x_memcpy"] = per_iter / memcpy_time->second;
  const auto reference = times.find(std::make_pair(case_name, std::string("reference")));
  if (reference != times.end()) state.counters["x_faster_ref"] = reference->second / per_iter;
  const auto floor = times.find(std::make_pair(case_name, std::string("read_copy")));
  if (floor != times.end()) state.counters["x_faster_floor"] = floor->second / per_iter;
}

/// A restore as the rows time it: acquire of the prompt, every page from
/// the tier; then, untimed, the sequence released and the pages evicted
/// into the tier again.
struct RestoreSteps {
  TierFixture& f;
  int64_t seq = -1;
  void acquire() {
    const auto hit = f.prefix.acquire(f.prompt);
    if (hit.second != kTierPages * kPageSize) std::abort();
    seq = hit.first;
  }
  void put_back() {
    f.table.release(seq);
    f.evict();
  }
};

/// The timed restore.
void restore(benchmark::State& state, const std::string& name, TierFixture& f) {
  RestoreSteps steps{f};
  tier_loop(state, name, f.bytes, [&] { steps.acquire(); }, [&] { steps.put_back(); });
}

/// A limit row: a memcpy of the tier's entries' bytes.
void copy_limit(benchmark::State& state, const std::string& name, TierFixture& f) {
  const CopyLimit limit(f.bytes);
  tier_loop(state, name, f.bytes, [&] { limit.run(); }, [] {});
}

/// The timed eviction: clear() of the prompt's 48 cached pages into the
/// tier; between evictions the pages come back (flush, acquire, release).
/// Leaves them in the tier, as the restore rows expect.
void evict_into(benchmark::State& state, const std::string& name, TierFixture& f) {
  const auto cache_again = [&] {
    f.flush();
    const auto hit = f.prefix.acquire(f.prompt);
    if (hit.second != kTierPages * kPageSize || f.prefix.n_cached() != kTierPages) std::abort();
    f.table.release(hit.first);
  };
  cache_again();
  tier_loop(state, name, f.bytes, [&] { f.prefix.clear(); }, cache_again);
  f.evict();
}

TierFixture& host_fixture() {
  return fixture<TierFixture>("prefix_restore/host",
                              [] { return std::make_unique<TierFixture>(pagedkv::host_store(int64_t{1} << 30)); });
}

/// A temporary directory with a disk tier in it, removed at the end.
struct DiskTierFixture {
  static std::string make_dir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pagedkv-bench-XXXXXX").string();
    TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "bench: mkdtemp failed");
    return pattern;
  }
  DiskTierFixture() : dir(make_dir()), tier(pagedkv::disk_store(dir, int64_t{1} << 30)) {
    for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path().string());
    TORCH_CHECK(static_cast<int64_t>(files.size()) == kTierPages, "bench: ", files.size(), " files in the tier");
    int64_t largest = 0;
    for (const auto& p : files) largest = std::max<int64_t>(largest, static_cast<int64_t>(std::filesystem::file_size(p)));
    buffer.assign(static_cast<size_t>(largest) + 4096, 1);  // pre-faulted
    // Page-aligned: the kernel's copy out of the page cache ran 2-6x slower
    // into a destination 8-24 bytes past a page (bench/NOTES.md, "Where in a
    // page a disk entry is read to"); the limit gets the fast placement.
    const uintptr_t start = reinterpret_cast<uintptr_t>(buffer.data());
    read_to = buffer.data() + (4096 - start % 4096) % 4096;
    read_size = static_cast<size_t>(largest);
  }
  ~DiskTierFixture() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  std::string dir;
  TierFixture tier;
  std::vector<std::string> files;
  std::vector<char> buffer;
  char* read_to = nullptr;  // page-aligned, in buffer
  size_t read_size = 0;     // the largest file
};

DiskTierFixture& disk_fixture() {
  return fixture<DiskTierFixture>("prefix_restore/disk", [] { return std::make_unique<DiskTierFixture>(); });
}

/// File `path` opened, read whole into f.read_to, closed: its size.
size_t read_file(const DiskTierFixture& f, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::abort();
  size_t done = 0;
  for (ssize_t r; (r = ::read(fd, f.read_to + done, f.read_size - done)) > 0;) done += static_cast<size_t>(r);
  ::close(fd);
  return done;
}

/// The disk limit: each entry's file read whole into one buffer.
void read_files(DiskTierFixture& f) {
  for (const auto& p : f.files) {
    read_file(f, p);
    benchmark::DoNotOptimize(f.read_to);
  }
}

/// Drops the directory's files from the page cache (written back first:
/// dirty pages cannot be dropped); returns the bytes that stayed resident,
/// by mincore (0 where dropping works; a tmpfs keeps everything).
int64_t drop_page_cache(const std::string& dir) {
  int64_t resident = 0;
  const long page = ::sysconf(_SC_PAGESIZE);
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    if (::fstat(fd, &st) == 0 && st.st_size > 0) {
      const size_t n = static_cast<size_t>(st.st_size);
      void* map = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
      if (map != MAP_FAILED) {
        std::vector<unsigned char> in_core((n + static_cast<size_t>(page) - 1) / static_cast<size_t>(page));
        if (::mincore(map, n, in_core.data()) == 0) {
          for (const unsigned char c : in_core) resident += (c & 1) * page;
        }
        ::munmap(map, n);
      }
    }
    ::close(fd);
  }
  return resident;
}

DiskTierFixture& disk_cold_fixture() {
  return fixture<DiskTierFixture>("prefix_restore/disk_cold", [] { return std::make_unique<DiskTierFixture>(); });
}

/// The cold rows: the page cache dropped after `untimed`, every iteration.
/// A file system that keeps its pages (tmpfs) errors the row: it would time
/// the warm case under the cold name.
template <class Timed, class Untimed>
void cold_loop(benchmark::State& state, const std::string& name, DiskTierFixture& f, Timed&& timed,
               Untimed&& untimed) {
  if (drop_page_cache(f.dir) != 0) {
    return state.SkipWithError(("the page cache of " + f.dir + " could not be dropped (tmpfs?)").c_str());
  }
  int64_t stayed = 0;
  tier_loop(state, name, f.tier.bytes, timed, [&] {
    untimed();
    stayed = std::max(stayed, drop_page_cache(f.dir));
  });
  state.counters["resident_after_drop"] = static_cast<double>(stayed);
}

/// The floor of a disk restore: read_files, and each file copied out of
/// the read buffer into its own slot of `pages` ([files, largest file],
/// pre-faulted), with the streaming stores a restore copies into its pages
/// with (cpu::use_streaming_stores: a restored page is a cold slot).
void read_and_copy(DiskTierFixture& f, std::vector<char>& pages) {
  for (size_t i = 0; i < f.files.size(); ++i) {
    const size_t done = read_file(f, f.files[i]);
    pagedkv::cpu::copy_run<true>(pages.data() + i * f.read_size, f.read_to, static_cast<int64_t>(done & ~size_t{15}));
  }
  pagedkv::cpu::streaming_fence();
  benchmark::DoNotOptimize(pages.data());
}

#if defined(PAGEDKV_BENCH_REDIS)

/// A redis-server of the suite's own on 127.0.0.1 (a free port, a temporary
/// directory, no persistence), as tests/test_redis_store.cpp starts one;
/// killed at the end.
class BenchRedisServer {
 public:
  BenchRedisServer() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pagedkv-bench-redis-XXXXXX").string();
    TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "bench: mkdtemp failed");
    dir_ = pattern;
    port_ = free_port();
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string port = std::to_string(port_);
      ::execl(PAGEDKV_REDIS_SERVER, PAGEDKV_REDIS_SERVER, "--port", port.c_str(), "--bind", "127.0.0.1", "--dir",
              dir_.c_str(), "--save", "", "--appendonly", "no", "--loglevel", "warning", "--logfile",
              (dir_ + "/log").c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 200 && !ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ~BenchRedisServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  BenchRedisServer(const BenchRedisServer&) = delete;
  BenchRedisServer& operator=(const BenchRedisServer&) = delete;

  bool ready() const {
    redisContext* c = connect();
    bool ok = false;
    if (c != nullptr && c->err == 0) {
      auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
      ok = r != nullptr && r->type == REDIS_REPLY_STATUS;
      if (r != nullptr) freeReplyObject(r);
    }
    if (c != nullptr) redisFree(c);
    return ok;
  }
  redisContext* connect() const {
    const timeval tv{1, 0};
    return port_ > 0 ? redisConnectWithTimeout("127.0.0.1", port_, tv) : nullptr;
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    int port = -1;
    if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      port = ntohs(addr.sin_port);
    if (fd >= 0) ::close(fd);
    return port;
  }

  std::string dir_;
  int port_ = -1;
  pid_t pid_ = -1;
};

/// The server, then a redis tier on it (and the keys its entries went to).
struct RedisTierFixture {
  RedisTierFixture() {
    if (!server.ready()) return;
    tier = std::make_unique<TierFixture>(pagedkv::redis_store(server.address()));
    conn = server.connect();
    auto* r = static_cast<redisReply*>(redisCommand(conn, "KEYS pagedkv:*"));
    if (r != nullptr && r->type == REDIS_REPLY_ARRAY) {
      for (size_t i = 0; i < r->elements; ++i) keys.emplace_back(r->element[i]->str, r->element[i]->len);
    }
    if (r != nullptr) freeReplyObject(r);
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == kTierPages, "bench: ", keys.size(), " keys on the server");
  }
  ~RedisTierFixture() {
    tier.reset();  // the store's connections go before the server
    if (conn != nullptr) redisFree(conn);
  }
  BenchRedisServer server;
  std::unique_ptr<TierFixture> tier;
  redisContext* conn = nullptr;
  std::vector<std::string> keys;
};

RedisTierFixture& redis_fixture() {
  return fixture<RedisTierFixture>("prefix_restore/redis", [] { return std::make_unique<RedisTierFixture>(); });
}

/// The redis limit: one raw GET per entry on one connection.
void get_keys(RedisTierFixture& f) {
  for (const auto& k : f.keys) {
    auto* r = static_cast<redisReply*>(redisCommand(f.conn, "GET %b", k.data(), k.size()));
    if (r == nullptr || r->type != REDIS_REPLY_STRING) std::abort();
    benchmark::DoNotOptimize(r->str);
    freeReplyObject(r);
  }
}

#endif  // PAGEDKV_BENCH_REDIS

void register_restores() {
  const auto manual = [](const std::string& name, std::function<void(benchmark::State&, const std::string&)> fn) {
    benchmark::RegisterBenchmark(name.c_str(), [fn, name](benchmark::State& state) { fn(state, name); })
        ->UseManualTime()
        ->MinTime(0.5)  // a restore is 10-150 ms: the suite's 0.1 s would time 1-7 of them
        ->Unit(benchmark::kMicrosecond);
  };
  const std::string p = "/P" + std::to_string(kTierPages);
  manual("prefix_restore/host" + p + "/memcpy",
         [](benchmark::State& state, const std::string& name) { copy_limit(state, name, host_fixture()); });
  manual("prefix_restore/host" + p + "/pagedkv",
         [](benchmark::State& state, const std::string& name) { restore(state, name, host_fixture()); });
  manual("prefix_evict/host" + p + "/memcpy",
         [](benchmark::State& state, const std::string& name) { copy_limit(state, name, host_fixture()); });
  manual("prefix_evict/host" + p + "/pagedkv",
         [](benchmark::State& state, const std::string& name) { evict_into(state, name, host_fixture()); });
  manual("prefix_restore/disk" + p + "/reference", [](benchmark::State& state, const std::string& name) {
    DiskTierFixture& f = disk_fixture();
    tier_loop(state, name, f.tier.bytes, [&] { read_files(f); }, [] {});
  });
  manual("prefix_restore/disk" + p + "/read_copy", [](benchmark::State& state, const std::string& name) {
    DiskTierFixture& f = disk_fixture();
    std::vector<char> pages(f.files.size() * f.read_size + 64, 1);  // pre-faulted, as the pool's pages are
    tier_loop(state, name, f.tier.bytes, [&] { read_and_copy(f, pages); }, [] {});
  });
  manual("prefix_restore/disk" + p + "/pagedkv",
         [](benchmark::State& state, const std::string& name) { restore(state, name, disk_fixture().tier); });
  manual("prefix_evict/disk" + p + "/memcpy",
         [](benchmark::State& state, const std::string& name) { copy_limit(state, name, disk_fixture().tier); });
  manual("prefix_evict/disk" + p + "/pagedkv",
         [](benchmark::State& state, const std::string& name) { evict_into(state, name, disk_fixture().tier); });
  manual("prefix_restore/disk_cold" + p + "/reference", [](benchmark::State& state, const std::string& name) {
    DiskTierFixture& f = disk_cold_fixture();
    cold_loop(state, name, f, [&] { read_files(f); }, [] {});
  });
  manual("prefix_restore/disk_cold" + p + "/pagedkv", [](benchmark::State& state, const std::string& name) {
    DiskTierFixture& f = disk_cold_fixture();
    RestoreSteps steps{f.tier};
    cold_loop(state, name, f, [&] { steps.acquire(); }, [&] { steps.put_back(); });
  });
#if defined(PAGEDKV_BENCH_REDIS)
  if (::access(PAGEDKV_REDIS_SERVER, X_OK) != 0) return;  // no redis-server: no redis rows
  manual("prefix_restore/redis" + p + "/reference", [](benchmark::State& state, const std::string& name) {
    RedisTierFixture& f = redis_fixture();
    if (f.tier == nullptr) return state.SkipWithError("redis-server did not start");
    tier_loop(state, name, f.tier->bytes, [&] { get_keys(f); }, [] {});
  });
  manual("prefix_restore/redis" + p + "/pagedkv", [](benchmark::State& state, const std::string& name) {
    RedisTierFixture& f = redis_fixture();
    if (f.tier == nullptr) return state.SkipWithError("redis-server did not start");
    restore(state, name, *f.tier);
  });
#endif
}

const bool registered = [] {
  const std::pair<const char*, void (*)(benchmark::State&)> cases[] = {
      {"prefix/acquire_hit/P255", acquire_hit},
      {"prefix/acquire_miss/P255", acquire_miss},
      {"prefix/insert/P256", insert},
      {"prefix/evict/P256", evict},
  };
  for (const auto& c : cases) {
    benchmark::RegisterBenchmark(c.first, c.second)->UseManualTime()->Unit(benchmark::kMicrosecond);
  }
  register_restores();
  return true;
}();

}  // namespace
