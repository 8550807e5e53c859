// docs/attention.md: paged_attention for a prefill chunk and a decode step,
// checked against softmax(q k^T / sqrt(D)) v over the gathered K/V.
#include <pagedkv/pagedkv.hpp>

#include <cmath>
#include <vector>

#include "samples.hpp"

namespace docs {
namespace {

/// Causal GQA attention of q [1, Sq, Hq, D] over k, v [1, T, H, D] (float32):
/// query s sits at position T - Sq + s.
at::Tensor attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t n_queries = q.size(1), length = k.size(1), group = q.size(2) / k.size(2);
  const at::Tensor qh = q[0].to(at::kFloat).permute({1, 0, 2});                              // [Hq, Sq, D]
  const at::Tensor kh = k[0].to(at::kFloat).repeat_interleave(group, 1).permute({1, 2, 0});  // [Hq, D, T]
  const at::Tensor vh = v[0].to(at::kFloat).repeat_interleave(group, 1).permute({1, 0, 2});  // [Hq, T, D]
  at::Tensor scores = at::matmul(qh, kh) / std::sqrt(static_cast<double>(q.size(3)));
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
}

}  // namespace docs
