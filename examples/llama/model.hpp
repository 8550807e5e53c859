// The forward pass over a paged KV cache: weights loaded from a checkpoint
// (and checked against the config), RoPE as transformers computes it, and
// one engine step: the new tokens of several sequences (decode tokens and
// prefill chunks together) go through every layer as one batch of rows, so
// each projection is one matrix multiply over all of them; only attention is
// per group of sequences, and it reads and writes K/V through pagedkv alone
// (CacheView::write, paged_attention: no K/V copy outside the pages).
//
// Layers that attend through a sliding window keep their K/V in a cache of
// their own, read through a windowed SequenceTable that frees what falls
// out of the window; the other layers in the full cache (KvCaches).
//
// Numerics mirror transformers' modeling file of each family operation for
// operation (RMSNorm in float32 then `weight * x`, or Gemma's
// `x * (1 + weight)` then the dtype; cos/sin of position x inv_freq in
// float32 cast to the model dtype, rotate_half, `act(gate) * up`, Gemma's
// embedding scale in the model dtype and its soft-capped logits), so that
// float32 runs agree with transformers to float32 rounding.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.hpp"
#include "config.hpp"
#include "errors.hpp"
#include "pagedkv/pagedkv.hpp"

namespace llama {

struct LayerWeights {
  at::Tensor input_norm;  ///< [hidden]
  at::Tensor qkv;         ///< [(n_heads + 2 n_kv_heads) * head_dim, hidden]: q_proj, k_proj, v_proj stacked
  at::Tensor qkv_bias;    ///< [(n_heads + 2 n_kv_heads) * head_dim] or undefined
  at::Tensor q_norm;      ///< [head_dim] or undefined (qk_norm)
  at::Tensor k_norm;
  at::Tensor o;           ///< [hidden, n_heads * head_dim]
  at::Tensor o_bias;      ///< [hidden] or undefined
  at::Tensor post_attn_norm;  ///< [hidden], Gemma only: on attention's output
  at::Tensor pre_mlp_norm;    ///< [hidden]: post_attention_layernorm (Gemma: pre_feedforward_layernorm)
  at::Tensor post_mlp_norm;   ///< [hidden], Gemma only: on the MLP's output
  at::Tensor gate_up;     ///< [2 * intermediate, hidden]: gate_proj, up_proj stacked
  at::Tensor down;        ///< [hidden, intermediate]
};

/// The device caches of one engine: full-attention layers in `full`,
/// sliding-window layers in `sliding` (each absent when the model has no
/// such layer; layer l is layer Model::cache_layer(l) of its cache), and
/// the host caches preempted requests are swapped to (absent: they are
/// recomputed).
template <class Layout>
struct KvCaches {
  std::unique_ptr<pagedkv::PagedCache<Layout>> full, sliding;
  std::unique_ptr<pagedkv::PagedCache<Layout>> full_host, sliding_host;
};

/// Sequences whose new tokens go through one attention call: each has the
/// same number of new tokens (decode: 1; a prefill chunk: a group of its own).
struct AttentionGroup {
  int64_t row0 = 0;    ///< the group's first row among the step's tokens
  int64_t n_seqs = 0;  ///< sequences in the group
  int64_t n_new = 0;   ///< new tokens per sequence (the group's rows: n_seqs * n_new, sequence-major)
  at::Tensor page_table;  ///< [n_seqs, max_pages] int32, cpu (SequenceTable::batch): the full cache's
  at::Tensor sliding_table;  ///< the same for the sliding cache (its windowed table: -1 out of the window)
  at::Tensor start;       ///< [n_seqs] int64, cpu: tokens each sequence already has in the cache
};

/// One engine step's input.
struct StepInput {
  at::Tensor tokens;     ///< [N] int64: the new tokens, group after group
  at::Tensor positions;  ///< [N] int64: their positions in their sequences
  std::vector<AttentionGroup> groups;
  at::Tensor logit_rows;  ///< [M] int64: rows whose next-token logits are wanted
};

/// RoPE's inverse frequencies, computed with transformers' operations in
/// transformers' order (default, linear and llama3 rope types).
inline at::Tensor rope_inv_freq(const LlamaConfig& c, const RopeConfig& r) {
  const int64_t dim = c.head_dim;
  // 1.0 / (base ** (arange(0, dim, 2, int64).float() / dim)); Python's
  // `scalar / tensor` is `tensor.reciprocal() * scalar`.
  const at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / dim;
  at::Tensor inv_freq = at::reciprocal(at::pow(at::Scalar(r.theta), exponent)) * 1.0;
  if (r.type == "linear") return inv_freq / r.factor;  // `inv_freq /= factor`
  if (r.type != "llama3") return inv_freq;
  // transformers' _compute_llama3_parameters
  const double old_context_len = r.original_max_position_embeddings;
  const double low_freq_wavelen = old_context_len / r.low_freq_factor;
  const double high_freq_wavelen = old_context_len / r.high_freq_factor;
  const at::Tensor wavelen = at::reciprocal(inv_freq) * (2 * M_PI);
  at::Tensor inv_freq_llama = at::where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq);
  const at::Tensor smooth_factor =
      (at::reciprocal(wavelen) * old_context_len - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor smoothed_inv_freq =
      at::rsub(smooth_factor, 1) * inv_freq_llama / r.factor + smooth_factor * inv_freq_llama;
  const at::Tensor is_medium_freq = at::logical_not(wavelen < high_freq_wavelen) * at::logical_not(wavelen > low_freq_wavelen);
  return at::where(is_medium_freq, smoothed_inv_freq, inv_freq_llama);
}

/// The full-attention layers' frequencies (every layer's but gemma3_text's sliding ones).
inline at::Tensor rope_inv_freq(const LlamaConfig& c) { return rope_inv_freq(c, c.rope); }

/// transformers' LlamaRMSNorm: in float32, then `weight * x.to(dtype)`;
/// Gemma's (`plus_one`: `weight` is 1 + the stored weight, in float32):
/// `(x * weight).to(dtype)`.
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one = false) {
  at::Tensor h = x.to(at::kFloat);
  const at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  if (plus_one) return (h * weight).to(x.scalar_type());
  return weight * h.to(x.scalar_type());
}

