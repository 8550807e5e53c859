// Disaggregated prefill/decode over pagedkv's page transfer (Gloo, 127.0.0.1).
//
// The launcher starts two processes of this binary: a prefill worker (rank
// 0) and a decode worker (rank 1), joined by a TCPStore and a Gloo process
// group. The prefill worker runs a small decoder over a batch of prompts,
// one prompt at a time, and sends each sequence's KV (send_sequence) plus
// its last hidden state. The decode worker receives them (recv_sequence),
// decodes N steps for the whole batch with paged_attention, then repeats
// the whole computation in one process and checks that every decode step
// matches (float32: max abs difference 0). With --kv-format fp8 or int8
// both caches store quantized pages, and their codes and scales travel.
//
//   disaggregated [--batch 4] [--steps 16] [--max-prompt 200] [--page-size 16]
//                 [--prefill-layout nhd|hnd] [--decode-layout nhd|hnd]
//                 [--kv-format native|fp8|int8] [--seed 0] [--timeout-ms 30000]
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "pagedkv/pagedkv.hpp"
#include "pagedkv/transfer.hpp"

extern char** environ;

namespace {

using Group = c10d::ProcessGroupGloo;
using Clock = std::chrono::steady_clock;

struct Options {
  int64_t batch = 4;
  int64_t steps = 16;
  int64_t max_prompt = 200;
  int64_t page_size = 16;
  std::string prefill_layout = "nhd";
  std::string decode_layout = "hnd";
  pagedkv::KVQuant quant;  // both caches' K and V (--kv-format)
  int64_t seed = 0;
  int64_t timeout_ms = 30000;
  std::string role;  // internal: prefill | decode
  int64_t port = 0;  // internal: the launcher's TCPStore
};

constexpr int64_t kLayers = 4;
constexpr int64_t kQueryHeads = 8;
constexpr int64_t kKvHeads = 2;
constexpr int64_t kHeadDim = 64;
constexpr int64_t kHidden = kQueryHeads * kHeadDim;
constexpr int kHiddenTag = 1;  // the engine's own message: the prompt's last hidden state

void usage(const char* argv0) {
  std::printf(
      "usage: %s [options]\n"
      "Disaggregated serving on one machine: a prefill process computes the KV of a batch of\n"
      "prompts and sends each sequence to a decode process over a Gloo process group\n"
      "(127.0.0.1); the decode process decodes N steps with paged attention and checks the\n"
      "result against the same computation in one process (float32: max abs difference 0).\n\n"
      "  --batch N                 prompts (default 4)\n"
      "  --steps N                 decode steps (default 16)\n"
      "  --max-prompt N            prompt lengths are drawn from [N/4, N] (default 200)\n"
      "  --page-size N             tokens per page on both sides (default 16)\n"
      "  --prefill-layout nhd|hnd  the prefill cache's page layout (default nhd)\n"
      "  --decode-layout nhd|hnd   the decode cache's page layout (default hnd)\n"
      "  --kv-format native|fp8|int8  how both caches store K and V (default native)\n"
      "  --seed N                  weights and prompts (default 0)\n"
      "  --timeout-ms N            per transfer (default 30000)\n"
      "  --help                    this text\n",
      argv0);
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      usage(argv[0]);
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s: %s needs a value (see --help)\n", argv[0], arg.c_str());
      return false;
    }
    const std::string value = argv[++i];
    char* end = nullptr;
    const long long number = std::strtoll(value.c_str(), &end, 10);
    const bool numeric = end != value.c_str() && *end == '\0';
    const bool layout = value == "nhd" || value == "hnd";
    if (arg == "--batch" && numeric && number >= 1) {
      o.batch = number;
    } else if (arg == "--steps" && numeric && number >= 0) {
      o.steps = number;
    } else if (arg == "--max-prompt" && numeric && number >= 4) {
      o.max_prompt = number;
    } else if (arg == "--page-size" && numeric && number >= 1) {
      o.page_size = number;
    } else if (arg == "--prefill-layout" && layout) {
      o.prefill_layout = value;
    } else if (arg == "--decode-layout" && layout) {
      o.decode_layout = value;
    } else if (arg == "--kv-format" && (value == "native" || value == "fp8" || value == "int8")) {
      const pagedkv::KVFormat f = value == "fp8"    ? pagedkv::KVFormat::fp8_e4m3
                                  : value == "int8" ? pagedkv::KVFormat::int8
                                                    : pagedkv::KVFormat::native;
      o.quant = {f, f};
    } else if (arg == "--seed" && numeric && number >= 0) {
      o.seed = number;
    } else if (arg == "--timeout-ms" && numeric && number >= 1) {
      o.timeout_ms = number;
    } else if (arg == "--role" && (value == "prefill" || value == "decode")) {
      o.role = value;
    } else if (arg == "--port" && numeric && number > 0 && number < 65536) {
      o.port = number;
    } else {
      std::fprintf(stderr, "%s: bad option %s %s (see --help)\n", argv[0], arg.c_str(), value.c_str());
      return false;
    }
  }
  return true;
}

