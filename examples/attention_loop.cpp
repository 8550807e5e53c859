// A small multi-layer decoder attention loop over a paged KV cache.
//
// A batch of prompts of different lengths is prefilled (each prompt on its
// own, as engines do), then decoded together for N steps. A SequenceTable
// does the bookkeeping (pages per sequence, growth, the batch's page table);
// with --samples N each prompt is prefilled once and forked into N sampled
// continuations that share the prompt's pages (copy-on-write of the partly
// written last page at the first decode step). Every layer writes
// its K/V through a CacheView and attends with pagedkv::paged_attention,
// which reads K/V straight from the pages (--attention paged, the default),
// or over what the view's gather returns (--attention gather). The same loop
// also runs on plain contiguous max-length K/V buffers; every step's output
// is compared. gather: bit for bit in intent, the max abs difference must be
// 0. paged: q and the attention output are in the cache's dtype (as
// paged_attention takes them) in both runs, and the kernel's float32
// summation order differs from ATen's: within a small tolerance.
// With --shared-prefix N every prompt starts with the same N tokens (ids
// looked up in a random embedding table) and requests arrive in two waves:
// a PrefixCache registers the first wave's prompt pages, the second wave
// acquires them and prefills only the rest of its prompts (the contiguous
// run still computes every prompt in full).
//
//   attention_loop [--batch 4] [--steps 32] [--layout nhd|hnd]
//                  [--dtype float32|float16|bfloat16] [--page-size 16]
//                  [--max-prompt 200] [--seed 0] [--samples 1]
//                  [--attention paged|gather] [--shared-prefix 0]
//                  [--kv-format native|fp8|int8] [--k-format F] [--v-format F]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "blas_check.hpp"
#include "pagedkv/pagedkv.hpp"

