// docs/attention.md: paged_attention for a prefill chunk and a decode step,
// checked against softmax(q k^T / sqrt(D)) v over the gathered K/V.
#include <pagedkv/pagedkv.hpp>

#include <cmath>
#include <vector>

#include "samples.hpp"

namespace docs {
namespace {

/// Causal GQA attention of q [1, Sq, Hq, D] over k, v [1, T, H, D] (float32):
/// query s sits at position T - Sq + s; logits soft-capped at `softcap` (> 0).
at::Tensor attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softcap = 0.0) {
  const int64_t n_queries = q.size(1), length = k.size(1), group = q.size(2) / k.size(2);
  const at::Tensor qh = q[0].to(at::kFloat).permute({1, 0, 2});                              // [Hq, Sq, D]
  const at::Tensor kh = k[0].to(at::kFloat).repeat_interleave(group, 1).permute({1, 2, 0});  // [Hq, D, T]
  const at::Tensor vh = v[0].to(at::kFloat).repeat_interleave(group, 1).permute({1, 0, 2});  // [Hq, T, D]
  at::Tensor scores = at::matmul(qh, kh) / std::sqrt(static_cast<double>(q.size(3)));
  if (softcap > 0.0) scores = at::tanh(scores / softcap) * softcap;
  const at::Tensor last = at::arange(n_queries).view({n_queries, 1}) + (length - n_queries);
  scores.masked_fill_(at::arange(length).view({1, length}).gt(last), -INFINITY);
  return at::matmul(at::softmax(scores, -1), vh).permute({1, 0, 2}).unsqueeze(0);  // [1, Sq, Hq, D]
}

/// max |a - b| / max |b|.
double relative_error(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b).abs().max().item<double>() / b.abs().max().item<double>();
}

}  // namespace

