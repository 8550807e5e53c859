// llama: serves a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3,
// Gemma 2, Gemma 3's text model) through pagedkv, like a small
// inference engine: greedy decoding of a file of requests with continuous
// batching, chunked prefill, prefix caching and preemption (see --help).
//
// The pieces, one idea per file:
//   errors.hpp       InputError: what bad input throws (file, line, field)
//   safetensors.hpp  the safetensors reader, checking everything it reads
//   checkpoint.hpp   model.safetensors or a sharded index
//   config.hpp       config.json (the six families, both RoPE spellings)
//   model.hpp        weights and the forward pass of one engine step (model.cpp)
//   requests.hpp     request file in, output lines out (JSON Lines)
//   scheduler.hpp    continuous batching, chunked prefill, prefix cache, preemption
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "../blas_check.hpp"
#include "checkpoint.hpp"
#include "config.hpp"
#include "errors.hpp"
#include "model.hpp"
#include "pagedkv/pagedkv.hpp"
#include "requests.hpp"
#include "scheduler.hpp"
#if PAGEDKV_LLAMA_WITH_REDIS
#include "pagedkv/stores/redis.hpp"
#endif

namespace {

struct Options {
  std::string model, requests, out, logits, stats;
  int64_t max_new_tokens = 32;
  std::string layout = "nhd";
  std::string kv_format = "native";
  int64_t page_size = 16;
  int64_t n_pages = 0;  // 0: enough for every request at once
  int64_t n_pages_sliding = 0;  // the sliding-window layers' pool; 0: enough for every request's window at once
  bool free_out_of_window = true;  // --sliding-pages window (else all)
  int64_t max_batch_tokens = 2048;
  bool prefix_cache = true;
  bool prefix_cache_given = false;  // --prefix-cache on named on the command line (else the default)
  std::string dtype = "float32";
  std::string device = "cpu";
  int64_t threads = 0;  // 0: libtorch's default
  int64_t max_seqs = 256;
  std::string preempt = "swap";
  int64_t host_pages = 0;  // 0: as many as --n-pages
  int64_t prefix_host_mb = 0;  // prefix tiers (page_store.hpp); 0 / empty: none
  std::string prefix_disk;
  int64_t prefix_disk_mb = 1024;
  std::string prefix_redis;
  bool quiet = false;
  int64_t speculate = 0;
};

void usage() {
  std::printf(
      "usage: llama --model DIR --requests FILE [options]\n"
      "Serves a checkpoint of transformers' save_pretrained (config.json and model.safetensors\n"
      "or a sharded index; float32, float16 or bfloat16 weights) of the model types llama,\n"
      "mistral, qwen2, qwen3, gemma2 and gemma3_text over a pagedkv paged KV cache: greedy\n"
      "decoding of every request, continuous batching, chunked prefill, prefix caching,\n"
      "preemption when the pool runs short. Layers with a sliding window keep their K/V in a\n"
      "second pool, whose pages leave a sequence as they fall out of its window.\n\n"
      "  --model DIR             checkpoint directory\n"
      "  --requests FILE         JSON Lines, one request a line:\n"
      "                          {\"id\": \"r1\", \"prompt\": [1, 2, 3], \"max_new_tokens\": 16}\n"
      "  --out FILE              JSON Lines, one line per finished request, in the order they finish:\n"
      "                          {\"id\": \"r1\", \"tokens\": [...]} (generated tokens; default stdout)\n"
      "  --max-new-tokens N      default for requests without max_new_tokens (32); a request also\n"
      "                          ends at the config's eos_token_id, which it keeps as its last token\n"
      "  --layout nhd|hnd        page layout (nhd)\n"
      "  --kv-format F           native (the --dtype), fp8 (e4m3) or int8 pages (native)\n"
      "  --page-size N           tokens per page (16)\n"
      "  --n-pages N             pages in the pool (default: enough for every request at once); with\n"
      "                          sliding-window layers, the full-attention layers' pool (a model\n"
      "                          whose every layer slides: its one pool)\n"
      "  --max-batch-tokens N    new tokens per step, all sequences together (2048)\n"
      "  --prefix-cache on|off   reuse cached K/V of shared prompt prefixes (on); a model with\n"
      "                          sliding-window layers runs without it (their pages of a prefix\n"
      "                          are gone once it leaves the window): said on stderr, and\n"
      "                          --prefix-cache on named on the command line is an error there\n"
      "  --dtype T               float32, float16 or bfloat16: weights, activations and pages (float32)\n"
      "  --device cpu|cuda       (cpu)\n"
      "  --threads N             intra-op threads (default: libtorch's, one per core)\n"
      "  --speculate K           speculative decoding: up to K tokens a step drafted by prompt lookup,\n"
      "                          verified in the step's forward pass, the rejected rolled back; the\n"
      "                          tokens are exactly those without it (0: off, the default)\n"
      "Beyond the fixed flags above:\n"
      "  --n-pages-sliding N     pages in the sliding-window layers' pool (default: enough for every\n"
      "                          request's window and step at once)\n"
      "  --sliding-pages window|all  window (the default): a sliding layer's pages leave a sequence\n"
      "                          as they fall out of its window; all: they stay until the request\n"
      "                          ends, as in a cache without windowed tables (the same tokens: to\n"
      "                          measure what the window saves)\n"
      "  --max-seqs N            requests running at once at most (256; 1: one at a time)\n"
      "  --preempt swap|recompute  what preemption does with the newest request (swap: to a\n"
      "                          host cache, recomputing when that is full)\n"
      "  --host-pages N          pages of the host cache swapped requests wait in (--n-pages); the\n"
      "                          sliding layers' host cache has as many as their pool\n"
      "  --prefix-host-mb N      a prefix tier of N MiB in host memory for pages the pool evicts\n"
      "  --prefix-disk DIR       a prefix tier in DIR (kept across runs, shared by processes)\n"
      "  --prefix-disk-mb N      its budget (1024)\n"
      "  --prefix-redis H:P      a prefix tier on the Redis server at H:P, shared by engines\n"
      "  --logits FILE           JSON Lines {\"id\", \"logits\": [[vocab floats] per generated token]}\n"
      "  --stats FILE            the summary as one JSON object\n"
      "  --quiet                 no progress lines\n"
      "  --help                  this text\n");
}

[[noreturn]] void bad_flag(const std::string& flag, const std::string& value, const char* expected) {
  llama::fail("command line: ", flag, " expected ", expected, ", got '", value, "' (see --help)");
}

int64_t positive(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(value.c_str(), &end, 10);
  if (end == value.c_str() || *end != '\0' || errno != 0 || n < 1) bad_flag(flag, value, "an integer >= 1");
  return n;
}

/// An integer >= 0.
int64_t non_negative(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(value.c_str(), &end, 10);
  if (end == value.c_str() || *end != '\0' || errno != 0 || n < 0) bad_flag(flag, value, "an integer >= 0");
  return n;
}

/// A size in MiB whose bytes fit in int64.
int64_t megabytes(const std::string& flag, const std::string& value) {
  const int64_t n = positive(flag, value);
  if (n > (int64_t{1} << 42)) bad_flag(flag, value, "a size in MiB <= 2^42");
  return n;
}

Options parse_flags(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      usage();
      std::exit(0);
    }
    if (flag == "--quiet") {
      o.quiet = true;
      continue;
    }
    if (i + 1 >= argc) llama::fail("command line: ", flag, " needs a value (see --help)");
    const std::string v = argv[++i];
    const auto one_of = [&](std::initializer_list<const char*> allowed, const char* expected) {
      for (const char* a : allowed) {
        if (v == a) return v;
      }
      bad_flag(flag, v, expected);
    };
    if (flag == "--model") {
      o.model = v;
    } else if (flag == "--requests") {
      o.requests = v;
    } else if (flag == "--out") {
      o.out = v;
    } else if (flag == "--logits") {
      o.logits = v;
    } else if (flag == "--stats") {
      o.stats = v;
    } else if (flag == "--max-new-tokens") {
      o.max_new_tokens = positive(flag, v);
    } else if (flag == "--layout") {
      o.layout = one_of({"nhd", "hnd"}, "nhd or hnd");
    } else if (flag == "--kv-format") {
      o.kv_format = one_of({"native", "fp8", "int8"}, "native, fp8 or int8");
    } else if (flag == "--page-size") {
      o.page_size = positive(flag, v);
    } else if (flag == "--n-pages") {
      o.n_pages = positive(flag, v);
    } else if (flag == "--n-pages-sliding") {
      o.n_pages_sliding = positive(flag, v);
    } else if (flag == "--sliding-pages") {
      o.free_out_of_window = one_of({"window", "all"}, "window or all") == "window";
    } else if (flag == "--max-batch-tokens") {
      o.max_batch_tokens = positive(flag, v);
    } else if (flag == "--prefix-cache") {
      o.prefix_cache = one_of({"on", "off"}, "on or off") == "on";
      o.prefix_cache_given = o.prefix_cache;
    } else if (flag == "--dtype") {
      o.dtype = one_of({"float32", "float16", "bfloat16"}, "float32, float16 or bfloat16");
    } else if (flag == "--device") {
      o.device = one_of({"cpu", "cuda"}, "cpu or cuda");
    } else if (flag == "--threads") {
      o.threads = positive(flag, v);
    } else if (flag == "--speculate") {
      o.speculate = non_negative(flag, v);
    } else if (flag == "--max-seqs") {
      o.max_seqs = positive(flag, v);
    } else if (flag == "--preempt") {
      o.preempt = one_of({"swap", "recompute"}, "swap or recompute");
    } else if (flag == "--host-pages") {
      o.host_pages = positive(flag, v);
    } else if (flag == "--prefix-host-mb") {
      o.prefix_host_mb = megabytes(flag, v);
    } else if (flag == "--prefix-disk") {
      if (v.empty()) bad_flag(flag, v, "a directory");
      o.prefix_disk = v;
    } else if (flag == "--prefix-disk-mb") {
      o.prefix_disk_mb = megabytes(flag, v);
    } else if (flag == "--prefix-redis") {
      o.prefix_redis = v;
    } else {
      llama::fail("command line: unknown flag ", flag, " (see --help)");
    }
  }
  if (o.model.empty()) llama::fail("command line: --model DIR is required (see --help)");
  if (o.requests.empty()) llama::fail("command line: --requests FILE is required (see --help)");
  return o;
}