namespace {

struct Options {
  int64_t batch = 4;
  int64_t steps = 32;
  std::string layout = "nhd";
  std::string dtype = "float32";
  int64_t page_size = 16;
  int64_t max_prompt = 200;
  uint64_t seed = 0;
  int64_t samples = 1;
  std::string attention = "paged";
  int64_t shared_prefix = 0;
  pagedkv::KVQuant quant;  // --kv-format, --k-format, --v-format
};

constexpr int64_t kLayers = 4;
constexpr int64_t kQueryHeads = 8;
constexpr int64_t kKvHeads = 2;
constexpr int64_t kHeadDim = 64;
constexpr int64_t kHidden = kQueryHeads * kHeadDim;

void usage(const char* argv0) {
  std::printf(
      "usage: %s [options]\n"
      "A 4-layer decoder (8 query heads, 2 kv heads, head_dim 64, random weights) over a\n"
      "paged KV cache: prefill a batch of prompts of different lengths, decode N steps, and\n"
      "check every step against the same loop on contiguous K/V buffers.\n\n"
      "  --batch N           prompts in the batch (default 4)\n"
      "  --steps N           decode steps (default 32)\n"
      "  --layout nhd|hnd    page layout (default nhd)\n"
      "  --dtype T           K/V storage dtype: float32, float16, bfloat16 (default float32)\n"
      "  --page-size N       tokens per page (default 16)\n"
      "  --max-prompt N      prompt lengths are drawn from [N/4, N] (default 200)\n"
      "  --seed N            random seed (default 0)\n"
      "  --samples N         continuations per prompt, forked after the prefill and sharing\n"
      "                      the prompt's pages (default 1)\n"
      "  --attention A       paged: paged_attention reads K/V from the pages; gather: gather\n"
      "                      K/V into contiguous tensors, then ATen attention (default paged)\n"
      "  --shared-prefix N   every prompt starts with the same N tokens; requests arrive in two\n"
      "                      waves and a PrefixCache lets the second skip the cached prefix's\n"
      "                      prefill (default 0: no prefix cache)\n"
      "  --kv-format F       K and V pages: native (the dtype), fp8 (e4m3) or int8, one byte per\n"
      "                      element plus a float32 scale per (token, head) (default native)\n"
      "  --k-format F        K pages only (keys with outlier channels suit fp8)\n"
      "  --v-format F        V pages only\n"
      "  --help              this text\n",
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
    const bool format = value == "native" || value == "fp8" || value == "int8";
    const pagedkv::KVFormat f = value == "fp8"    ? pagedkv::KVFormat::fp8_e4m3
                                : value == "int8" ? pagedkv::KVFormat::int8
                                                  : pagedkv::KVFormat::native;
    if (arg == "--kv-format" && format) {
      o.quant = {f, f};
    } else if (arg == "--k-format" && format) {
      o.quant.k = f;
    } else if (arg == "--v-format" && format) {
      o.quant.v = f;
    } else if (arg == "--layout" && (value == "nhd" || value == "hnd")) {
      o.layout = value;
    } else if (arg == "--attention" && (value == "paged" || value == "gather")) {
      o.attention = value;
    } else if (arg == "--dtype" && (value == "float32" || value == "float16" || value == "bfloat16")) {
      o.dtype = value;
    } else if (arg == "--batch" && numeric && number >= 1) {
      o.batch = number;
    } else if (arg == "--steps" && numeric && number >= 0) {
      o.steps = number;
    } else if (arg == "--page-size" && numeric && number >= 1) {
      o.page_size = number;
    } else if (arg == "--max-prompt" && numeric && number >= 4) {
      o.max_prompt = number;
    } else if (arg == "--samples" && numeric && number >= 1) {
      o.samples = number;
    } else if (arg == "--shared-prefix" && numeric && number >= 0) {
      o.shared_prefix = number;
    } else if (arg == "--seed" && numeric && number >= 0) {
      o.seed = static_cast<uint64_t>(number);
    } else {
      std::fprintf(stderr, "%s: bad option %s %s (see --help)\n", argv[0], arg.c_str(), value.c_str());
      return false;
    }
  }
  return true;
}

at::ScalarType dtype_of(const std::string& name) {
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  return at::kFloat;
}

/// Random projection weights of one layer (float32).
struct LayerWeights {
  at::Tensor wq, wk, wv, wo;  // [hidden, hidden], [hidden, kv], [hidden, kv], [hidden, hidden]
};

std::vector<LayerWeights> random_weights() {
  std::vector<LayerWeights> layers;
  const double s = 1.0 / std::sqrt(static_cast<double>(kHidden));
  for (int64_t l = 0; l < kLayers; ++l) {
    layers.push_back({at::randn({kHidden, kHidden}) * s, at::randn({kHidden, kKvHeads * kHeadDim}) * s,
                      at::randn({kHidden, kKvHeads * kHeadDim}) * s, at::randn({kHidden, kHidden}) * s});
  }
  return layers;
}

/// Causal GQA attention in float32 over gathered K/V.
/// q: [B, Sq, Hq, D]; k, v: [B, T, Hkv, D] (any dtype); lengths[b] counts
/// the valid positions of k/v, the last Sq of which are the queries'.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& lengths) {
  const int64_t B = q.size(0), Sq = q.size(1), T = k.size(1);
  const int64_t group = kQueryHeads / kKvHeads;
  const at::Tensor kf = k.to(at::kFloat).repeat_interleave(group, 2).permute({0, 2, 3, 1});  // [B, Hq, D, T]
  const at::Tensor vf = v.to(at::kFloat).repeat_interleave(group, 2).permute({0, 2, 1, 3});  // [B, Hq, T, D]
  const at::Tensor qf = q.permute({0, 2, 1, 3});                                             // [B, Hq, Sq, D]
  at::Tensor scores = at::matmul(qf, kf) / std::sqrt(static_cast<double>(kHeadDim));       // [B, Hq, Sq, T]
  // query s of sequence b sits at position lengths[b] - Sq + s and sees positions <= its own
  const at::Tensor query_pos = at::tensor(lengths, at::kLong).view({B, 1, 1, 1}) - Sq + at::arange(Sq).view({1, 1, Sq, 1});
  const at::Tensor mask = at::arange(T).view({1, 1, 1, T}) > query_pos;  // [B, 1, Sq, T]
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  return at::matmul(at::softmax(scores, -1), vf).permute({0, 2, 1, 3});  // [B, Sq, Hq, D]
}

