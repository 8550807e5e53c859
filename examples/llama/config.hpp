// config.json of a decoder-only model as transformers writes it, read with
// the defaults transformers' config class of its family applies, and
// checked: every size positive, query heads a multiple of kv heads, an even
// head_dim (RoPE rotates pairs).
//
// Families (model_type): llama, mistral, qwen2, qwen3, gemma2, gemma3_text.
// They differ in what parse_config records beside the shapes: biases
// (qwen2's q/k/v; attention_bias), q/k RMSNorm (qwen3, gemma3_text),
// Gemma's norms, MLP and scales, and which layers attend through a sliding
// window (mistral: every layer; qwen2/qwen3: those from max_window_layers on
// when use_sliding_window; gemma2 / gemma3_text: layer_types, or their
// alternating / 5:1 default), as transformers 5's configuration and modeling
// files define them.
//
// RoPE comes in two spellings, both accepted:
//   transformers 4: top-level "rope_theta" and an optional "rope_scaling":
//                   {"rope_type" (or "type"): "llama3" | "linear", "factor", ...};
//                   gemma3_text: "rope_theta" for full-attention layers (with
//                   rope_scaling), "rope_local_base_freq" for sliding ones
//   transformers 5: "rope_parameters": {"rope_type", "rope_theta", "factor", ...};
//                   gemma3_text: one such object per layer type,
//                   {"full_attention": {...}, "sliding_attention": {...}}
// Supported rope types: default, linear and llama3 (Llama 3.1's frequency
// scaling). Anything the forward pass does not implement (another family,
// MLP biases, another activation, partial rotary, other rope types,
// bidirectional attention, layer types other than full and sliding) is
// refused by name rather than silently ignored.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "errors.hpp"

namespace llama {

struct RopeConfig {
  std::string type = "default";  ///< "default", "linear" or "llama3"
  double theta = 10000.0;
  double factor = 1.0;  ///< linear and llama3
  // llama3 only:
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192;
};

struct LlamaConfig {
  std::string model_type = "llama";  ///< one of kFamilies
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  ///< defaults to num_attention_heads (MHA)
  int64_t head_dim = 0;             ///< the family's default: hidden_size / num_attention_heads, 128 (qwen3), 256 (gemma)
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;  ///< "eos_token_id": an int, a list, or absent
  RopeConfig rope;                     ///< full-attention layers' (every layer's but gemma3_text's sliding ones)

  bool qkv_bias = false;  ///< q_proj, k_proj, v_proj have biases
  bool o_bias = false;    ///< o_proj has one
  bool qk_norm = false;   ///< RMSNorm over each head of q and k before RoPE (qwen3, gemma3_text)
  /// Gemma's block: RMSNorm as x * (1 + weight) in float32, norms after
  /// attention and around the MLP too, GELU-tanh MLP, embeddings times
  /// sqrt(hidden_size).
  bool gemma = false;
  double attn_scale = 0;     ///< multiplies q.k: head_dim^-0.5, or query_pre_attn_scalar^-0.5 (gemma)
  double attn_softcap = 0;   ///< > 0: attention logits soft-capped (gemma2's attn_logit_softcapping)
  double final_softcap = 0;  ///< > 0: output logits soft-capped (final_logit_softcapping)
  int64_t sliding_window = 0;  ///< >= 1: what a sliding layer's query sees (itself and w - 1 before); 0: none
  std::vector<bool> sliding;   ///< per layer: attends through the sliding window
  bool local_rope = false;     ///< sliding layers use rope_local (gemma3_text)
  RopeConfig rope_local;

  int64_t n_sliding_layers() const {
    int64_t n = 0;
    for (bool s : sliding) n += s ? 1 : 0;
    return n;
  }
  const RopeConfig& rope_of(int64_t layer) const {
    return local_rope && sliding[static_cast<size_t>(layer)] ? rope_local : rope;
  }
};

/// The model_type values this example serves.
inline const std::vector<std::string>& families() {
  static const std::vector<std::string> f = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"};
  return f;
}

namespace config_detail {

/// Reads fields of one JSON object and names the file and field in errors.
struct Fields {
  const std::string& file;
  const nlohmann::json& obj;
  std::string prefix;  ///< "" or "rope_parameters." for nested fields