// ---- the model: both processes build it from the seed ----

struct LayerWeights {
  at::Tensor wq, wk, wv, wo;  // [hidden, hidden], [hidden, kv], [hidden, kv], [hidden, hidden]
};

struct Model {
  std::vector<LayerWeights> layers;
  std::vector<at::Tensor> prompts;  // [1, len, hidden] each
};

Model make_model(const Options& o) {
  at::manual_seed(static_cast<uint64_t>(o.seed));
  Model m;
  const double s = 1.0 / std::sqrt(static_cast<double>(kHidden));
  for (int64_t l = 0; l < kLayers; ++l) {
    m.layers.push_back({at::randn({kHidden, kHidden}) * s, at::randn({kHidden, kKvHeads * kHeadDim}) * s,
                        at::randn({kHidden, kKvHeads * kHeadDim}) * s, at::randn({kHidden, kHidden}) * s});
  }
  for (int64_t b = 0; b < o.batch; ++b) {
    const int64_t len = at::randint(o.max_prompt / 4, o.max_prompt + 1, {1}).item<int64_t>();
    m.prompts.push_back(at::randn({1, len, kHidden}));
  }
  return m;
}

/// Every layer over x [B, S, hidden] whose tokens start at starts[b]: K/V
/// written through `view` (bound with the lengths after the write),
/// attention by paged_attention. Returns the last hidden states [B, S, hidden].
template <class Layout>
at::Tensor forward(const Model& m, at::Tensor x, const std::vector<int64_t>& starts,
                   const pagedkv::CacheView<Layout>& view) {
  const int64_t B = x.size(0), S = x.size(1);
  const at::Tensor start = at::tensor(starts, at::kLong);
  for (int64_t l = 0; l < kLayers; ++l) {
    const LayerWeights& w = m.layers[static_cast<size_t>(l)];
    const at::Tensor q = at::matmul(x, w.wq).view({B, S, kQueryHeads, kHeadDim});
    view.write(l, start, at::matmul(x, w.wk).view({B, S, kKvHeads, kHeadDim}),
               at::matmul(x, w.wv).view({B, S, kKvHeads, kHeadDim}));
    const at::Tensor attn = pagedkv::paged_attention(view, l, q).reshape({B, S, kHidden});
    x = at::layer_norm(x + at::matmul(attn, w.wo), {kHidden});
  }
  return x;
}

/// A cache and its table, sized for the whole batch after every step.
template <class Layout>
struct Engine {
  pagedkv::PagedCache<Layout> cache;
  pagedkv::SequenceTable<Layout> seqs;
  Engine(const Options& o, const Model& m)
      : cache(kLayers, pool_pages(o, m), o.page_size, kKvHeads, kHeadDim, at::TensorOptions().dtype(at::kFloat),
              o.quant),
        seqs(cache) {}
  /// Bytes of one (token, head)'s k and v in the pages: elements or codes, plus their scales.
  int64_t vector_bytes() const {
    const auto side = [](const at::Tensor& pages, const at::Tensor& scales) {
      return kHeadDim * static_cast<int64_t>(pages.element_size()) + (scales.defined() ? 4 : 0);
    };
    return side(cache.k_cache(), cache.k_scales()) + side(cache.v_cache(), cache.v_scales());
  }
  static int64_t pool_pages(const Options& o, const Model& m) {
    int64_t pages = 0;
    for (const auto& p : m.prompts) pages += (p.size(1) + o.steps + o.page_size - 1) / o.page_size;
    return pages;
  }

  /// Prefills one prompt as a new sequence; returns {seq, last hidden [1, hidden]}.
  std::pair<int64_t, at::Tensor> prefill(const Model& m, const at::Tensor& prompt) {
    const int64_t len = prompt.size(1);
    const int64_t seq = seqs.create();
    TORCH_CHECK(seqs.prepare_append(seq, len), "disaggregated: page pool exhausted");
    const auto view = cache.bind(seqs.batch({seq}).first, at::full({1}, len, at::kLong));
    const at::Tensor h = forward(m, prompt, {0}, view);
    seqs.commit_append(seq, len);
    return {seq, h[0][len - 1].unsqueeze(0).clone()};
  }