/// Where a layer keeps its K/V: the paged cache, or contiguous buffers.
/// write(layer, positions, k, v) then read(layer) -> k, v [B, T, Hkv, D];
/// or, when set, attend(layer, q [B, S, Hq, D]) -> [B, S, Hq, D] reads K/V itself.
struct KvStore {
  std::function<void(int64_t, const std::vector<int64_t>&, const at::Tensor&, const at::Tensor&)> write;
  std::function<std::pair<at::Tensor, at::Tensor>(int64_t)> read;
  std::function<at::Tensor(int64_t, const at::Tensor&)> attend = nullptr;
};

/// One forward pass of every layer for x [B, S, hidden]; starts[b] is the
/// position of x[b][0]; returns the last hidden state [B, S, hidden].
/// kv_dtype_attention: q and the attention output are rounded to the cache's
/// dtype (what paged_attention takes and returns), whoever attends.
at::Tensor forward(const std::vector<LayerWeights>& w, at::Tensor x, const std::vector<int64_t>& starts,
                   const KvStore& store, at::ScalarType kv_dtype, bool kv_dtype_attention) {
  const int64_t B = x.size(0), S = x.size(1);
  std::vector<int64_t> lengths(starts.size());
  for (size_t b = 0; b < starts.size(); ++b) lengths[b] = starts[b] + S;
  for (int64_t l = 0; l < kLayers; ++l) {
    const at::Tensor q = at::matmul(x, w[l].wq).view({B, S, kQueryHeads, kHeadDim});
    const at::Tensor k = at::matmul(x, w[l].wk).view({B, S, kKvHeads, kHeadDim}).to(kv_dtype);
    const at::Tensor v = at::matmul(x, w[l].wv).view({B, S, kKvHeads, kHeadDim}).to(kv_dtype);
    store.write(l, starts, k, v);
    at::Tensor attn;  // [B, S, Hq, D] float32
    if (store.attend) {
      attn = store.attend(l, q.to(kv_dtype)).to(at::kFloat);
    } else {
      const auto kv = store.read(l);
      attn = kv_dtype_attention
                 ? attend(q.to(kv_dtype).to(at::kFloat), kv.first, kv.second, lengths).to(kv_dtype).to(at::kFloat)
                 : attend(q, kv.first, kv.second, lengths);
    }
    attn = attn.reshape({B, S, kHidden});
    x = at::layer_norm(x + at::matmul(attn, w[l].wo), {kHidden});
  }
  return x;
}

/// The paged side: a cache and the SequenceTable that keeps each
/// sequence's pages (grown as tokens arrive, shared by forks).
template <class Layout>
struct PagedSide {
  pagedkv::PagedCache<Layout> cache;
  pagedkv::SequenceTable<Layout> seqs;

  PagedSide(int64_t n_pages, int64_t page_size, at::ScalarType dtype, pagedkv::KVQuant quant)
      : cache(kLayers, n_pages, page_size, kKvHeads, kHeadDim, at::TensorOptions().dtype(dtype), quant),
        seqs(cache) {}

  /// Pages for n more tokens at the end of `seq` (copy-on-write of a shared page).
  void prepare(int64_t seq, int64_t n) {
    TORCH_CHECK(seqs.prepare_append(seq, n), "attention_loop: page pool exhausted");
  }