  bool present(const char* key) const { return obj.contains(key) && !obj[key].is_null(); }
  /// Written as null: for fields whose default is not null, "none".
  bool null(const char* key) const { return obj.contains(key) && obj[key].is_null(); }
  std::string name(const char* key) const { return prefix + key; }

  int64_t positive_int(const char* key) const {
    if (!present(key)) fail(file, ": field '", name(key), "' is missing (expected an integer >= 1)");
    return positive_int(key, 0);
  }
  int64_t positive_int(const char* key, int64_t fallback) const {
    if (!present(key)) return fallback;
    const nlohmann::json& v = obj[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || (v.is_number_unsigned() && v.get<uint64_t>() > (1ull << 40))) {
      fail(file, ": field '", name(key), "' expected an integer >= 1, got ", v.dump());
    }
    return v.get<int64_t>();
  }
  /// An integer >= 0 (max_window_layers).
  int64_t non_negative_int(const char* key, int64_t fallback) const {
    if (!present(key)) return fallback;
    const nlohmann::json& v = obj[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || (v.is_number_unsigned() && v.get<uint64_t>() > (1ull << 40))) {
      fail(file, ": field '", name(key), "' expected an integer >= 0, got ", v.dump());
    }
    return v.get<int64_t>();
  }
  double positive_number(const char* key, double fallback, bool required = false) const {
    if (!present(key)) {
      if (required) fail(file, ": field '", name(key), "' is missing (expected a number > 0)");
      return fallback;
    }
    const nlohmann::json& v = obj[key];
    if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>())) {
      fail(file, ": field '", name(key), "' expected a number > 0, got ", v.dump());
    }
    return v.get<double>();
  }
  /// A number > 0, the default when absent, 0 ("none") when null.
  double optional_positive(const char* key, double fallback) const {
    return null(key) ? 0.0 : positive_number(key, fallback);
  }
  bool boolean(const char* key, bool fallback) const {
    if (!present(key)) return fallback;
    if (!obj[key].is_boolean()) fail(file, ": field '", name(key), "' expected true or false, got ", obj[key].dump());
    return obj[key].get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!present(key)) return fallback;
    if (!obj[key].is_string()) fail(file, ": field '", name(key), "' expected a string, got ", obj[key].dump());
    return obj[key].get<std::string>();
  }
};

inline void read_llama3(const Fields& f, const LlamaConfig& c, RopeConfig& r) {
  r.factor = f.positive_number("factor", 0, true);
  r.low_freq_factor = f.positive_number("low_freq_factor", 0, true);
  r.high_freq_factor = f.positive_number("high_freq_factor", 0, true);
  if (!(r.high_freq_factor > r.low_freq_factor)) {
    fail(f.file, ": field '", f.name("high_freq_factor"), "' (", r.high_freq_factor, ") must exceed '",
         f.name("low_freq_factor"), "' (", r.low_freq_factor, ")");
  }
  r.original_max_position_embeddings = static_cast<double>(
      f.positive_int("original_max_position_embeddings", c.max_position_embeddings));
}

/// A rope object's type and its type's fields (the theta is read by the caller).
inline void read_rope_type(const Fields& f, const LlamaConfig& c, RopeConfig& r) {
  r.type = f.present("rope_type") ? f.string("rope_type", "default") : f.string("type", "default");
  if (r.type != "default" && r.type != "linear" && r.type != "llama3") {
    fail(f.file, ": field '", f.name(f.present("rope_type") ? "rope_type" : "type"), "' is '", r.type,
         "'; this example implements the rope types default, linear and llama3");
  }
  if (f.present("partial_rotary_factor") && f.positive_number("partial_rotary_factor", 1.0) != 1.0) {
    fail(f.file, ": field '", f.name("partial_rotary_factor"), "' is not 1.0; only 1.0 is implemented");
  }
  if (r.type == "linear") r.factor = f.positive_number("factor", 0, true);
  if (r.type == "llama3") read_llama3(f, c, r);
}

