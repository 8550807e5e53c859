// Model::forward: one engine step through every layer. The only file that
// instantiates pagedkv's write and attention kernels for the engine (once
// per layout), so that the files including model.hpp compile quickly.
#include "model.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "pagedkv/pagedkv.hpp"

namespace llama {

template <class Layout>
at::Tensor Model::forward_impl(pagedkv::PagedCache<Layout>& cache, const StepInput& in) const {
  const LlamaConfig& c = config_;
  const int64_t N = in.tokens.size(0);
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  const int64_t I = c.intermediate_size;
  const double scale = std::pow(static_cast<double>(D), -0.5);  // transformers' head_dim**-0.5

  std::vector<pagedkv::CacheView<Layout>> views;  // one per group, bound once for every layer
  views.reserve(in.groups.size());
  for (const AttentionGroup& g : in.groups) views.push_back(cache.bind(g.page_table, g.start + g.n_new));

  at::Tensor x = embed_.index_select(0, in.tokens.to(device_));  // [N, hidden]
  // transformers' LlamaRotaryEmbedding: position * inv_freq in float32, cos/sin, then the model dtype
  const at::Tensor freqs = in.positions.to(device_).to(at::kFloat).unsqueeze(-1) * inv_freq_.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().to(dtype_).unsqueeze(1);  // [N, 1, D]
  const at::Tensor sin = emb.sin().to(dtype_).unsqueeze(1);

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = layers_[static_cast<size_t>(l)];
    const at::Tensor qkv = at::linear(rms_norm(x, w.input_norm, c.rms_norm_eps), w.qkv);
    const at::Tensor q_raw = qkv.narrow(1, 0, Hq * D).view({N, Hq, D});
    const at::Tensor k_raw = qkv.narrow(1, Hq * D, Hkv * D).view({N, Hkv, D});
    const at::Tensor v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({N, Hkv, D});  // strided: written as is
    const at::Tensor q = q_raw * cos + rotate_half(q_raw) * sin;
    const at::Tensor k = k_raw * cos + rotate_half(k_raw) * sin;
    at::Tensor attn = at::empty({N, Hq, D}, x.options());
    for (size_t gi = 0; gi < in.groups.size(); ++gi) {
      const AttentionGroup& g = in.groups[gi];
      const pagedkv::CacheView<Layout>& view = views[gi];
      const int64_t rows = g.n_seqs * g.n_new;
      const at::Tensor kg = k.narrow(0, g.row0, rows).view({g.n_seqs, g.n_new, Hkv, D});
      const at::Tensor vg = v.narrow(0, g.row0, rows).view({g.n_seqs, g.n_new, Hkv, D});
      if (g.n_seqs == 1) {
        view.write(l, g.start.data_ptr<int64_t>()[0], kg, vg);
      } else {
        view.write(l, g.start, kg, vg);
      }
      const at::Tensor qg = q.narrow(0, g.row0, rows).view({g.n_seqs, g.n_new, Hq, D});
      attn.narrow(0, g.row0, rows).copy_(pagedkv::paged_attention(view, l, qg, scale).view({rows, Hq, D}));
    }
    x = x + at::linear(attn.view({N, Hq * D}), w.o);
    const at::Tensor gate_up = at::linear(rms_norm(x, w.post_norm, c.rms_norm_eps), w.gate_up);
    x = x + at::linear(at::silu(gate_up.narrow(1, 0, I)) * gate_up.narrow(1, I, I), w.down);
  }
  const at::Tensor last = rms_norm(x.index_select(0, in.logit_rows.to(device_)), norm_, c.rms_norm_eps);
  return at::linear(last, lm_head_).to(at::kFloat);
}

at::Tensor Model::forward(pagedkv::PagedCache<pagedkv::NHD>& cache, const StepInput& in) const {
  return forward_impl(cache, in);
}

at::Tensor Model::forward(pagedkv::PagedCache<pagedkv::HND>& cache, const StepInput& in) const {
  return forward_impl(cache, in);
}

}  // namespace llama