  int64_t pages_in_use() const { return cache.n_pages() - cache.n_free(); }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class Layout>
int run(const Options& o) {
  at::manual_seed(static_cast<uint64_t>(o.seed));
  const at::ScalarType kv_dtype = dtype_of(o.dtype);
  const bool paged_attention = o.attention == "paged";
  const auto weights = random_weights();
  std::vector<int64_t> prompt_lens;
  for (int64_t b = 0; b < o.batch; ++b) {
    prompt_lens.push_back(at::randint(o.max_prompt / 4, o.max_prompt + 1, {1}).item<int64_t>());
  }
  std::vector<at::Tensor> prompts;   // [1, len, hidden] each
  std::vector<at::Tensor> token_ids;  // [len] each, with --shared-prefix
  if (o.shared_prefix > 0) {
    constexpr int64_t kVocab = 1000;
    const at::Tensor embedding = at::randn({kVocab, kHidden});
    const at::Tensor shared = at::randint(kVocab, {o.shared_prefix}, at::kLong);
    for (int64_t& len : prompt_lens) {
      len += o.shared_prefix;
      token_ids.push_back(at::cat({shared, at::randint(kVocab, {len - o.shared_prefix}, at::kLong)}));
      prompts.push_back(embedding.index_select(0, token_ids.back()).unsqueeze(0));
    }
  } else {
    for (int64_t len : prompt_lens) prompts.push_back(at::randn({1, len, kHidden}));
  }
  const int64_t max_len = *std::max_element(prompt_lens.begin(), prompt_lens.end()) + o.steps;
  // Sampled continuations: sample j > 0 of a prompt starts decoding from the
  // prompt's last hidden state plus its own noise (sample 0 from the state itself).
  const int64_t rows = o.batch * o.samples;  // decoded sequences
  at::Tensor sample_noise = at::zeros({rows, 1, kHidden});
  if (o.samples > 1) {
    sample_noise = at::randn({rows, 1, kHidden}) * 0.5;
    for (int64_t b = 0; b < o.batch; ++b) sample_noise[b * o.samples].zero_();
  }

  std::printf("pagedkv attention loop: %lld layers, %lld query heads, %lld kv heads, head_dim %lld; %s, %s, page_size %lld\n",
              static_cast<long long>(kLayers), static_cast<long long>(kQueryHeads), static_cast<long long>(kKvHeads),
              static_cast<long long>(kHeadDim), Layout::name, o.dtype.c_str(), static_cast<long long>(o.page_size));
  std::printf("batch %lld, prompt lengths", static_cast<long long>(o.batch));
  for (int64_t len : prompt_lens) std::printf(" %lld", static_cast<long long>(len));
  std::printf(", %lld decode steps, %s attention", static_cast<long long>(o.steps), o.attention.c_str());
  if (pagedkv::is_quantized(o.quant)) {
    std::printf(", K pages %s, V pages %s", pagedkv::format_name(o.quant.k), pagedkv::format_name(o.quant.v));
  }
  if (o.samples > 1) std::printf(", %lld sampled continuations per prompt", static_cast<long long>(o.samples));
  if (o.shared_prefix > 0) std::printf(", a shared prefix of %lld tokens", static_cast<long long>(o.shared_prefix));
  std::printf("\n");

  // ---- the paged run ----
  // every sequence can hold max_len tokens without sharing: the pool never runs short
  PagedSide<Layout> paged(rows * ((max_len + o.page_size - 1) / o.page_size), o.page_size, kv_dtype, o.quant);
  std::vector<int64_t> order;  // decode row -> sequence id: prompt b's samples at rows b*samples ...
  std::vector<at::Tensor> paged_out;  // per step: [B, hidden] after the prefill, then [B * samples, hidden]
  // With --shared-prefix: the prefix cache, attached to the table; the
  // first wave's requests all miss, the second wave's find its pages.
  std::unique_ptr<pagedkv::PrefixCache<Layout>> prefix;
  if (o.shared_prefix > 0) prefix = std::make_unique<pagedkv::PrefixCache<Layout>>(paged.seqs);
  const int64_t first_wave = prefix ? (o.batch + 1) / 2 : o.batch;
  const auto t_prefill = std::chrono::steady_clock::now();
  at::Tensor last = at::empty({o.batch, 1, kHidden});
  std::vector<int64_t> seq_of(static_cast<size_t>(o.batch));
  for (const auto& wave : {std::make_pair(int64_t{0}, first_wave), std::make_pair(first_wave, o.batch)}) {
    std::vector<int64_t> cached(static_cast<size_t>(o.batch), 0);  // tokens whose K/V the cache gave
    for (int64_t b = wave.first; b < wave.second; ++b) {  // the wave arrives: look its prompts up
      if (prefix) {
        const auto hit = prefix->acquire(token_ids[static_cast<size_t>(b)]);
        seq_of[static_cast<size_t>(b)] = hit.first;
        cached[static_cast<size_t>(b)] = hit.second;
      } else {
        seq_of[static_cast<size_t>(b)] = paged.seqs.create();
      }
    }
    for (int64_t b = wave.first; b < wave.second; ++b) {  // prefill each prompt on its own, as engines do
      const int64_t len = prompt_lens[static_cast<size_t>(b)];
      const int64_t seq = seq_of[static_cast<size_t>(b)];
      const int64_t from = cached[static_cast<size_t>(b)];  // only the tokens after the cached prefix
      paged.prepare(seq, len - from);
      const auto view = paged.cache.bind(paged.seqs.batch({seq}).first, at::full({1}, len, at::kLong));
      KvStore store{[&](int64_t l, const std::vector<int64_t>&, const at::Tensor& k, const at::Tensor& v) {
                      view.write(l, from, k, v);
                    },
                    [&](int64_t l) { return view.gather(l); }};
      if (paged_attention) {
        store.attend = [&](int64_t l, const at::Tensor& q) { return pagedkv::paged_attention(view, l, q); };
      }
      const at::Tensor h = forward(weights, prompts[static_cast<size_t>(b)].slice(1, from), {from}, store, kv_dtype,
                                   paged_attention);
      last[b] = h[0][h.size(1) - 1];
      paged.seqs.commit_append(seq, len - from);
    }
    if (prefix) {  // register the wave's prompt pages for later requests
      for (int64_t b = wave.first; b < wave.second; ++b)
        prefix->insert(seq_of[static_cast<size_t>(b)], token_ids[static_cast<size_t>(b)]);
    }
  }
  for (int64_t b = 0; b < o.batch; ++b) {
    order.push_back(seq_of[static_cast<size_t>(b)]);
    for (int64_t j = 1; j < o.samples; ++j) order.push_back(paged.seqs.fork(seq_of[static_cast<size_t>(b)]));
  }
  const double prefill_s = seconds_since(t_prefill);
  paged_out.push_back(last.squeeze(1).clone());
  last = last.repeat_interleave(o.samples, 0) + sample_noise;
  const auto t_decode = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < o.steps; ++step) {
    for (int64_t seq : order) paged.prepare(seq, 1);
    const auto table_lengths = paged.seqs.batch(order);
    const at::Tensor page_table = table_lengths.first;  // [B * samples, max_pages] int32
    const at::Tensor starts = table_lengths.second;     // the lengths so far: where the new token goes
    const std::vector<int64_t> start_values(starts.data_ptr<int64_t>(), starts.data_ptr<int64_t>() + rows);
    const auto view = paged.cache.bind(page_table, starts + 1);
    KvStore store{[&](int64_t l, const std::vector<int64_t>&, const at::Tensor& k, const at::Tensor& v) {
                    view.write(l, starts, k, v);
                  },
                  [&](int64_t l) { return view.gather(l); }};
    if (paged_attention) {
      store.attend = [&](int64_t l, const at::Tensor& q) { return pagedkv::paged_attention(view, l, q); };
    }
    last = forward(weights, last, start_values, store, kv_dtype, paged_attention);
    for (int64_t seq : order) paged.seqs.commit_append(seq, 1);
    paged_out.push_back(last.squeeze(1).clone());
    if ((step + 1) % 8 == 0 || step + 1 == o.steps) {
      std::printf("  decode step %lld/%lld, %lld pages in use\n", static_cast<long long>(step + 1),
                  static_cast<long long>(o.steps), static_cast<long long>(paged.pages_in_use()));
    }
  }
  const double decode_s = seconds_since(t_decode);