/// transformers' rotate_half: [x1, x2] -> [-x2, x1] along the last dim.
inline at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

class Model {
 public:
  /// Loads and checks every weight; converts them to `dtype` on `device`.
  Model(const LlamaConfig& config, const Checkpoint& ckpt, at::ScalarType dtype, at::Device device)
      : config_(config), dtype_(dtype), device_(device) {
    const LlamaConfig& c = config_;
    const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
    const int64_t q_rows = c.num_attention_heads * D, kv_rows = c.num_key_value_heads * D;
    std::set<std::string> used;
    const auto take = [&](const std::string& name, std::vector<int64_t> shape, const std::string& why) {
      used.insert(name);
      return ckpt.take(name, shape, "config.json (" + why + ")").to(device_, dtype_);
    };
    // Gemma's norms multiply by (1 + weight), computed in float32 from the
    // weight in the model dtype, as transformers' forward does at each call.
    const auto norm = [&](const std::string& name, int64_t size, const std::string& why) {
      const at::Tensor w = take(name, {size}, why);
      return c.gemma ? w.to(at::kFloat) + 1.0 : w;
    };
    const std::string hidden = "hidden_size " + std::to_string(H);
    const std::string vocab = "vocab_size " + std::to_string(c.vocab_size) + ", " + hidden;
    const std::string q_dims = "num_attention_heads " + std::to_string(c.num_attention_heads) + " x head_dim " +
                               std::to_string(D);
    const std::string kv_dims = "num_key_value_heads " + std::to_string(c.num_key_value_heads) + " x head_dim " +
                                std::to_string(D);
    const std::string mlp = "intermediate_size " + std::to_string(I) + ", " + hidden;
    embed_ = take("model.embed_tokens.weight", {c.vocab_size, H}, vocab);
    int64_t n_full = 0, n_sliding = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      LayerWeights w;
      w.input_norm = norm(p + "input_layernorm.weight", H, hidden);
      w.qkv = at::cat({take(p + "self_attn.q_proj.weight", {q_rows, H}, q_dims + ", " + hidden),
                       take(p + "self_attn.k_proj.weight", {kv_rows, H}, kv_dims + ", " + hidden),
                       take(p + "self_attn.v_proj.weight", {kv_rows, H}, kv_dims + ", " + hidden)});
      if (c.qkv_bias) {
        const std::string why = c.model_type == "qwen2" ? "qwen2's q/k/v biases" : "attention_bias true";
        w.qkv_bias = at::cat({take(p + "self_attn.q_proj.bias", {q_rows}, q_dims + ", " + why),
                              take(p + "self_attn.k_proj.bias", {kv_rows}, kv_dims + ", " + why),
                              take(p + "self_attn.v_proj.bias", {kv_rows}, kv_dims + ", " + why)});
      }
      if (c.qk_norm) {
        const std::string why = "head_dim " + std::to_string(D) + ", " + c.model_type + "'s q/k norms";
        w.q_norm = norm(p + "self_attn.q_norm.weight", D, why);
        w.k_norm = norm(p + "self_attn.k_norm.weight", D, why);
      }
      w.o = take(p + "self_attn.o_proj.weight", {H, q_rows}, hidden + ", " + q_dims);
      if (c.o_bias) w.o_bias = take(p + "self_attn.o_proj.bias", {H}, hidden + ", attention_bias true");
      if (c.gemma) {
        w.post_attn_norm = norm(p + "post_attention_layernorm.weight", H, hidden);
        w.pre_mlp_norm = norm(p + "pre_feedforward_layernorm.weight", H, hidden);
        w.post_mlp_norm = norm(p + "post_feedforward_layernorm.weight", H, hidden);
      } else {
        w.pre_mlp_norm = norm(p + "post_attention_layernorm.weight", H, hidden);
      }
      w.gate_up = at::cat({take(p + "mlp.gate_proj.weight", {I, H}, mlp), take(p + "mlp.up_proj.weight", {I, H}, mlp)});
      w.down = take(p + "mlp.down_proj.weight", {H, I}, hidden + ", intermediate_size " + std::to_string(I));
      layers_.push_back(std::move(w));
      cache_layer_.push_back(c.sliding[static_cast<size_t>(l)] ? n_sliding++ : n_full++);
    }
    norm_ = norm("model.norm.weight", H, hidden);
    if (c.tie_word_embeddings) {
      lm_head_ = embed_;  // transformers ties them: a stored lm_head.weight is not used
      used.insert("lm_head.weight");
    } else {
      lm_head_ = take("lm_head.weight", {c.vocab_size, H}, vocab + ", tie_word_embeddings false");
    }
    for (const std::string& name : ckpt.names()) {
      const std::string suffix = "rotary_emb.inv_freq";  // a buffer older checkpoints saved; recomputed here
      const bool rotary = name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
      if (used.count(name) == 0 && !rotary) {
        fail("checkpoint: tensor '", name, "' is not part of the ", c.num_hidden_layers, "-layer ", c.model_type,
             " model that config.json describes (a config that disagrees with the weights?)");
      }
    }
    inv_freq_ = rope_inv_freq(c, c.rope).to(device_);
    if (c.local_rope) inv_freq_local_ = rope_inv_freq(c, c.rope_local).to(device_);
    if (c.gemma) {
      // transformers' scaled embedding: sqrt(hidden_size) as a float32
      // tensor, cast to the weights' dtype before the multiply.
      embed_scale_ = at::scalar_tensor(std::sqrt(static_cast<double>(H)), at::kFloat).to(device_, dtype_);
    }
  }

  const LlamaConfig& config() const noexcept { return config_; }
  at::ScalarType dtype() const noexcept { return dtype_; }
  at::Device device() const noexcept { return device_; }
  /// Layers in the full cache and in the sliding one.
  int64_t n_full_layers() const noexcept { return config_.num_hidden_layers - config_.n_sliding_layers(); }
  int64_t n_sliding_layers() const noexcept { return config_.n_sliding_layers(); }
  /// Layer `layer`'s index in its cache (the full or the sliding one).
  int64_t cache_layer(int64_t layer) const { return cache_layer_[static_cast<size_t>(layer)]; }

  /// One step: every group's new tokens through every layer (their K/V
  /// written into the caches), then the logits of the rows in
  /// in.logit_rows, [M, vocab] float32. Defined in model.cpp, the one file
  /// that compiles pagedkv's write and attention kernels for the engine.
  at::Tensor forward(KvCaches<pagedkv::NHD>& caches, const StepInput& in) const;
  at::Tensor forward(KvCaches<pagedkv::HND>& caches, const StepInput& in) const;

 private:
  template <class Layout>
  at::Tensor forward_impl(KvCaches<Layout>& caches, const StepInput& in) const;

  LlamaConfig config_;
  at::ScalarType dtype_;
  at::Device device_;
  at::Tensor embed_;    // [vocab, hidden]
  at::Tensor embed_scale_;  // Gemma: a 0-dim tensor in the model dtype
  at::Tensor norm_;     // [hidden]
  at::Tensor lm_head_;  // [vocab, hidden]
  at::Tensor inv_freq_;  // [head_dim / 2] float32
  at::Tensor inv_freq_local_;  // gemma3_text's sliding layers'
  std::vector<LayerWeights> layers_;
  std::vector<int64_t> cache_layer_;
};

}  // namespace llama