void attention_sample() {
  //! [setup]
  // 32 query heads over 8 kv heads (GQA, 4 per group), head_dim 128, bf16 pages.
  pagedkv::PagedCache<pagedkv::HND> cache(/*n_layers=*/1, /*n_pages=*/64, /*page_size=*/16,
                                          /*n_kv_heads=*/8, /*head_dim=*/128, at::TensorOptions().dtype(at::kBFloat16));
  at::Tensor page_table = at::tensor(cache.alloc_n(3), at::kInt).view({1, 3});  // room for 48 tokens
  const int64_t layer = 0;
  //! [setup]
  const auto bf16 = [](std::vector<int64_t> shape) { return at::randn(shape).to(at::kBFloat16); };
  const at::Tensor k = bf16({1, 40, 8, 128}), v = bf16({1, 40, 8, 128}), q = bf16({1, 40, 32, 128});
  const at::Tensor k1 = bf16({1, 1, 8, 128}), v1 = bf16({1, 1, 8, 128}), q1 = bf16({1, 1, 32, 128});

  //! [prefill]
  // Prefill: write the prompt's K/V first; lengths count them. Causal over the 40 tokens.
  const auto prefill = cache.bind(page_table, /*lengths=*/at::tensor({40}, at::kLong));
  prefill.write(layer, /*start_pos=*/0, k, v);                   // k, v: [1, 40, 8, 128]
  at::Tensor out = pagedkv::paged_attention(prefill, layer, q);  // q: [1, 40, 32, 128] -> [1, 40, 32, 128]
  //! [prefill]
  expect(out.sizes() == q.sizes() && out.scalar_type() == at::kBFloat16, "[B, Sq, n_heads, D] in q's dtype");
  expect(relative_error(out, attention_reference(q, k, v)) < 2e-2, "prefill attention within 2e-2 (bf16)");

  //! [decode]
  // Decode: one new token at position 40; lengths count it too.
  const auto step = cache.bind(page_table, at::tensor({41}, at::kLong));
  step.write(layer, /*start_pos=*/40, k1, v1);                  // [1, 1, 8, 128]
  at::Tensor out1 = pagedkv::paged_attention(step, layer, q1);  // [1, 1, 32, 128]
  //! [decode]
  expect(relative_error(out1, attention_reference(q1, at::cat({k, k1}, 1), at::cat({v, v1}, 1))) < 2e-2,
         "decode attention within 2e-2 (bf16)");

  //! [isa]
  namespace simd = pagedkv::simd;
  namespace cpu_attention = pagedkv::cpu::attention;
  const char* path = simd::isa_name(simd::selected_isa());  // "avx512", "avx2" or "portable": what this CPU runs
  {
    simd::ScopedIsa portable(simd::Isa::portable);  // this thread, this scope: the portable loops
    at::Tensor slow = pagedkv::paged_attention(step, layer, q1);
  }
  //! [isa]
  expect(path != nullptr, "a path name");
  {
    simd::ScopedIsa portable(simd::Isa::portable);
    expect(relative_error(pagedkv::paged_attention(step, layer, q1), out1.to(at::kFloat)) < 2e-2,
           "the portable loops to agree with the vector path");
  }

  {
    //! [decode-step]
    const char* decode = cpu_attention::decode_step_isa_name(simd::selected_isa());  // "avx512", "avx2, ...", or nullptr
    const cpu_attention::ScopedDecodeStep wide(cpu_attention::DecodeStep::avx512);  // this thread: the 512-bit step (AVX-512 CPUs)
    at::Tensor wide_out = pagedkv::paged_attention(step, layer, q1);
    //! [decode-step]
    expect(decode != nullptr || simd::selected_isa() == simd::Isa::portable, "a decode step on the vector paths");
    expect(relative_error(wide_out, out1.to(at::kFloat)) < 2e-2, "either decode step to agree with the other");
  }

  //! [scale]
  // scale defaults to 1/sqrt(head_dim); pass another, e.g. a model's own softmax scale:
  at::Tensor scaled = pagedkv::paged_attention(step, layer, q1, /*scale=*/0.05);
  //! [scale]
  expect(relative_error(scaled, attention_reference(q1.to(at::kFloat) * (0.05 * std::sqrt(128.0)), at::cat({k, k1}, 1),
                                                    at::cat({v, v1}, 1))) < 2e-2,
         "an explicit scale");

  const at::Tensor k_all = at::cat({k, k1}, 1), v_all = at::cat({v, v1}, 1);  // positions 0..40
  {
    //! [window-softcap]
    // Gemma 2's attention: a sliding window of 4096 positions and logits soft-capped at 50.
    pagedkv::AttentionOptions options;
    options.window = 4096;   // the query at position p sees [p - 4095, p]
    options.softcap = 50.0;  // every scaled logit x becomes 50 * tanh(x / 50)
    at::Tensor capped = pagedkv::paged_attention(step, layer, q1, options);
    //! [window-softcap]
    expect(relative_error(capped, attention_reference(q1, k_all, v_all, 50.0)) < 2e-2, "window and soft-cap");
  }
  {
    pagedkv::AttentionOptions options;
    options.window = 8;
    const at::Tensor windowed = pagedkv::paged_attention(step, layer, q1, options);
    expect(relative_error(windowed, attention_reference(q1, k_all.narrow(1, 33, 8), v_all.narrow(1, 33, 8))) < 2e-2,
           "a window of 8: positions 33..40 only");
  }
  {
    //! [sinks]
    // gpt-oss: one learned logit per query head joins the softmax's denominator, adding no value.
    pagedkv::AttentionOptions options;
    options.sinks = at::full({32}, 2.0, at::kFloat);  // [n_heads] float32, on the cache's device
    at::Tensor with_sinks = pagedkv::paged_attention(step, layer, q1, options);
    //! [sinks]
    // Without the sink the weights sum to 1; with it to 1 / (1 + exp(2 - logsumexp)): smaller outputs.
    expect(with_sinks.to(at::kFloat).abs().sum().item<double>() < out1.to(at::kFloat).abs().sum().item<double>(),
           "a sink takes weight from the values");
  }
  {
    const at::Tensor k3 = bf16({1, 3, 8, 128}), v3 = bf16({1, 3, 8, 128}), q3 = bf16({1, 3, 32, 128});
    //! [tree]
    // Speculative decoding: new token 0 and two drafted continuations of it, 1 and 2, verified
    // in one pass as a tree: each query sees the context, itself and its ancestors.
    const auto verify = cache.bind(page_table, at::tensor({44}, at::kLong));  // 41 + 3 new tokens
    verify.write(layer, /*start_pos=*/41, k3, v3);                            // [1, 3, 8, 128]
    pagedkv::AttentionOptions tree;
    tree.tree_mask = at::tensor({1, 0, 0,    // query 0 sees new token 0
                                 1, 1, 0,    // query 1: 0 and 1
                                 1, 0, 1})   // query 2: 0 and 2 (not its sibling 1)
                         .view({1, 3, 3}).to(at::kBool);  // [B, Sq, Sq] bool
    at::Tensor drafts = pagedkv::paged_attention(verify, layer, q3, tree);  // [1, 3, 32, 128]
    //! [tree]
    const at::Tensor context_k = at::cat({k_all, k3.narrow(1, 0, 1), k3.narrow(1, 2, 1)}, 1);
    const at::Tensor context_v = at::cat({v_all, v3.narrow(1, 0, 1), v3.narrow(1, 2, 1)}, 1);
    expect(relative_error(drafts.narrow(1, 2, 1), attention_reference(q3.narrow(1, 2, 1), context_k, context_v)) <
               2e-2,
           "query 2 sees the context, new token 0 and itself");
  }
}

}  // namespace docs