/// transformers 5's rope_parameters object (or one layer type's), its theta
/// defaulting to `theta`.
inline RopeConfig read_rope_object(const std::string& file, const nlohmann::json& p, const std::string& field,
                                   const LlamaConfig& c, double theta) {
  if (!p.is_object()) fail(file, ": field '", field, "' expected an object, got ", p.dump());
  const Fields pf{file, p, field + "."};
  RopeConfig r;
  read_rope_type(pf, c, r);
  r.theta = pf.positive_number("rope_theta", theta);
  return r;
}

/// Which layers slide: layer_types when given, else the family's rule.
inline std::vector<bool> read_layer_types(const Fields& f, const LlamaConfig& c, const std::vector<bool>& fallback) {
  if (!f.present("layer_types")) return fallback;
  const nlohmann::json& t = f.obj["layer_types"];
  if (!t.is_array() || static_cast<int64_t>(t.size()) != c.num_hidden_layers) {
    fail(f.file, ": field 'layer_types' expected a list of num_hidden_layers (", c.num_hidden_layers,
         ") layer types, got ", t.dump());
  }
  std::vector<bool> sliding;
  for (size_t i = 0; i < t.size(); ++i) {
    const std::string type = t[i].is_string() ? t[i].get<std::string>() : t[i].dump();
    if (type != "full_attention" && type != "sliding_attention") {
      fail(f.file, ": field 'layer_types[", i, "]' is '", type,
           "'; this example implements full_attention and sliding_attention");
    }
    sliding.push_back(type == "sliding_attention");
  }
  return sliding;
}

}  // namespace config_detail

