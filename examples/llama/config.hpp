// config.json of a Llama as transformers writes it, read with the defaults
// transformers' LlamaConfig applies, and checked: every size positive, query
// heads a multiple of kv heads, an even head_dim (RoPE rotates pairs).
//
// RoPE comes in two spellings, both accepted:
//   transformers 4: top-level "rope_theta" (default 10000) and an optional
//                   "rope_scaling": {"rope_type" (or "type"): "llama3", "factor", ...}
//   transformers 5: "rope_parameters": {"rope_type": "default"|"llama3", "rope_theta", "factor", ...}
// Supported rope types: default and llama3 (Llama 3.1's frequency scaling).
// Anything the forward pass does not implement (attention or MLP biases,
// another activation, partial rotary, other rope types) is refused by name
// rather than silently ignored.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "errors.hpp"

namespace llama {

struct RopeConfig {
  std::string type = "default";  ///< "default" or "llama3"
  double theta = 10000.0;
  // llama3 only:
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192;
};

struct LlamaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  ///< defaults to num_attention_heads (MHA)
  int64_t head_dim = 0;             ///< defaults to hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;  ///< "eos_token_id": an int, a list, or absent
  RopeConfig rope;
};

namespace config_detail {

/// Reads fields of one JSON object and names the file and field in errors.
struct Fields {
  const std::string& file;
  const nlohmann::json& obj;
  std::string prefix;  ///< "" or "rope_parameters." for nested fields

  bool present(const char* key) const { return obj.contains(key) && !obj[key].is_null(); }
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

inline void check_rope_type(const std::string& file, const std::string& field, const std::string& type) {
  if (type != "default" && type != "llama3") {
    fail(file, ": field '", field, "' is '", type, "'; this example implements the rope types default and llama3");
  }
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
  const std::string model_type = f.string("model_type", "llama");
  if (model_type != "llama") fail(file, ": field 'model_type' is '", model_type, "'; this example runs 'llama'");
  LlamaConfig c;
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
  if (!f.present("head_dim") && c.hidden_size % c.num_attention_heads != 0) {
    fail(file, ": field 'hidden_size' (", c.hidden_size, ") must be a multiple of 'num_attention_heads' (",
         c.num_attention_heads, ") when 'head_dim' is not given");
  }
  c.head_dim = f.positive_int("head_dim", c.hidden_size / c.num_attention_heads);
  if (c.head_dim % 2 != 0) fail(file, ": field 'head_dim' expected an even number (RoPE rotates pairs), got ", c.head_dim);
  c.max_position_embeddings = f.positive_int("max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = f.positive_number("rms_norm_eps", c.rms_norm_eps);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  const std::string act = f.string("hidden_act", "silu");
  if (act != "silu") fail(file, ": field 'hidden_act' is '", act, "'; Llama's MLP is SwiGLU ('silu')");
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    if (f.boolean(bias, false)) fail(file, ": field '", bias, "' is true; this example implements Llama without biases");
  }
  if (f.present("partial_rotary_factor") && f.positive_number("partial_rotary_factor", 1.0) != 1.0) {
    fail(file, ": field 'partial_rotary_factor' is ", j["partial_rotary_factor"].dump(), "; only 1.0 is implemented");
  }

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
  RopeConfig& r = c.rope;
  if (f.present("rope_parameters")) {
    const nlohmann::json& p = j["rope_parameters"];
    if (!p.is_object()) fail(file, ": field 'rope_parameters' expected an object, got ", p.dump());
    const Fields pf{file, p, "rope_parameters."};
    if (!pf.present("rope_type") && !pf.present("type") && !pf.present("rope_theta")) {
      fail(file, ": field 'rope_parameters' holds neither 'rope_type' nor 'rope_theta' (per-layer-type rope "
                 "parameters are not implemented)");
    }
    r.type = pf.present("rope_type") ? pf.string("rope_type", "default") : pf.string("type", "default");
    config_detail::check_rope_type(file, "rope_parameters.rope_type", r.type);
    r.theta = pf.present("rope_theta") ? pf.positive_number("rope_theta", r.theta)
                                       : f.positive_number("rope_theta", r.theta);
    if (pf.present("partial_rotary_factor") && pf.positive_number("partial_rotary_factor", 1.0) != 1.0) {
      fail(file, ": field 'rope_parameters.partial_rotary_factor' is not 1.0; only 1.0 is implemented");
    }
    if (r.type == "llama3") config_detail::read_llama3(pf, c, r);
  } else {
    r.theta = f.positive_number("rope_theta", r.theta);
    if (f.present("rope_scaling")) {
      const nlohmann::json& s = j["rope_scaling"];
      if (!s.is_object()) fail(file, ": field 'rope_scaling' expected an object or null, got ", s.dump());
      const Fields sf{file, s, "rope_scaling."};
      r.type = sf.present("rope_type") ? sf.string("rope_type", "default") : sf.string("type", "default");
      config_detail::check_rope_type(file, "rope_scaling.rope_type", r.type);
      if (r.type == "llama3") config_detail::read_llama3(sf, c, r);
    }
  }
  return c;
}

}  // namespace llama
