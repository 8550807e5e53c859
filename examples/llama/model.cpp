// Model::forward: one engine step through every layer. The only file that
// instantiates pagedkv's write and attention kernels for the engine (once
// per layout), so that the files including model.hpp compile quickly.
#include "model.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "pagedkv/pagedkv.hpp"

namespace llama {

template <class Layout>
at::Tensor Model::forward_impl(KvCaches<Layout>& caches, const StepInput& in) const {
  const LlamaConfig& c = config_;
  const int64_t N = in.tokens.size(0);
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  const int64_t I = c.intermediate_size;
  const bool g = c.gemma;

  // One view per group and cache, bound once for every layer.
  std::vector<pagedkv::CacheView<Layout>> full_views, sliding_views;
  for (const AttentionGroup& group : in.groups) {
    const at::Tensor lengths = group.start + group.n_new;
    if (caches.full) full_views.push_back(caches.full->bind(group.page_table, lengths));
    if (caches.sliding) sliding_views.push_back(caches.sliding->bind(group.sliding_table, lengths));
  }

  at::Tensor x = embed_.index_select(0, in.tokens.to(device_));  // [N, hidden]
  if (g) x = x * embed_scale_;
  // transformers' rotary embedding: position * inv_freq in float32, cos/sin, then the model dtype
  const at::Tensor positions = in.positions.to(device_).to(at::kFloat).unsqueeze(-1);
  const auto cos_sin = [&](const at::Tensor& inv_freq) {
    const at::Tensor freqs = positions * inv_freq.unsqueeze(0);
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    return std::make_pair(emb.cos().to(dtype_).unsqueeze(1), emb.sin().to(dtype_).unsqueeze(1));  // [N, 1, D]
  };
  const auto [cos, sin] = cos_sin(inv_freq_);
  at::Tensor cos_local, sin_local;
  if (c.local_rope) std::tie(cos_local, sin_local) = cos_sin(inv_freq_local_);

  pagedkv::AttentionOptions full_options, sliding_options;
  full_options.scale = sliding_options.scale = c.attn_scale;
  full_options.softcap = sliding_options.softcap = c.attn_softcap;
  sliding_options.window = c.sliding_window;

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = layers_[static_cast<size_t>(l)];
    const bool sliding = c.sliding[static_cast<size_t>(l)];
    const at::Tensor qkv = at::linear(rms_norm(x, w.input_norm, c.rms_norm_eps, g), w.qkv, w.qkv_bias);
    at::Tensor q_raw = qkv.narrow(1, 0, Hq * D).view({N, Hq, D});
    at::Tensor k_raw = qkv.narrow(1, Hq * D, Hkv * D).view({N, Hkv, D});
    const at::Tensor v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({N, Hkv, D});  // strided: written as is
    if (c.qk_norm) {
      q_raw = rms_norm(q_raw, w.q_norm, c.rms_norm_eps, g);
      k_raw = rms_norm(k_raw, w.k_norm, c.rms_norm_eps, g);
    }
    const bool local = c.local_rope && sliding;
    const at::Tensor& lcos = local ? cos_local : cos;
    const at::Tensor& lsin = local ? sin_local : sin;
    const at::Tensor q = q_raw * lcos + rotate_half(q_raw) * lsin;
    const at::Tensor k = k_raw * lcos + rotate_half(k_raw) * lsin;
    const std::vector<pagedkv::CacheView<Layout>>& views = sliding ? sliding_views : full_views;
    const pagedkv::AttentionOptions& options = sliding ? sliding_options : full_options;
    const int64_t layer = cache_layer_[static_cast<size_t>(l)];
    at::Tensor attn = at::empty({N, Hq, D}, x.options());
    for (size_t gi = 0; gi < in.groups.size(); ++gi) {
      const AttentionGroup& group = in.groups[gi];
      const pagedkv::CacheView<Layout>& view = views[gi];
      const int64_t rows = group.n_seqs * group.n_new;
      const at::Tensor kg = k.narrow(0, group.row0, rows).view({group.n_seqs, group.n_new, Hkv, D});
      const at::Tensor vg = v.narrow(0, group.row0, rows).view({group.n_seqs, group.n_new, Hkv, D});
      if (group.n_seqs == 1) {
        view.write(layer, group.start.data_ptr<int64_t>()[0], kg, vg);
      } else {
        view.write(layer, group.start, kg, vg);
      }
      const at::Tensor qg = q.narrow(0, group.row0, rows).view({group.n_seqs, group.n_new, Hq, D});
      attn.narrow(0, group.row0, rows).copy_(pagedkv::paged_attention(view, layer, qg, options).view({rows, Hq, D}));
    }
    at::Tensor out = at::linear(attn.view({N, Hq * D}), w.o, w.o_bias);
    if (g) out = rms_norm(out, w.post_attn_norm, c.rms_norm_eps, g);
    x = x + out;
    const at::Tensor gate_up = at::linear(rms_norm(x, w.pre_mlp_norm, c.rms_norm_eps, g), w.gate_up);
    const at::Tensor gate = gate_up.narrow(1, 0, I), up = gate_up.narrow(1, I, I);
    at::Tensor mlp = at::linear((g ? at::gelu(gate, "tanh") : at::silu(gate)) * up, w.down);
    if (g) mlp = rms_norm(mlp, w.post_mlp_norm, c.rms_norm_eps, g);
    x = x + mlp;
  }
  const at::Tensor last = rms_norm(x.index_select(0, in.logit_rows.to(device_)), norm_, c.rms_norm_eps, g);
  at::Tensor logits = at::linear(last, lm_head_);
  if (c.final_softcap > 0) logits = at::tanh(logits / c.final_softcap) * c.final_softcap;
  return logits.to(at::kFloat);
}

at::Tensor Model::forward(KvCaches<pagedkv::NHD>& caches, const StepInput& in) const {
  return forward_impl(caches, in);
}

at::Tensor Model::forward(KvCaches<pagedkv::HND>& caches, const StepInput& in) const {
  return forward_impl(caches, in);
}

}  // namespace llama