/// CPU time of the whole process (every thread), seconds.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class Layout>
int serve(const Options& o) {
  const auto t_start = std::chrono::steady_clock::now();
  if (o.threads > 0) at::set_num_threads(static_cast<int>(o.threads));
  const at::Device device(o.device == "cuda" ? at::kCUDA : at::kCPU);
  if (device.is_cuda() && !at::hasCUDA()) llama::fail("command line: --device cuda, but this libtorch sees no CUDA device");
  const at::ScalarType dtype = o.dtype == "float16" ? at::kHalf : o.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  try {  // Debian's libtorch 1.13 has no float16 matrix multiply (nor SiLU) on the CPU
    const auto probe = at::ones({2, 2}, at::TensorOptions().dtype(dtype).device(device));
    (void)at::silu(at::linear(probe, probe));
  } catch (const c10::Error&) {
    llama::fail("command line: --dtype ", o.dtype, ": this libtorch cannot compute in it on ", o.device,
                " (no matrix multiply or SiLU for it); use float32 or bfloat16");
  }

  const std::string config_path = (std::filesystem::path(o.model) / "config.json").string();
  const llama::LlamaConfig config = llama::parse_config(config_path, llama::read_text_file(config_path));
  std::vector<llama::Request> requests =
      llama::read_requests(o.requests, {config.vocab_size, o.max_new_tokens});

  // The pools: by default every request's final length at once (no
  // preemption); the sliding layers', every request's window and step.
  const int64_t window = config.sliding_window;
  const int64_t table_window = o.free_out_of_window ? window : 0;  // the sliding table's
  const int64_t n_sliding_layers = config.n_sliding_layers();
  const int64_t n_full_layers = config.num_hidden_layers - n_sliding_layers;
  int64_t n_pages = o.n_pages;
  if (n_pages == 0) {
    for (const auto& r : requests) n_pages += llama::pages_needed(r, o.page_size);
    n_pages = std::max<int64_t>(n_pages, 1);
  }
  int64_t n_pages_sliding = o.n_pages_sliding > 0 ? o.n_pages_sliding : n_full_layers == 0 ? o.n_pages : 0;
  if (n_pages_sliding == 0) {
    for (const auto& r : requests) {
      n_pages_sliding += llama::pages_needed(r, o.page_size, table_window, o.max_batch_tokens);
    }
    n_pages_sliding = std::max<int64_t>(n_pages_sliding, 1);
  }
  if (n_full_layers > 0) llama::check_fits(o.requests, requests, n_pages, o.page_size);
  if (n_sliding_layers > 0) {
    llama::check_fits(o.requests, requests, n_pages_sliding, o.page_size,
                      n_full_layers == 0 && o.n_pages_sliding == 0 ? "--n-pages" : "--n-pages-sliding", table_window,
                      o.max_batch_tokens);
  }
  if (n_sliding_layers > 0 && o.prefix_cache_given) {
    llama::fail("command line: --prefix-cache on: ", config_path, " has ", n_sliding_layers,
                " sliding-window layers (window ", window, "), whose pages of a prefix are freed once it leaves the "
                "window, so no prefix cache can serve them; use --prefix-cache off (see --help)");
  }
  const bool prefix_cache = o.prefix_cache && n_sliding_layers == 0;

  const llama::Model model(config, llama::Checkpoint(o.model), dtype, device);
  const double load_s = since(t_start);

  const pagedkv::KVFormat format = o.kv_format == "fp8"    ? pagedkv::KVFormat::fp8_e4m3
                                   : o.kv_format == "int8" ? pagedkv::KVFormat::int8
                                                           : pagedkv::KVFormat::native;
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const pagedkv::KVQuant quant{format, format};
  const auto make_cache = [&](int64_t layers, int64_t pages, at::TensorOptions opts) {
    return std::make_unique<pagedkv::PagedCache<Layout>>(layers, pages, o.page_size, config.num_key_value_heads,
                                                         config.head_dim, opts, quant);
  };
  llama::KvCaches<Layout> caches;
  const at::TensorOptions host_options = at::TensorOptions().dtype(dtype);
  if (n_full_layers > 0) {
    caches.full = make_cache(n_full_layers, n_pages, options);
    if (o.preempt == "swap") caches.full_host = make_cache(n_full_layers, o.host_pages > 0 ? o.host_pages : n_pages, host_options);
  }
  if (n_sliding_layers > 0) {
    caches.sliding = make_cache(n_sliding_layers, n_pages_sliding, options);
    if (o.preempt == "swap") {
      caches.sliding_host = make_cache(
          n_sliding_layers, n_full_layers == 0 && o.host_pages > 0 ? o.host_pages : n_pages_sliding, host_options);
    }
  }
  if (!o.quiet && o.prefix_cache && !prefix_cache) {
    std::fprintf(stderr, "llama: prefix cache off: %s has %lld sliding-window layers (window %lld)\n",
                 config_path.c_str(), static_cast<long long>(n_sliding_layers), static_cast<long long>(window));
  }

  std::ofstream out_file, logits_file;
  if (!o.out.empty()) {
    out_file.open(o.out, std::ios::binary);
    if (!out_file) llama::fail(o.out, ": cannot open for writing (--out)");
  }
  if (!o.logits.empty()) {
    logits_file.open(o.logits, std::ios::binary);
    if (!logits_file) llama::fail(o.logits, ": cannot open for writing (--logits)");
  }
  std::ostream& out = o.out.empty() ? std::cout : out_file;

  const int64_t total = static_cast<int64_t>(requests.size());
  int64_t done = 0;
  auto last_progress = std::chrono::steady_clock::now();
  const auto t_serve = std::chrono::steady_clock::now();
  const double cpu_serve = process_cpu_seconds();
  llama::SchedulerOptions so;
  so.max_batch_tokens = o.max_batch_tokens;
  so.max_seqs = o.max_seqs;
  so.prefix_cache = prefix_cache;
  so.free_out_of_window = o.free_out_of_window;
  // The tiers, fastest first: host memory, the disk, the shared server.
  if ((o.prefix_host_mb > 0 || !o.prefix_disk.empty() || !o.prefix_redis.empty()) && !prefix_cache) {
    llama::fail("command line: --prefix-host-mb, --prefix-disk and --prefix-redis need --prefix-cache on",
                n_sliding_layers > 0 ? ", which a model with sliding-window layers cannot use (see --help)" : "");
  }
  if (o.prefix_host_mb > 0) so.prefix_tiers.push_back(pagedkv::host_store(o.prefix_host_mb << 20));
  if (!o.prefix_disk.empty()) {
    try {
      so.prefix_tiers.push_back(pagedkv::disk_store(o.prefix_disk, o.prefix_disk_mb << 20));
    } catch (const c10::Error& e) {
      llama::fail("command line: --prefix-disk ", o.prefix_disk, ": ", e.msg());
    }
  }
  if (!o.prefix_redis.empty()) {
#if PAGEDKV_LLAMA_WITH_REDIS
    try {
      so.prefix_tiers.push_back(pagedkv::redis_store(o.prefix_redis));
    } catch (const c10::Error&) {
      bad_flag("--prefix-redis", o.prefix_redis, "HOST:PORT");
    }
#else
    llama::fail("command line: --prefix-redis: this llama was built without hiredis (libhiredis-dev)");
#endif
  }
  so.swap = o.preempt == "swap";
  so.keep_logits = !o.logits.empty();
  so.speculate = o.speculate;
  llama::Scheduler<Layout> scheduler(model, caches, so, [&](llama::Finished&& f) {
    out << llama::output_line(f.id, f.tokens) << '\n';
    if (so.keep_logits) {
      nlohmann::json j;
      j["id"] = f.id;
      j["logits"] = f.logits;
      logits_file << j.dump() << '\n';
    }
    ++done;
    if (!o.quiet && (since(last_progress) >= 1.0 || done == total)) {
      std::fprintf(stderr, "llama: %lld/%lld requests done (%.1f s)\n", static_cast<long long>(done),
                   static_cast<long long>(total), since(t_serve));
      last_progress = std::chrono::steady_clock::now();
    }
  });
  for (const auto& r : requests) scheduler.add(r);
  while (scheduler.step()) {
  }
  const double serve_s = since(t_serve);
  const double serve_cpu_s = process_cpu_seconds() - cpu_serve;
  // So that a later run (same --prefix-disk) or another engine (same server) finds them.
  scheduler.persist_prefix();
  out.flush();
  if (!out) llama::fail(o.out.empty() ? std::string("stdout") : o.out, ": write error");
  if (!o.logits.empty()) {
    logits_file.flush();
    if (!logits_file) llama::fail(o.logits, ": write error");
  }

  const llama::SchedulerStats& s = scheduler.stats();
  const double hit_rate = s.prefix_query_tokens > 0
                              ? 100.0 * static_cast<double>(s.prefix_hit_tokens) / static_cast<double>(s.prefix_query_tokens)
                              : 0.0;
  const auto rate = [](int64_t n, double t) { return t > 0 ? static_cast<double>(n) / t : 0.0; };
  std::fprintf(stderr,
               "llama: %lld requests in %.2f s (%lld steps; model load %.2f s): %s, %s pages of %lld tokens, %s\n",
               static_cast<long long>(total), serve_s, static_cast<long long>(s.steps), load_s, Layout::name,
               o.kv_format == "native" ? o.dtype.c_str() : o.kv_format.c_str(), static_cast<long long>(o.page_size),
               o.device.c_str());
  std::fprintf(stderr, "  prefill: %lld prompt tokens computed in %lld steps, %.2f s (%.0f tokens/s; those steps also "
                       "decoded alongside)\n",
               static_cast<long long>(s.prefill_tokens), static_cast<long long>(s.prefill_steps), s.prefill_seconds,
               rate(s.prefill_tokens, s.prefill_seconds));
  std::fprintf(stderr, "  decode: %lld tokens in %lld decode-only steps, %.2f s (%.0f tokens/s); %lld generated in all\n",
               static_cast<long long>(s.decode_tokens), static_cast<long long>(s.steps - s.prefill_steps),
               s.decode_seconds, rate(s.decode_tokens, s.decode_seconds), static_cast<long long>(s.generated_tokens));
  const int64_t pool_pages = (n_full_layers > 0 ? n_pages : 0) + (n_sliding_layers > 0 ? n_pages_sliding : 0);
  std::fprintf(stderr, "  pages: peak %lld of %lld in use (%lld cached by the prefix cache at the end); peak %lld "
                       "requests running, %lld in one step; %lld prefill chunks cut by the budget\n",
               static_cast<long long>(s.peak_pages), static_cast<long long>(pool_pages),
               static_cast<long long>(scheduler.cached_pages()), static_cast<long long>(s.peak_running),
               static_cast<long long>(s.peak_batch_seqs), static_cast<long long>(s.chunks));
  if (n_sliding_layers > 0) {
    std::fprintf(stderr, "  %s: %lld full-attention layers, peak %lld of %lld pages; %lld sliding-window layers "
                         "(window %lld), peak %lld of %lld pages\n",
                 config.model_type.c_str(), static_cast<long long>(n_full_layers),
                 static_cast<long long>(s.peak_pages_full), static_cast<long long>(n_full_layers > 0 ? n_pages : 0),
                 static_cast<long long>(n_sliding_layers), static_cast<long long>(window),
                 static_cast<long long>(s.peak_pages_sliding), static_cast<long long>(n_pages_sliding));
  }
  std::fprintf(stderr, "  prefix cache: %s, hit rate %.1f%% (%lld of %lld prompt tokens skipped)\n",
               prefix_cache ? "on" : o.prefix_cache ? "off (sliding-window layers)" : "off", hit_rate, static_cast<long long>(s.prefix_hit_tokens),
               static_cast<long long>(s.prefix_query_tokens));
  if (!so.prefix_tiers.empty()) {
    std::string tiers;
    for (const auto& [tier, n] : s.prefix_tier_hit_tokens) {
      tiers += (tiers.empty() ? "" : ", ") + tier + " " + std::to_string(n);
    }
    std::fprintf(stderr, "  prefix tiers: prompt tokens loaded from %s\n", tiers.c_str());
  }
  if (o.speculate > 0) {
    std::fprintf(stderr, "  speculative decoding: %lld of %lld drafted tokens accepted (%.1f%%)\n",
                 static_cast<long long>(s.spec_accepted_tokens), static_cast<long long>(s.spec_proposed_tokens),
                 s.spec_proposed_tokens > 0 ? 100.0 * static_cast<double>(s.spec_accepted_tokens) /
                                                  static_cast<double>(s.spec_proposed_tokens)
                                            : 0.0);
  }
  std::fprintf(stderr, "  preemptions: %lld swapped to the host cache, %lld recomputed (%lld tokens computed again)\n",
               static_cast<long long>(s.preempted_swap), static_cast<long long>(s.preempted_recompute),
               static_cast<long long>(s.recomputed_tokens));
  if (!o.stats.empty()) {
    nlohmann::json j;
    j["requests"] = total;
    j["load_seconds"] = load_s;
    j["serve_seconds"] = serve_s;
    j["serve_cpu_seconds"] = serve_cpu_s;  // every thread's: on a shared machine wall time includes waiting
    j["steps"] = s.steps;
    j["prefill_steps"] = s.prefill_steps;
    j["prompt_tokens"] = s.prompt_tokens;
    j["prefill_tokens"] = s.prefill_tokens;
    j["decode_tokens"] = s.decode_tokens;
    j["recomputed_tokens"] = s.recomputed_tokens;
    j["generated_tokens"] = s.generated_tokens;
    j["prefill_seconds"] = s.prefill_seconds;
    j["decode_seconds"] = s.decode_seconds;
    j["prefix_query_tokens"] = s.prefix_query_tokens;
    j["prefix_hit_tokens"] = s.prefix_hit_tokens;
    int64_t from_tiers = 0;
    for (const char* tier : {"host", "disk", "remote"}) {
      const auto it = s.prefix_tier_hit_tokens.find(tier);
      const int64_t n = it == s.prefix_tier_hit_tokens.end() ? 0 : it->second;
      j[std::string("prefix_hit_tokens_") + tier] = n;
      from_tiers += n;
    }
    j["prefix_hit_tokens_device"] = s.prefix_hit_tokens - from_tiers;
    j["preempted_swap"] = s.preempted_swap;
    j["preempted_recompute"] = s.preempted_recompute;
    j["chunks"] = s.chunks;
    j["peak_pages"] = s.peak_pages;
    j["spec_proposed_tokens"] = s.spec_proposed_tokens;
    j["spec_accepted_tokens"] = s.spec_accepted_tokens;
    j["n_pages"] = pool_pages;
    // Bytes of one page of a pool, every layer, k and v (codes and scales).
    const auto page_bytes = [](const auto& cache) -> int64_t {
      if (!cache) return 0;
      int64_t bytes = cache->k_cache().nbytes() + cache->v_cache().nbytes();
      if (cache->k_scales().defined()) bytes += cache->k_scales().nbytes();
      if (cache->v_scales().defined()) bytes += cache->v_scales().nbytes();
      return bytes / cache->n_pages();
    };
    j["peak_kv_bytes"] = n_sliding_layers > 0 ? s.peak_pages_full * page_bytes(caches.full) +
                                                    s.peak_pages_sliding * page_bytes(caches.sliding)
                                              : s.peak_pages * page_bytes(caches.full);
    j["sliding_pages"] = o.free_out_of_window ? "window" : "all";
    if (n_sliding_layers > 0) {
      j["peak_pages_full"] = s.peak_pages_full;
      j["peak_pages_sliding"] = s.peak_pages_sliding;
      j["n_pages_full"] = n_full_layers > 0 ? n_pages : 0;
      j["n_pages_sliding"] = n_pages_sliding;
      j["sliding_window"] = window;
    }
    j["prefix_cache"] = prefix_cache;
    j["peak_running"] = s.peak_running;
    j["peak_batch_seqs"] = s.peak_batch_seqs;
    j["threads"] = at::get_num_threads();
    std::ofstream stats(o.stats, std::ios::binary);
    stats << j.dump(1) << '\n';
    if (!stats) llama::fail(o.stats, ": cannot write (--stats)");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_flags(argc, argv);
    if (o.device == "cpu") examples::warn_if_reference_blas("llama");
    return o.layout == "hnd" ? serve<pagedkv::HND>(o) : serve<pagedkv::NHD>(o);
  } catch (const llama::InputError& e) {
    std::fprintf(stderr, "llama: %s\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "llama: error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama: error: %s\n", e.what());
    return 1;
  }
}