  // ---- the same loop on contiguous max-length buffers ----
  std::vector<at::Tensor> k_buf, v_buf;  // per layer [B, max_len, Hkv, D]
  for (int64_t l = 0; l < kLayers; ++l) {
    k_buf.push_back(at::zeros({rows, max_len, kKvHeads, kHeadDim}, kv_dtype));
    v_buf.push_back(at::zeros({rows, max_len, kKvHeads, kHeadDim}, kv_dtype));
  }
  std::vector<int64_t> lengths(static_cast<size_t>(rows), 0);
  std::vector<at::Tensor> plain_out;
  last = at::empty({o.batch, 1, kHidden});
  for (int64_t b = 0; b < o.batch; ++b) {
    const int64_t len = prompt_lens[static_cast<size_t>(b)];
    const int64_t row = b * o.samples;
    const KvStore store{[&](int64_t l, const std::vector<int64_t>&, const at::Tensor& k, const at::Tensor& v) {
                          k_buf[l][row].slice(0, 0, len).copy_(k[0]);
                          v_buf[l][row].slice(0, 0, len).copy_(v[0]);
                        },
                        [&](int64_t l) {
                          return std::make_pair(k_buf[l].slice(0, row, row + 1).slice(1, 0, len).contiguous(),
                                                v_buf[l].slice(0, row, row + 1).slice(1, 0, len).contiguous());
                        }};
    const at::Tensor h = forward(weights, prompts[static_cast<size_t>(b)], {0}, store, kv_dtype, paged_attention);
    last[b] = h[0][h.size(1) - 1];
    for (int64_t j = 0; j < o.samples; ++j) {  // every sample gets its own copy of the prompt's K/V
      if (j > 0) {
        for (int64_t l = 0; l < kLayers; ++l) {
          k_buf[l][row + j].copy_(k_buf[l][row]);
          v_buf[l][row + j].copy_(v_buf[l][row]);
        }
      }
      lengths[static_cast<size_t>(row + j)] = len;
    }
  }
  plain_out.push_back(last.squeeze(1).clone());
  last = last.repeat_interleave(o.samples, 0) + sample_noise;
  for (int64_t step = 0; step < o.steps; ++step) {
    const int64_t T = *std::max_element(lengths.begin(), lengths.end()) + 1;
    const KvStore store{[&](int64_t l, const std::vector<int64_t>& starts, const at::Tensor& k, const at::Tensor& v) {
                          for (int64_t b = 0; b < rows; ++b) {
                            k_buf[l][b][starts[static_cast<size_t>(b)]].copy_(k[b][0]);
                            v_buf[l][b][starts[static_cast<size_t>(b)]].copy_(v[b][0]);
                          }
                        },
                        [&](int64_t l) {
                          // positions past a sequence's length hold zeros, as the paged gather returns
                          return std::make_pair(k_buf[l].slice(1, 0, T).contiguous(),
                                                v_buf[l].slice(1, 0, T).contiguous());
                        }};
    last = forward(weights, last, lengths, store, kv_dtype, paged_attention);
    for (auto& n : lengths) ++n;
    plain_out.push_back(last.squeeze(1).clone());
  }