/// Parses config.json's text; `file` names it in errors. Throws InputError.
inline LlamaConfig parse_config(const std::string& file, const std::string& text) {
  using config_detail::Fields;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(file, ": not valid JSON (", e.what(), ")");
  }
  if (!j.is_object()) fail(file, ": expected a JSON object, got ", j.type_name());
  const Fields f{file, j, ""};
  LlamaConfig c;
  c.model_type = f.string("model_type", "llama");
  const std::string& family = c.model_type;
  if (std::find(families().begin(), families().end(), family) == families().end()) {
    std::string known;
    for (const std::string& name : families()) known += (known.empty() ? "" : ", ") + name;
    fail(file, ": field 'model_type' is '", family, "'; this example runs ", known,
         family == "gemma3" ? " (for Gemma 3's multimodal checkpoints, the text model's config: gemma3_text)" : "");
  }
  const bool gemma = family == "gemma2" || family == "gemma3_text";
  const bool qwen = family == "qwen2" || family == "qwen3";
  c.vocab_size = f.positive_int("vocab_size");
  c.hidden_size = f.positive_int("hidden_size");
  c.intermediate_size = f.positive_int("intermediate_size");
  c.num_hidden_layers = f.positive_int("num_hidden_layers");
  c.num_attention_heads = f.positive_int("num_attention_heads");
  c.num_key_value_heads = f.positive_int("num_key_value_heads", c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    fail(file, ": field 'num_attention_heads' (", c.num_attention_heads, ") must be a multiple of 'num_key_value_heads' (",
         c.num_key_value_heads, ")");
  }
  // transformers' defaults: qwen3's and gemma's configs fix head_dim, the others derive it.
  const bool fixed_head_dim = family == "qwen3" || gemma;
  if (!fixed_head_dim && !f.present("head_dim") && c.hidden_size % c.num_attention_heads != 0) {
    fail(file, ": field 'hidden_size' (", c.hidden_size, ") must be a multiple of 'num_attention_heads' (",
         c.num_attention_heads, ") when 'head_dim' is not given");
  }
  c.head_dim = f.positive_int("head_dim", family == "qwen3" ? 128 : gemma ? 256 : c.hidden_size / c.num_attention_heads);
  if (c.head_dim % 2 != 0) fail(file, ": field 'head_dim' expected an even number (RoPE rotates pairs), got ", c.head_dim);
  c.max_position_embeddings = f.positive_int("max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = f.positive_number("rms_norm_eps", c.rms_norm_eps);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", gemma);

  // The MLP: SwiGLU, or Gemma's GELU-tanh (transformers' Gemma reads
  // hidden_activation and ignores hidden_act).
  if (gemma) {
    const std::string act = f.string("hidden_activation", "gelu_pytorch_tanh");
    if (act != "gelu_pytorch_tanh") {
      fail(file, ": field 'hidden_activation' is '", act, "'; ", family, "'s MLP is implemented with 'gelu_pytorch_tanh'");
    }
  } else {
    const std::string act = f.string("hidden_act", "silu");
    if (act != "silu") fail(file, ": field 'hidden_act' is '", act, "'; ", family, "'s MLP is SwiGLU ('silu')");
  }
  // Biases: qwen2's q/k/v always; attention_bias (every projection of
  // attention) where the family's modeling file reads it.
  if (family == "qwen2") {
    c.qkv_bias = true;
  } else if (family != "mistral") {
    c.qkv_bias = c.o_bias = f.boolean("attention_bias", false);
  }
  if (family == "llama" && f.boolean("mlp_bias", false)) {
    fail(file, ": field 'mlp_bias' is true; this example implements the MLP without biases");
  }
  if (f.present("partial_rotary_factor") && f.positive_number("partial_rotary_factor", 1.0) != 1.0) {
    fail(file, ": field 'partial_rotary_factor' is ", j["partial_rotary_factor"].dump(), "; only 1.0 is implemented");
  }
  c.qk_norm = family == "qwen3" || family == "gemma3_text";
  c.gemma = gemma;
  c.attn_scale = std::pow(gemma ? f.positive_number("query_pre_attn_scalar", 256) : static_cast<double>(c.head_dim), -0.5);
  if (family == "gemma2") {
    c.attn_softcap = f.optional_positive("attn_logit_softcapping", 50.0);
    c.final_softcap = f.optional_positive("final_logit_softcapping", 30.0);
  } else if (family == "gemma3_text") {
    // transformers' Gemma 3 keeps attn_logit_softcapping but never applies
    // it; so neither does this example.
    c.final_softcap = f.optional_positive("final_logit_softcapping", 0.0);
    if (f.boolean("use_bidirectional_attention", false)) {
      fail(file, ": field 'use_bidirectional_attention' is true; this example implements causal attention only");
    }
  }

  // Sliding windows.
  if (family == "mistral" || gemma) {
    c.sliding_window = f.null("sliding_window") ? 0 : f.positive_int("sliding_window", 4096);
  } else if (qwen && f.boolean("use_sliding_window", false)) {
    c.sliding_window = f.null("sliding_window") ? 0 : f.positive_int("sliding_window", 4096);
  }
  const int64_t max_window_layers = qwen ? f.non_negative_int("max_window_layers", 28) : 0;
  const int64_t pattern = family == "gemma3_text" ? f.positive_int("sliding_window_pattern", 6) : 0;
  std::vector<bool> rule(static_cast<size_t>(c.num_hidden_layers), false);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    bool s = false;
    if (family == "mistral") s = true;  // transformers' Mistral slides every layer and ignores layer_types
    if (qwen) s = l >= max_window_layers;
    if (family == "gemma2") s = (l + 1) % 2 != 0;
    if (family == "gemma3_text") s = (l + 1) % pattern != 0;
    // transformers' rule for Gemma does not look at the window (a null one
    // is refused below); Mistral's and Qwen's slide only with one.
    rule[static_cast<size_t>(l)] = s && (gemma || c.sliding_window > 0);
  }
  c.sliding = family == "llama" || family == "mistral" ? rule : config_detail::read_layer_types(f, c, rule);
  if (c.sliding_window == 0 && c.n_sliding_layers() > 0) {
    fail(file, ": field 'layer_types' names sliding_attention layers, but the model has no sliding window ('sliding_window' ",
         f.null("sliding_window") ? "is null" : "is unused: 'use_sliding_window' is false", ")");
  }
  if (c.n_sliding_layers() == 0) c.sliding_window = 0;

  if (f.present("eos_token_id")) {
    const nlohmann::json& eos = j["eos_token_id"];
    const auto one = [&](const nlohmann::json& id) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= c.vocab_size) {
        fail(file, ": field 'eos_token_id' expected token ids in [0, ", c.vocab_size, "), got ", eos.dump());
      }
      c.eos_token_ids.push_back(id.get<int64_t>());
    };
    if (eos.is_array()) {
      for (const auto& id : eos) one(id);
    } else {
      one(eos);
    }
  }

  // RoPE: transformers 5's rope_parameters, else 4's rope_theta + rope_scaling.
  if (family == "gemma3_text") {
    // Two RoPEs: the global one (rope_theta, default 1e6, with the scaling)
    // on full-attention layers, the local one (default 1e4) on sliding ones.
    c.local_rope = true;
    if (f.present("rope_parameters")) {
      const nlohmann::json& p = j["rope_parameters"];
      if (!p.is_object() || !(p.contains("full_attention") || p.contains("sliding_attention"))) {
        fail(file, ": field 'rope_parameters' expected an object with 'full_attention' and 'sliding_attention' "
                   "(gemma3_text's rope parameters per layer type), got ", p.dump());
      }
      for (const auto& item : p.items()) {
        if (item.key() != "full_attention" && item.key() != "sliding_attention") {
          fail(file, ": field 'rope_parameters.", item.key(), "' is not a layer type this example implements");
        }
      }
      c.rope = p.contains("full_attention") && !p["full_attention"].is_null()
                   ? config_detail::read_rope_object(file, p["full_attention"], "rope_parameters.full_attention", c, 1e6)
                   : RopeConfig{"default", 1e6};
      c.rope_local = p.contains("sliding_attention") && !p["sliding_attention"].is_null()
                         ? config_detail::read_rope_object(file, p["sliding_attention"],
                                                           "rope_parameters.sliding_attention", c, 1e4)
                         : RopeConfig{"default", 1e4};
    } else {
      c.rope.theta = f.positive_number("rope_theta", 1e6);
      if (f.present("rope_scaling")) {
        const nlohmann::json& s = j["rope_scaling"];
        if (!s.is_object()) fail(file, ": field 'rope_scaling' expected an object or null, got ", s.dump());
        config_detail::read_rope_type(Fields{file, s, "rope_scaling."}, c, c.rope);
      }
      c.rope_local.theta = f.positive_number("rope_local_base_freq", 1e4);
    }
    return c;
  }
  RopeConfig& r = c.rope;
  if (f.present("rope_parameters")) {
    const nlohmann::json& p = j["rope_parameters"];
    if (!p.is_object()) fail(file, ": field 'rope_parameters' expected an object, got ", p.dump());
    const Fields pf{file, p, "rope_parameters."};
    if (!pf.present("rope_type") && !pf.present("type") && !pf.present("rope_theta")) {
      fail(file, ": field 'rope_parameters' holds neither 'rope_type' nor 'rope_theta' (per-layer-type rope "
                 "parameters are implemented for gemma3_text only)");
    }
    r = config_detail::read_rope_object(file, p, "rope_parameters", c, f.positive_number("rope_theta", r.theta));
  } else {
    r.theta = f.positive_number("rope_theta", r.theta);
    if (f.present("rope_scaling")) {
      const nlohmann::json& s = j["rope_scaling"];
      if (!s.is_object()) fail(file, ": field 'rope_scaling' expected an object or null, got ", s.dump());
      config_detail::read_rope_type(Fields{file, s, "rope_scaling."}, c, r);
    }
  }
  return c;
}

}  // namespace llama