  /// Decodes `steps` tokens for `order` from `last` [B, hidden]; returns each step's output.
  std::vector<at::Tensor> decode(const Model& m, const std::vector<int64_t>& order, at::Tensor last, int64_t steps) {
    std::vector<at::Tensor> out;
    for (int64_t step = 0; step < steps; ++step) {
      std::vector<int64_t> starts;
      for (int64_t seq : order) {
        starts.push_back(seqs.length(seq));
        TORCH_CHECK(seqs.prepare_append(seq, 1), "disaggregated: page pool exhausted");
      }
      auto batch = seqs.batch(order);
      const auto view = cache.bind(batch.first, batch.second + 1);
      last = forward(m, last.unsqueeze(1), starts, view).squeeze(1);
      for (int64_t seq : order) seqs.commit_append(seq, 1);
      out.push_back(last.clone());
    }
    return out;
  }
};

c10::intrusive_ptr<Group> join(const Options& o, int rank) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(o.port);
  store_options.timeout = std::chrono::milliseconds(o.timeout_ms);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  auto options = Group::Options::create(std::chrono::milliseconds(o.timeout_ms));
  options->devices.push_back(Group::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<Group>(store, rank, 2, options);
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

template <class Layout>
int prefill(const Options& o) {
  const Model m = make_model(o);
  auto group = join(o, 0);
  Engine<Layout> engine(o, m);
  const std::chrono::milliseconds timeout(o.timeout_ms);
  double send_ms = 0;
  int64_t sent_bytes = 0;
  for (int64_t b = 0; b < o.batch; ++b) {
    const auto [seq, last] = engine.prefill(m, m.prompts[static_cast<size_t>(b)]);
    const int64_t n_pages = static_cast<int64_t>(engine.seqs.pages(seq).size());
    const int64_t bytes = kLayers * n_pages * o.page_size * kKvHeads * engine.vector_bytes();
    const auto t0 = Clock::now();
    pagedkv::send_sequence(*group, 1, engine.seqs, seq, /*transfer_id=*/b, timeout);
    std::vector<at::Tensor> hidden{last};
    group->send(hidden, 1, kHiddenTag)->wait(timeout);
    const double ms = ms_since(t0);
    send_ms += ms;
    sent_bytes += bytes;
    std::printf("[prefill] sequence %lld: %lld tokens, %lld pages (%.1f KiB) sent in %.2f ms (%.0f MiB/s)\n",
                static_cast<long long>(b), static_cast<long long>(engine.seqs.length(seq)),
                static_cast<long long>(n_pages), static_cast<double>(bytes) / 1024, ms,
                static_cast<double>(bytes) / (1 << 20) / (ms / 1e3));
    std::fflush(stdout);
    engine.seqs.release(seq);  // the decode worker owns it now
  }
  std::printf("[prefill] sent %lld sequences, %.1f MiB in %.1f ms: %.0f MiB/s\n", static_cast<long long>(o.batch),
              static_cast<double>(sent_bytes) / (1 << 20), send_ms,
              static_cast<double>(sent_bytes) / (1 << 20) / (send_ms / 1e3));
  return engine.cache.n_free() == engine.cache.n_pages() ? 0 : 1;
}

template <class Layout>
int decode(const Options& o) {
  const Model m = make_model(o);
  auto group = join(o, 1);
  Engine<Layout> engine(o, m);
  const std::chrono::milliseconds timeout(o.timeout_ms);
  std::vector<int64_t> order;
  at::Tensor last = at::empty({o.batch, kHidden});
  const auto t0 = Clock::now();
  for (int64_t b = 0; b < o.batch; ++b) {
    const auto t = Clock::now();
    const int64_t seq = pagedkv::recv_sequence(*group, 0, engine.seqs, /*transfer_id=*/b, timeout);
    std::vector<at::Tensor> hidden{at::empty({1, kHidden})};
    group->recv(hidden, 0, kHiddenTag)->wait(timeout);
    last[b] = hidden[0][0];
    order.push_back(seq);
    std::printf("[decode] sequence %lld received as sequence %lld: %lld tokens in %lld pages, %.2f ms\n",
                static_cast<long long>(b), static_cast<long long>(seq),
                static_cast<long long>(engine.seqs.length(seq)),
                static_cast<long long>(engine.seqs.pages(seq).size()), ms_since(t));
    std::fflush(stdout);
  }
  const double recv_ms = ms_since(t0);
  const auto t1 = Clock::now();
  const std::vector<at::Tensor> out = engine.decode(m, order, last, o.steps);
  const double decode_ms = ms_since(t1);
  std::printf("[decode] received %lld sequences in %.1f ms; decoded %lld steps x %lld sequences in %.1f ms\n",
              static_cast<long long>(o.batch), recv_ms, static_cast<long long>(o.steps),
              static_cast<long long>(o.batch), decode_ms);

  // The same prefill and decode in this process, on a cache of the decode layout.
  Engine<Layout> single(o, m);
  std::vector<int64_t> single_order;
  at::Tensor single_last = at::empty({o.batch, kHidden});
  for (int64_t b = 0; b < o.batch; ++b) {
    const auto [seq, h] = single.prefill(m, m.prompts[static_cast<size_t>(b)]);
    single_order.push_back(seq);
    single_last[b] = h[0];
  }
  const std::vector<at::Tensor> expected = single.decode(m, single_order, single_last, o.steps);
  double max_diff = (last - single_last).abs().max().item<double>();
  for (size_t i = 0; i < out.size(); ++i) {
    max_diff = std::max(max_diff, (out[i] - expected[i]).abs().max().item<double>());
  }
  std::printf("[decode] max abs difference vs a single-process run: %g over %zu steps\n", max_diff, out.size());
  for (int64_t seq : order) engine.seqs.release(seq);
  if (engine.cache.n_free() != engine.cache.n_pages()) {
    std::fprintf(stderr, "[decode] FAILED: pages leaked\n");
    return 1;
  }
  if (max_diff != 0.0) {
    std::fprintf(stderr, "[decode] FAILED: the disaggregated run differs from the single-process run\n");
    return 1;
  }
  std::printf("[decode] OK\n");
  return 0;
}

/// Starts this binary with `role`; returns its pid (-1 on failure).
pid_t spawn(const char* argv0, int argc, char** argv, const std::string& role, uint16_t port) {
  std::vector<std::string> args{"/proc/self/exe"};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  args.insert(args.end(), {"--role", role, "--port", std::to_string(port)});
  std::vector<char*> raw;
  for (auto& a : args) raw.push_back(&a[0]);
  raw.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, raw.data(), environ) != 0) {
    std::fprintf(stderr, "%s: cannot start the %s process\n", argv0, role.c_str());
    return -1;
  }
  return pid;
}