  // ---- compare, report ----
  double max_diff = 0.0;
  for (size_t i = 0; i < paged_out.size(); ++i) {
    max_diff = std::max(max_diff, (paged_out[i] - plain_out[i]).abs().max().item<double>());
  }
  const int64_t prefill_tokens = std::accumulate(prompt_lens.begin(), prompt_lens.end(), int64_t{0});
  const int64_t decode_tokens = rows * o.steps;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(kv_dtype));
  // K and V of one token, every layer: elements of the dtype, or one-byte
  // codes plus a float32 scale per head on a quantized side.
  const auto side_bytes = [&](pagedkv::KVFormat f) {
    return kLayers * kKvHeads * (pagedkv::is_quantized(f) ? kHeadDim + 4 : kHeadDim * elem);
  };
  const int64_t token_bytes = side_bytes(o.quant.k) + side_bytes(o.quant.v);
  const int64_t native_token_bytes = 2 * kLayers * kKvHeads * kHeadDim * elem;
  const int64_t page_bytes = o.page_size * token_bytes;  // k and v, every layer
  const int64_t paged_bytes = paged.pages_in_use() * page_bytes;
  const int64_t max_context = max_len;  // what contiguous buffers must reserve for every sequence
  const int64_t contiguous_bytes = 2 * kLayers * rows * max_context * kKvHeads * kHeadDim * elem;
  std::printf("max abs difference vs contiguous: %g over %zu steps\n", max_diff, paged_out.size());
  if (pagedkv::is_quantized(o.quant)) {
    std::printf("bytes per token (K and V, %lld layers): %lld quantized vs %lld %s: %lld saved (%.0f%%)\n",
                static_cast<long long>(kLayers), static_cast<long long>(token_bytes),
                static_cast<long long>(native_token_bytes), o.dtype.c_str(),
                static_cast<long long>(native_token_bytes - token_bytes),
                100.0 * static_cast<double>(native_token_bytes - token_bytes) /
                    static_cast<double>(native_token_bytes));
  }
  std::printf("prefill: %lld tokens in %.1f ms (%.0f tokens/s)\n", static_cast<long long>(prefill_tokens),
              prefill_s * 1e3, static_cast<double>(prefill_tokens) / prefill_s);
  std::printf("decode: %lld tokens in %.1f ms (%.0f tokens/s)\n", static_cast<long long>(decode_tokens),
              decode_s * 1e3, decode_s > 0 ? static_cast<double>(decode_tokens) / decode_s : 0.0);
  std::printf("pages in use: %lld of %lld (%.1f KiB); contiguous max-length buffers: %.1f KiB; saved %.1f KiB (%.0f%%)\n",
              static_cast<long long>(paged.pages_in_use()), static_cast<long long>(paged.cache.n_pages()),
              static_cast<double>(paged_bytes) / 1024, static_cast<double>(contiguous_bytes) / 1024,
              static_cast<double>(contiguous_bytes - paged_bytes) / 1024,
              100.0 * static_cast<double>(contiguous_bytes - paged_bytes) / static_cast<double>(contiguous_bytes));
  if (o.samples > 1) {
    // Without sharing every sequence would hold its own copy of each page it maps.
    int64_t mapped = 0;
    for (int64_t seq : order) mapped += static_cast<int64_t>(paged.seqs.pages(seq).size());
    const int64_t saved = mapped - paged.pages_in_use();
    std::printf("sharing: %lld sequences (%lld prompts x %lld samples) map %lld pages, %lld in use: %lld pages "
                "(%.1f KiB) saved by sharing the prompts' pages\n",
                static_cast<long long>(rows), static_cast<long long>(o.batch), static_cast<long long>(o.samples),
                static_cast<long long>(mapped), static_cast<long long>(paged.pages_in_use()),
                static_cast<long long>(saved), static_cast<double>(saved * page_bytes) / 1024);
  }
  if (prefix) {
    const pagedkv::PrefixStats st = prefix->stats();
    std::printf("prefix cache: %lld requests, hit rate %.1f%% (%lld of %lld prompt tokens), %lld prefill tokens "
                "skipped, %lld pages cached\n",
                static_cast<long long>(st.lookups),
                st.query_tokens > 0 ? 100.0 * static_cast<double>(st.hit_tokens) / static_cast<double>(st.query_tokens)
                                    : 0.0,
                static_cast<long long>(st.hit_tokens), static_cast<long long>(st.query_tokens),
                static_cast<long long>(st.hit_tokens), static_cast<long long>(prefix->n_cached()));
    prefix->check();
  }
  for (int64_t seq : order) paged.seqs.release(seq);
  if (prefix) prefix->clear();  // the cached pages nobody holds any more
  if (paged.cache.n_free() != paged.cache.n_pages()) {
    std::fprintf(stderr, "FAILED: %lld pages leaked\n",
                 static_cast<long long>(paged.cache.n_pages() - paged.cache.n_free()));
    return 1;
  }
  // gather: the same ATen attention on the same values (0 in practice).
  // paged: the kernel's float32 summation order and exp differ from ATen's
  // (~1e-6 relative); in fp16/bf16 a result near a rounding boundary can
  // round the other way (an ulp: 2^-11 / 2^-8 relative) and carry on.
  // Quantized pages: the contiguous run keeps K/V exact, so the difference
  // is the quantization error carried through the layers (fp8: 2^-4
  // relative per element; int8: scale / 2): a sanity bound, not a match.
  const double tolerance = pagedkv::is_quantized(o.quant) ? 0.5
                            : !paged_attention            ? 1e-6
                            : kv_dtype == at::kFloat      ? 1e-4
                            : kv_dtype == at::kHalf       ? 1e-2
                                                          : 5e-2;
  if (!(max_diff <= tolerance)) {
    std::fprintf(stderr, "FAILED: the paged run differs from the contiguous run by %g (tolerance %g)\n", max_diff,
                 tolerance);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return 2;
  examples::warn_if_reference_blas("attention_loop");
  try {
    return o.layout == "hnd" ? run<pagedkv::HND>(o) : run<pagedkv::NHD>(o);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "attention_loop: %s\n", e.what_without_backtrace());
    return 1;
  }
}
