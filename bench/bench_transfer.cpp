// transfer/*: one sequence of 64 MiB (every layer, k and v) moved between two
// local processes over Gloo on 127.0.0.1, received by this process; the
// fp8 case moves the same 512 tokens from fp8 pages (codes and scales,
// 32.5 MiB):
//   memcpy     a memcpy of the same bytes (the local copy limit)
//   reference  a raw c10d recv of one contiguous tensor of the same bytes
//   pagedkv    recv_pages (header, reply, per-layer payload into staging,
//              scatter into fresh pages) plus freeing the pages
// x_faster_ref = raw time / pagedkv time: the fraction of the raw throughput
// pagedkv keeps (target >= 0.8).
//
// The sender is this binary re-executed (PAGEDKV_BENCH_TRANSFER_PORT set):
// it serves commands until told to stop, so the group is built once per case.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "pagedkv/transfer.hpp"

extern char** environ;

namespace pagedkv_bench {
namespace {

using Group = c10d::ProcessGroupGloo;
using std::chrono::milliseconds;

constexpr int64_t kLayers = 32;
constexpr int64_t kTransferBytes = int64_t{64} << 20;
constexpr int64_t kTransferTokens = kTransferBytes / (2 * kLayers * kTokenBytes);  // 512
constexpr int64_t kTransferPages = kTransferTokens / kPageSize;                    // 32
constexpr int64_t kPoolPages = 2 * kTransferPages;
constexpr int kCommandTag = 0x5100;
constexpr milliseconds kTimeout{60000};
enum Command : int64_t { quit = 0, raw = 1, paged = 2 };

c10::intrusive_ptr<Group> make_group(const c10::intrusive_ptr<c10d::Store>& store, int rank) {
  auto options = Group::Options::create(kTimeout);
  options->devices.push_back(Group::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<Group>(store, rank, 2, options);
}

template <class L>
std::unique_ptr<pagedkv::PagedCache<L>> transfer_cache(pagedkv::KVQuant quant) {
  return std::make_unique<pagedkv::PagedCache<L>>(kLayers, kPoolPages, kPageSize, kHeads, kHeadDim, half(), quant);
}

pagedkv::KVQuant quant_named(const std::string& name) {
  using pagedkv::KVFormat;
  return name == "fp8" ? pagedkv::KVQuant{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3} : pagedkv::KVQuant{};
}

/// Bytes a transfer of the case's tokens moves from pages stored as `quant`.
int64_t transfer_bytes(pagedkv::KVQuant quant) {
  if (!pagedkv::is_quantized(quant)) return kTransferBytes;
  const int64_t codes = kTransferBytes / 2;                                             // 1 byte per element
  const int64_t scales = 2 * kLayers * kTransferTokens * kHeads * int64_t{sizeof(float)};  // per (token, head)
  return codes + scales;
}

/// The sender: page ids shuffled over the pool, so the pack gathers.
template <class L>
[[noreturn]] void serve(uint16_t port, pagedkv::KVQuant quant) {
  c10d::TCPStoreOptions options;
  options.port = port;
  options.timeout = kTimeout;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  auto group = make_group(store, 1);
  at::set_num_threads(suite_threads());
  auto cache = transfer_cache<L>(quant);
  fill_pattern(cache->k_cache(), 1);
  fill_pattern(cache->v_cache(), 2);
  if (cache->k_scales().defined()) fill_pattern(cache->k_scales(), 5);
  if (cache->v_scales().defined()) fill_pattern(cache->v_scales(), 6);
  const at::Tensor table = shuffled_page_table(cache->pool(), 1, kTransferPages, 3);
  const at::Tensor pages = table[0];
  const at::Tensor contiguous = at::ones({transfer_bytes(quant)}, at::kByte);
  for (;;) {
    std::vector<at::Tensor> command{at::zeros({2}, at::kLong)};
    group->recv(command, 0, kCommandTag)->wait(kTimeout);
    const int64_t op = command[0][0].item<int64_t>();
    if (op == raw) {
      std::vector<at::Tensor> t{contiguous};
      group->send(t, 0, kCommandTag + 1)->wait(kTimeout);
    } else if (op == paged) {
      pagedkv::send_pages(*group, 0, *cache, pages, kTransferTokens, command[0][1].item<int64_t>(), kTimeout);
    } else {
      _exit(0);
    }
  }
}

/// This process's side of a case: the store, the sender process, the group.
template <class L>
struct TransferFixture {
  explicit TransferFixture(const std::string& format) {
    c10d::TCPStoreOptions options;
    options.port = 0;
    options.isServer = true;
    options.waitWorkers = false;
    options.timeout = kTimeout;
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
    std::vector<std::string> env_strings{"PAGEDKV_BENCH_TRANSFER_PORT=" + std::to_string(store->getPort()),
                                         std::string("PAGEDKV_BENCH_TRANSFER_LAYOUT=") + L::name,
                                         "PAGEDKV_BENCH_TRANSFER_FORMAT=" + format};
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    std::vector<char*> env;
    for (auto& e : env_strings) env.push_back(&e[0]);
    env.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    char* argv[] = {&exe[0], nullptr};
    TORCH_CHECK(posix_spawn(&peer, "/proc/self/exe", nullptr, nullptr, argv, env.data()) == 0,
                "bench transfer: cannot start the sender process");
    group = make_group(store, 0);
    cache = transfer_cache<L>(quant_named(format));
    received = at::empty({transfer_bytes(quant_named(format))}, at::kByte);
    fill_pattern(received, 4);
  }
  TransferFixture(const TransferFixture&) = delete;
  TransferFixture& operator=(const TransferFixture&) = delete;
  ~TransferFixture() {
    try {
      command(quit);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the kill below ends it either way
    }
    int status = 0;
    for (int i = 0; i < 200 && waitpid(peer, &status, WNOHANG) != peer; ++i) usleep(10000);
    ::kill(peer, SIGKILL);
    waitpid(peer, &status, 0);
  }

  void command(int64_t op) {
    std::vector<at::Tensor> t{pagedkv_bench_words(op, next_id)};
    group->send(t, 1, kCommandTag)->wait(kTimeout);
  }
  static at::Tensor pagedkv_bench_words(int64_t op, int64_t id) {
    at::Tensor t = at::empty({2}, at::kLong);
    t[0] = op;
    t[1] = id;
    return t;
  }

  void run_raw() {
    command(raw);
    std::vector<at::Tensor> t{received};
    group->recv(t, 1, kCommandTag + 1)->wait(kTimeout);
  }

  void run_pagedkv() {
    command(paged);
    const std::vector<int64_t> pages = pagedkv::recv_pages(*group, 1, *cache, next_id++, kTimeout);
    cache->pool().free_all(pages);
  }

  c10::intrusive_ptr<c10d::TCPStore> store;
  pid_t peer = -1;
  c10::intrusive_ptr<Group> group;
  std::unique_ptr<pagedkv::PagedCache<L>> cache;
  at::Tensor received;
  int64_t next_id = 1;
};

/// format: "" (fp16 pages) or "fp8".
template <class L>
void register_transfer(const std::string& format) {
  using F = TransferFixture<L>;
  const std::string case_name = std::string("transfer/") + L::name + (format.empty() ? "" : "/" + format) +
                                (format.empty() ? "/L32x512tok_64MiB" : "/L32x512tok");
  const int64_t bytes = transfer_bytes(quant_named(format));
  auto get = [case_name, format]() -> F& {
    return fixture<F>(case_name, [format] { return std::make_unique<F>(format); });
  };
  add(case_name + "/memcpy", [bytes](benchmark::State& state, const std::string& name) {
    const CopyLimit limit(bytes);
    timed_loop(state, name, bytes, [&] { limit.run(); });
  })->Iterations(20);
  add(case_name + "/reference", [get, bytes](benchmark::State& state, const std::string& name) {
    auto& f = get();
    timed_loop(state, name, bytes, [&] { f.run_raw(); });
  })->Iterations(20);
  add(case_name + "/pagedkv", [get, bytes](benchmark::State& state, const std::string& name) {
    auto& f = get();
    timed_loop(state, name, bytes, [&] { f.run_pagedkv(); });
  })->Iterations(20);
}

const bool kRegistered = [] {
  if (const char* port = std::getenv("PAGEDKV_BENCH_TRANSFER_PORT")) {
    // The sender process: serve, never return to benchmark's main.
    const std::string layout = std::getenv("PAGEDKV_BENCH_TRANSFER_LAYOUT");
    const pagedkv::KVQuant quant = quant_named(std::getenv("PAGEDKV_BENCH_TRANSFER_FORMAT"));
    if (layout == "HND") serve<pagedkv::HND>(static_cast<uint16_t>(std::atoi(port)), quant);
    serve<pagedkv::NHD>(static_cast<uint16_t>(std::atoi(port)), quant);
  }
  register_transfer<pagedkv::NHD>("");
  register_transfer<pagedkv::HND>("");
  register_transfer<pagedkv::NHD>("fp8");
  register_transfer<pagedkv::HND>("fp8");
  return true;
}();

}  // namespace
}  // namespace pagedkv_bench