/// The launcher: a TCPStore on a free port, the two workers, their exit codes.
int launch(const Options& o, int argc, char** argv) {
  c10d::TCPStoreOptions store_options;
  store_options.port = 0;
  store_options.isServer = true;
  store_options.waitWorkers = false;
  store_options.timeout = std::chrono::milliseconds(o.timeout_ms);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  std::printf("pagedkv disaggregated: %lld layers, %lld kv heads x %lld, float32 (pages: %s), page_size %lld; "
              "prefill %s -> decode %s over Gloo on 127.0.0.1:%u\n",
              static_cast<long long>(kLayers), static_cast<long long>(kKvHeads), static_cast<long long>(kHeadDim),
              pagedkv::format_name(o.quant.k), static_cast<long long>(o.page_size), o.prefill_layout.c_str(),
              o.decode_layout.c_str(), static_cast<unsigned>(store->getPort()));
  std::fflush(stdout);
  const pid_t workers[2] = {spawn(argv[0], argc, argv, "prefill", store->getPort()),
                            spawn(argv[0], argc, argv, "decode", store->getPort())};
  int result = 0;
  // Every wait is bounded: a worker still running long after the transfers' timeouts is killed.
  const auto deadline = Clock::now() + std::chrono::milliseconds(4 * o.timeout_ms) + std::chrono::seconds(60);
  for (const pid_t pid : workers) {
    if (pid < 0) {
      result = 1;
      continue;
    }
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) != pid) {
      if (Clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) result = 1;
  }
  std::printf(result == 0 ? "OK\n" : "FAILED\n");
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return 2;
  try {
    if (o.role.empty()) return launch(o, argc, argv);
    const std::string& layout = o.role == "prefill" ? o.prefill_layout : o.decode_layout;
    if (o.role == "prefill") return layout == "hnd" ? prefill<pagedkv::HND>(o) : prefill<pagedkv::NHD>(o);
    return layout == "hnd" ? decode<pagedkv::HND>(o) : decode<pagedkv::NHD>(o);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "disaggregated %s: %s\n", o.role.c_str(), e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "disaggregated %s: %s\n", o.role.c_str(), e.what());
    return 1;
  }
}
