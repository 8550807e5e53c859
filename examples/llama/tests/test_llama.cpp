// The llama example's pieces without transformers (make test runs this
// against Debian's libtorch; check_transformers.py is the comparison with
// transformers): the safetensors reader on good, truncated and corrupt
// files; the checkpoint against configs that disagree with it; config.json
// in both RoPE spellings and the llama3 frequencies against a double
// precision formula; the request reader's file:line:field messages; and the
// engine (scheduler + model over pagedkv) against a plain forward pass that
// recomputes every sequence from scratch with contiguous attention, under
// both layouts, several page sizes, the prefix cache on and off, one request
// at a time and all at once, and pools small enough to force preemption.
#include <gtest/gtest.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../../../fuzz/llama_inputs.hpp"
#include "../checkpoint.hpp"
#include "../config.hpp"
#include "../model.hpp"
#include "../requests.hpp"
#include "../safetensors.hpp"
#include "../scheduler.hpp"

namespace {

namespace fs = std::filesystem;
using llama::InputError;

// ---- helpers ----

/// Expects `f` to throw InputError whose message contains every fragment.
void expect_input_error(const std::function<void()>& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "no InputError thrown; expected one mentioning " << *fragments.begin();
  } catch (const InputError& e) {
    for (const char* fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "message '" << e.what() << "' lacks '" << fragment << "'";
    }
  }
}

struct StEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

/// A safetensors file as save_pretrained writes it (header padded to 8 bytes).
std::string safetensors_bytes(const std::vector<StEntry>& entries, const std::string& header_override = "") {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const StEntry& e : entries) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {data.size(), data.size() + e.bytes.size()}}};
    data += e.bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string h = header_override.empty() ? header.dump() : header_override;
  while (h.size() % 8 != 0) h += ' ';
  std::string out(8, '\0');
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + h + data;
}

std::string tensor_bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel() * c.element_size()));
}

StEntry f32(const std::string& name, const at::Tensor& t) {
  return {name, "F32", t.sizes().vec(), tensor_bytes(t.to(at::kFloat))};
}

llama::SafetensorsHeader parse_bytes(const std::string& bytes) {
  return llama::SafetensorsHeader::parse("test.safetensors", reinterpret_cast<const uint8_t*>(bytes.data()),
                                         bytes.size());
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

/// A fresh, empty folder under the temp directory.
fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("pagedkv-llama-test-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// ---- safetensors ----

TEST(Safetensors, ReadsWhatWasWritten) {
  const at::Tensor a = at::randn({3, 4});
  const at::Tensor b = at::randn({5}).to(at::kBFloat16);
  const std::string bytes = safetensors_bytes({f32("a", a), {"b", "BF16", {5}, tensor_bytes(b)}, {"empty", "F16", {0, 7}, ""}});
  const llama::SafetensorsHeader h = parse_bytes(bytes);
  ASSERT_EQ(h.tensors().size(), 3u);
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  EXPECT_TRUE(at::equal(llama::read_tensor("f", data, bytes.size(), h, "a"), a));
  EXPECT_TRUE(at::equal(llama::read_tensor("f", data, bytes.size(), h, "b"), b));
  EXPECT_EQ(llama::read_tensor("f", data, bytes.size(), h, "empty").sizes(), (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(h.metadata()["format"], "pt");
}

TEST(Safetensors, EveryTruncationIsAnErrorNamingTheFile) {
  const std::string bytes = safetensors_bytes({f32("w", at::randn({2, 3})), f32("x", at::randn({4}))});
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::string cut = bytes.substr(0, n);
    expect_input_error([&] { parse_bytes(cut); }, {"test.safetensors"});
  }
}

TEST(Safetensors, CorruptHeadersAreNamed) {
  const std::string w = tensor_bytes(at::randn({2, 2}));
  const auto with_header = [&](const std::string& header) {
    std::string h = header;
    while (h.size() % 8 != 0) h += ' ';
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
    return out + h + w;
  };
  const auto bad = [&](const std::string& header, std::initializer_list<const char*> fragments) {
    const std::string bytes = with_header(header);
    expect_input_error([&] { parse_bytes(bytes); }, fragments);
  };
  bad("{not json", {"not valid JSON"});
  bad("[1, 2]", {"not a JSON object"});
  bad(R"({"w": 5})", {"tensor 'w'", "not an object"});
  bad(R"({"w": {"shape": [2, 2], "data_offsets": [0, 16]}})", {"tensor 'w'", "'dtype'"});
  bad(R"({"w": {"dtype": "F33", "shape": [2, 2], "data_offsets": [0, 16]}})", {"tensor 'w'", "unknown dtype 'F33'"});
  bad(R"({"w": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}})", {"tensor 'w'", "not a dim >= 0"});
  bad(R"({"w": {"dtype": "F32", "shape": [2, 2.0], "data_offsets": [0, 16]}})", {"not a dim >= 0"});
  bad(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 16]}})", {"impossibly large"});
  bad(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}})", {"end before they begin"});
  bad(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}})", {"'data_offsets'"});
  bad(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}})", {"run past the data section"});
  bad(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}})", {"hold 16 bytes", "needs 24"});
  bad(R"({"w": {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8]}, "v": {"dtype": "F32", "shape": [2, 1], "data_offsets": [4, 12]}})",
      {"overlap"});
  bad(R"({"__metadata__": [1]})", {"__metadata__"});
  // a header length past the file, and one past the format's limit
  std::string past = with_header("{}");
  past[0] = static_cast<char>(0xff);
  expect_input_error([&] { parse_bytes(past); }, {"runs past the end of the file"});
}

TEST(Safetensors, NonWeightDtypesParseButDoNotLoad) {
  const std::string bytes = safetensors_bytes({{"steps", "I64", {2}, std::string(16, '\0')}});
  const llama::SafetensorsHeader h = parse_bytes(bytes);
  expect_input_error([&] { llama::read_tensor("f", reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), h, "steps"); },
                     {"tensor 'steps'", "I64", "F32, F16 or BF16"});
}

// ---- a tiny checkpoint ----

struct TinySpec {
  int64_t vocab = 61, hidden = 32, intermediate = 48, layers = 2, heads = 4, kv_heads = 2, head_dim = 8;
  bool tie = false;
  bool llama3 = false;
  /// >= 1: a Qwen2 instead (q/k/v biases) whose layers from 1 on attend
  /// through a sliding window of this many tokens.
  int64_t window = 0;
};

/// Random weights of a tiny Llama, by transformers' tensor names.
std::map<std::string, at::Tensor> tiny_weights(const TinySpec& s, uint64_t seed) {
  at::manual_seed(seed);
  std::map<std::string, at::Tensor> w;
  const auto lin = [&](int64_t out, int64_t in) { return at::randn({out, in}) * (1.5 / std::sqrt(static_cast<double>(in))); };
  const auto norm = [&](int64_t n) { return 1 + 0.25 * at::randn({n}); };
  w["model.embed_tokens.weight"] = 0.1 * at::randn({s.vocab, s.hidden});
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    w[p + "input_layernorm.weight"] = norm(s.hidden);
    w[p + "self_attn.q_proj.weight"] = lin(s.heads * s.head_dim, s.hidden);
    w[p + "self_attn.k_proj.weight"] = lin(s.kv_heads * s.head_dim, s.hidden);
    w[p + "self_attn.v_proj.weight"] = lin(s.kv_heads * s.head_dim, s.hidden);
    w[p + "self_attn.o_proj.weight"] = lin(s.hidden, s.heads * s.head_dim);
    w[p + "post_attention_layernorm.weight"] = norm(s.hidden);
    w[p + "mlp.gate_proj.weight"] = lin(s.intermediate, s.hidden);
    w[p + "mlp.up_proj.weight"] = lin(s.intermediate, s.hidden);
    w[p + "mlp.down_proj.weight"] = lin(s.hidden, s.intermediate);
  }
  w["model.norm.weight"] = 4 * norm(s.hidden);
  if (!s.tie) w["lm_head.weight"] = lin(s.vocab, s.hidden);
  for (int64_t l = 0; s.window > 0 && l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
    w[p + "q_proj.bias"] = 0.5 * at::randn({s.heads * s.head_dim});
    w[p + "k_proj.bias"] = 0.5 * at::randn({s.kv_heads * s.head_dim});
    w[p + "v_proj.bias"] = 0.5 * at::randn({s.kv_heads * s.head_dim});
  }
  return w;
}

nlohmann::json tiny_config(const TinySpec& s) {
  nlohmann::json c = {{"model_type", "llama"},          {"vocab_size", s.vocab},
                      {"hidden_size", s.hidden},        {"intermediate_size", s.intermediate},
                      {"num_hidden_layers", s.layers},  {"num_attention_heads", s.heads},
                      {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
                      {"rms_norm_eps", 1e-5},           {"tie_word_embeddings", s.tie},
                      {"eos_token_id", nullptr},        {"max_position_embeddings", 256}};
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  if (s.llama3) {
    c["rope_parameters"] = {{"rope_type", "llama3"},     {"rope_theta", 500000.0},
                            {"factor", 4.0},             {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0},   {"original_max_position_embeddings", 32}};
  }
  if (s.window > 0) {
    c["model_type"] = "qwen2";
    c["use_sliding_window"] = true;
    c["sliding_window"] = s.window;
    c["max_window_layers"] = 1;
  }
  return c;
}

void write_checkpoint(const fs::path& dir, const nlohmann::json& config, const std::map<std::string, at::Tensor>& w) {
  write_file(dir / "config.json", config.dump(2));
  std::vector<StEntry> entries;
  for (const auto& [name, t] : w) entries.push_back(f32(name, t));
  write_file(dir / "model.safetensors", safetensors_bytes(entries));
}

llama::LlamaConfig config_of(const nlohmann::json& j) { return llama::parse_config("config.json", j.dump()); }

// ---- checkpoint against config ----

TEST(Checkpoint, ConfigsThatDisagreeWithTheWeightsAreNamed) {
  const TinySpec s;
  const fs::path dir = temp_dir("disagree");
  write_checkpoint(dir, tiny_config(s), tiny_weights(s, 1));
  const auto load = [&](const nlohmann::json& config) {
    llama::Model(config_of(config), llama::Checkpoint(dir.string()), at::kFloat, at::kCPU);
  };
  load(tiny_config(s));  // as written: fine
  nlohmann::json c = tiny_config(s);
  c["num_key_value_heads"] = 4;
  expect_input_error([&] { load(c); }, {"model.layers.0.self_attn.k_proj.weight", "[16, 32]", "[32, 32]",
                                        "num_key_value_heads 4"});
  c = tiny_config(s);
  c["num_hidden_layers"] = 1;
  expect_input_error([&] { load(c); }, {"model.layers.1.", "1-layer"});
  c = tiny_config(s);
  c["num_hidden_layers"] = 3;
  expect_input_error([&] { load(c); }, {"no tensor 'model.layers.2.input_layernorm.weight'"});
  c = tiny_config(s);
  c["vocab_size"] = 62;
  expect_input_error([&] { load(c); }, {"model.embed_tokens.weight", "vocab_size 62"});
  c = tiny_config(s);
  c["intermediate_size"] = 40;
  expect_input_error([&] { load(c); }, {"mlp.gate_proj.weight", "intermediate_size 40"});
  c = tiny_config(s);
  c["tie_word_embeddings"] = true;  // then lm_head.weight is surplus: ignored, as transformers ties it
  load(c);

  TinySpec tied = s;
  tied.tie = true;
  const fs::path dir2 = temp_dir("untied-missing");
  write_checkpoint(dir2, tiny_config(tied), tiny_weights(tied, 1));
  nlohmann::json untied = tiny_config(tied);
  untied["tie_word_embeddings"] = false;
  expect_input_error([&] { llama::Model(config_of(untied), llama::Checkpoint(dir2.string()), at::kFloat, at::kCPU); },
                     {"no tensor 'lm_head.weight'", "tie_word_embeddings false"});
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

TEST(Checkpoint, TruncatedAndMissingFilesAreNamed) {
  const TinySpec s;
  const fs::path dir = temp_dir("truncated");
  write_checkpoint(dir, tiny_config(s), tiny_weights(s, 1));
  const std::string path = (dir / "model.safetensors").string();
  fs::resize_file(path, fs::file_size(path) - 100);
  expect_input_error([&] { llama::Checkpoint c(dir.string()); }, {"model.safetensors", "run past the data section"});
  fs::remove(path);
  expect_input_error([&] { llama::Checkpoint c(dir.string()); }, {"no model.safetensors"});
  fs::remove_all(dir);
}

TEST(Checkpoint, ShardedIndexIsCheckedAgainstTheShards) {
  const TinySpec s;
  const auto w = tiny_weights(s, 1);
  const fs::path dir = temp_dir("sharded");
  write_file(dir / "config.json", tiny_config(s).dump());
  std::vector<StEntry> first, second;
  nlohmann::json map = nlohmann::json::object();
  for (const auto& [name, t] : w) {
    const bool in_first = name.find("layers.1.") == std::string::npos;
    (in_first ? first : second).push_back(f32(name, t));
    map[name] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_file(dir / "model-00001-of-00002.safetensors", safetensors_bytes(first));
  write_file(dir / "model-00002-of-00002.safetensors", safetensors_bytes(second));
  write_file(dir / "model.safetensors.index.json", nlohmann::json({{"weight_map", map}}).dump());
  const llama::Model model(config_of(tiny_config(s)), llama::Checkpoint(dir.string()), at::kFloat, at::kCPU);

  nlohmann::json wrong = map;
  wrong["model.norm.weight"] = "model-00002-of-00002.safetensors";
  write_file(dir / "model.safetensors.index.json", nlohmann::json({{"weight_map", wrong}}).dump());
  expect_input_error([&] { llama::Checkpoint c(dir.string()); }, {"'model.norm.weight'", "has no such tensor"});
  wrong = map;
  wrong["model.norm.weight"] = "../elsewhere.safetensors";
  write_file(dir / "model.safetensors.index.json", nlohmann::json({{"weight_map", wrong}}).dump());
  expect_input_error([&] { llama::Checkpoint c(dir.string()); }, {"is not a file name"});
  write_file(dir / "model.safetensors.index.json", "{\"weight_map\": ");
  expect_input_error([&] { llama::Checkpoint c(dir.string()); }, {"model.safetensors.index.json", "not valid JSON"});
  fs::remove_all(dir);
}

// ---- config.json ----

TEST(Config, BothRopeSpellingsAgree) {
  TinySpec s;
  s.llama3 = true;
  const nlohmann::json v5 = tiny_config(s);
  nlohmann::json v4 = v5;
  v4.erase("rope_parameters");
  v4["rope_theta"] = 500000.0;
  v4["rope_scaling"] = {{"type", "llama3"},  // transformers 4.4x wrote "type" beside "rope_type"
                        {"factor", 4.0},
                        {"low_freq_factor", 1.0},
                        {"high_freq_factor", 4.0},
                        {"original_max_position_embeddings", 32}};
  const llama::LlamaConfig a = config_of(v5), b = config_of(v4);
  EXPECT_EQ(a.rope.type, "llama3");
  EXPECT_EQ(b.rope.type, "llama3");
  EXPECT_TRUE(at::equal(llama::rope_inv_freq(a), llama::rope_inv_freq(b)));
  // default RoPE: a top-level rope_theta alone, or rope_parameters
  nlohmann::json plain4 = tiny_config(TinySpec{});
  plain4.erase("rope_parameters");
  plain4["rope_theta"] = 10000;
  EXPECT_TRUE(at::equal(llama::rope_inv_freq(config_of(plain4)), llama::rope_inv_freq(config_of(tiny_config(TinySpec{})))));
}

TEST(Config, RopeFrequenciesMatchTheFormulaInDouble) {
  TinySpec s;
  s.head_dim = 64;
  s.llama3 = true;
  const llama::LlamaConfig c = config_of(tiny_config(s));
  const at::Tensor got = llama::rope_inv_freq(c);
  ASSERT_EQ(got.size(0), 32);
  for (int64_t i = 0; i < 32; ++i) {
    // Llama 3.1's scaling: low frequencies divided by factor, high ones kept,
    // a linear blend in 1 / wavelength between (8192 -> 32 here).
    const double f = 1.0 / std::pow(500000.0, 2.0 * static_cast<double>(i) / 64);
    const double wavelen = 2 * M_PI / f;
    double want = f;
    if (wavelen > 32.0 / 1.0) {
      want = f / 4.0;
    } else if (wavelen >= 32.0 / 4.0) {
      const double smooth = (32.0 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1 - smooth) * f / 4.0 + smooth * f;
    }
    EXPECT_NEAR(got[i].item<double>(), want, 2e-6 * want) << "frequency " << i;
  }
}

TEST(Config, BadFieldsAreNamed) {
  const auto bad = [](const std::function<void(nlohmann::json&)>& edit, std::initializer_list<const char*> fragments) {
    nlohmann::json c = tiny_config(TinySpec{});
    edit(c);
    expect_input_error([&] { config_of(c); }, fragments);
  };
  bad([](auto& c) { c.erase("vocab_size"); }, {"config.json", "'vocab_size' is missing"});
  bad([](auto& c) { c["hidden_size"] = "32"; }, {"'hidden_size' expected an integer >= 1", "\"32\""});
  bad([](auto& c) { c["num_key_value_heads"] = 3; }, {"multiple of 'num_key_value_heads'"});
  bad([](auto& c) { c["head_dim"] = 7; }, {"'head_dim' expected an even number"});
  bad([](auto& c) { c["rope_parameters"]["rope_type"] = "yarn"; }, {"'rope_parameters.rope_type' is 'yarn'"});
  bad([](auto& c) { c["rope_parameters"]["rope_type"] = "llama3"; }, {"'rope_parameters.factor' is missing"});
  bad([](auto& c) { c["mlp_bias"] = true; }, {"'mlp_bias' is true"});
  bad([](auto& c) { c["hidden_act"] = "gelu"; }, {"'hidden_act' is 'gelu'"});
  bad([](auto& c) { c["model_type"] = "phi3"; }, {"config.json", "'model_type' is 'phi3'", "gemma3_text"});
  bad([](auto& c) { c["eos_token_id"] = nlohmann::json::array({1, 99}); }, {"'eos_token_id'"});
  bad([](auto& c) { c["rms_norm_eps"] = -1; }, {"'rms_norm_eps' expected a number > 0"});
  expect_input_error([] { llama::parse_config("config.json", "{\"vocab_size\": "); }, {"config.json", "not valid JSON"});
  nlohmann::json eos = tiny_config(TinySpec{});
  eos["eos_token_id"] = nlohmann::json::array({1, 2});
  EXPECT_EQ(config_of(eos).eos_token_ids, (std::vector<int64_t>{1, 2}));
  eos["eos_token_id"] = 7;
  EXPECT_EQ(config_of(eos).eos_token_ids, (std::vector<int64_t>{7}));
}

/// A config of `family` over the tiny shape, with `extra` fields merged in.
nlohmann::json family_config(const std::string& family, int64_t layers, const nlohmann::json& extra = {}) {
  TinySpec s;
  s.layers = layers;
  nlohmann::json c = tiny_config(s);
  c["model_type"] = family;
  for (const auto& item : extra.items()) c[item.key()] = item.value();
  return c;
}

std::vector<bool> sliding_layers(std::initializer_list<int> layers, int64_t n) {
  std::vector<bool> v(static_cast<size_t>(n), false);
  for (int l : layers) v[static_cast<size_t>(l)] = true;
  return v;
}

TEST(Config, FamiliesReadAsTransformersDoes) {
  // llama: no window, no biases (attention_bias: every projection of attention)
  llama::LlamaConfig c = config_of(family_config("llama", 2, {{"attention_bias", true}}));
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.n_sliding_layers(), 0);
  EXPECT_TRUE(c.qkv_bias && c.o_bias);
  EXPECT_FALSE(c.gemma || c.qk_norm);
  EXPECT_DOUBLE_EQ(c.attn_scale, std::pow(8.0, -0.5));

  // mistral: the window on every layer; 4096 when absent, none when null
  c = config_of(family_config("mistral", 3, {{"sliding_window", 6}}));
  EXPECT_EQ(c.sliding_window, 6);
  EXPECT_EQ(c.sliding, sliding_layers({0, 1, 2}, 3));
  EXPECT_FALSE(c.qkv_bias);
  nlohmann::json m = family_config("mistral", 2);
  m.erase("sliding_window");
  EXPECT_EQ(config_of(m).sliding_window, 4096);
  EXPECT_EQ(config_of(family_config("mistral", 2, {{"sliding_window", nullptr}})).n_sliding_layers(), 0);

  // qwen2: q/k/v biases (not o); the window from max_window_layers on, only with use_sliding_window
  c = config_of(family_config("qwen2", 4, {{"use_sliding_window", true}, {"sliding_window", 12}, {"max_window_layers", 2}}));
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.sliding, sliding_layers({2, 3}, 4));
  EXPECT_EQ(c.sliding_window, 12);
  c = config_of(family_config("qwen2", 4, {{"use_sliding_window", false}, {"sliding_window", 12}, {"max_window_layers", 0}}));
  EXPECT_EQ(c.n_sliding_layers(), 0);
  EXPECT_EQ(c.sliding_window, 0);
  // transformers 5 writes layer_types, which win over the rule
  c = config_of(family_config("qwen2", 3, {{"use_sliding_window", true}, {"sliding_window", 12}, {"max_window_layers", 0},
                                           {"layer_types", {"full_attention", "sliding_attention", "full_attention"}}}));
  EXPECT_EQ(c.sliding, sliding_layers({1}, 3));

  // qwen3: q/k norms, head_dim 128 unless given, attention_bias
  nlohmann::json q3 = family_config("qwen3", 2, {{"attention_bias", true}});
  q3.erase("head_dim");
  c = config_of(q3);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_TRUE(c.qk_norm && c.qkv_bias && c.o_bias);
  EXPECT_FALSE(c.gemma);

  // gemma2: alternating from a sliding layer 0, soft-caps 50 / 30 unless null,
  // query_pre_attn_scalar 256, tied embeddings, head_dim 256 by default
  nlohmann::json g2 = family_config("gemma2", 4, {{"sliding_window", 8}});
  g2.erase("tie_word_embeddings");
  g2.erase("head_dim");
  c = config_of(g2);
  EXPECT_EQ(c.sliding, sliding_layers({0, 2}, 4));
  EXPECT_DOUBLE_EQ(c.attn_softcap, 50.0);
  EXPECT_DOUBLE_EQ(c.final_softcap, 30.0);
  EXPECT_DOUBLE_EQ(c.attn_scale, 1.0 / 16);
  EXPECT_TRUE(c.tie_word_embeddings && c.gemma);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_FALSE(c.qk_norm || c.local_rope);
  c = config_of(family_config("gemma2", 2, {{"attn_logit_softcapping", nullptr}, {"final_logit_softcapping", nullptr},
                                            {"query_pre_attn_scalar", 24}}));
  EXPECT_EQ(c.attn_softcap, 0.0);
  EXPECT_EQ(c.final_softcap, 0.0);
  EXPECT_DOUBLE_EQ(c.attn_scale, std::pow(24.0, -0.5));

  // gemma3_text: 5 sliding : 1 full, q/k norms, two RoPEs in both spellings
  nlohmann::json g3 = family_config("gemma3_text", 7, {{"sliding_window", 10}});
  g3["rope_parameters"] = {{"full_attention", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 1e6}}},
                           {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}};
  c = config_of(g3);
  EXPECT_EQ(c.sliding, sliding_layers({0, 1, 2, 3, 4, 6}, 7));
  EXPECT_TRUE(c.qk_norm && c.gemma && c.local_rope);
  EXPECT_EQ(c.attn_softcap, 0.0);
  EXPECT_EQ(c.final_softcap, 0.0);
  EXPECT_EQ(c.rope.type, "linear");
  EXPECT_EQ(c.rope_of(5).theta, 1e6);
  EXPECT_EQ(c.rope_of(0).theta, 1e4);
  nlohmann::json g3v4 = g3;
  g3v4.erase("rope_parameters");
  g3v4["rope_theta"] = 1e6;
  g3v4["rope_local_base_freq"] = 1e4;
  g3v4["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  g3v4["sliding_window_pattern"] = 6;
  const llama::LlamaConfig c4 = config_of(g3v4);
  EXPECT_EQ(c4.sliding, c.sliding);
  EXPECT_TRUE(at::equal(llama::rope_inv_freq(c4, c4.rope), llama::rope_inv_freq(c, c.rope)));
  EXPECT_TRUE(at::equal(llama::rope_inv_freq(c4, c4.rope_local), llama::rope_inv_freq(c, c.rope_local)));
  // linear scaling divides the default frequencies by the factor
  llama::RopeConfig plain = c.rope;
  plain.type = "default";
  EXPECT_TRUE(at::allclose(llama::rope_inv_freq(c, c.rope) * 4.0, llama::rope_inv_freq(c, plain)));
}

TEST(Config, FamilyRefusalsAreNamed) {
  const auto bad = [](const nlohmann::json& c, std::initializer_list<const char*> fragments) {
    expect_input_error([&] { config_of(c); }, fragments);
  };
  bad(family_config("gemma3", 2), {"config.json", "'model_type' is 'gemma3'", "gemma3_text"});
  bad(family_config("phi3", 2), {"'model_type' is 'phi3'", "llama, mistral, qwen2, qwen3, gemma2, gemma3_text"});
  bad(family_config("gemma2", 2, {{"hidden_activation", "gelu"}}), {"'hidden_activation' is 'gelu'"});
  bad(family_config("qwen2", 2, {{"hidden_act", "gelu"}}), {"'hidden_act' is 'gelu'"});
  bad(family_config("gemma2", 2, {{"layer_types", {"full_attention", "chunked_attention"}}}),
      {"'layer_types[1]' is 'chunked_attention'"});
  bad(family_config("gemma2", 2, {{"layer_types", {"full_attention"}}}), {"'layer_types' expected a list of", "(2)"});
  bad(family_config("qwen2", 2, {{"layer_types", {"full_attention", "sliding_attention"}}}),
      {"'layer_types' names sliding_attention layers", "'use_sliding_window' is false"});
  bad(family_config("gemma2", 2, {{"sliding_window", nullptr}}), {"names sliding_attention layers", "is null"});
  bad(family_config("mistral", 2, {{"sliding_window", 0}}), {"'sliding_window' expected an integer >= 1"});
  bad(family_config("qwen2", 2, {{"use_sliding_window", true}, {"max_window_layers", -1}}),
      {"'max_window_layers' expected an integer >= 0"});
  bad(family_config("gemma3_text", 2, {{"use_bidirectional_attention", true}}), {"'use_bidirectional_attention' is true"});
  bad(family_config("gemma3_text", 2, {{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e4}}}}),
      {"'rope_parameters' expected an object with 'full_attention' and 'sliding_attention'"});
  bad(family_config("gemma3_text", 2,
                    {{"rope_parameters", {{"full_attention", {{"rope_type", "yarn"}}}, {"sliding_attention", {}}}}}),
      {"'rope_parameters.full_attention.rope_type' is 'yarn'"});
  bad(family_config("gemma3_text", 2, {{"rope_parameters", {{"full_attention", {}}, {"chunked_attention", {}}}}}),
      {"'rope_parameters.chunked_attention'"});
  bad(family_config("qwen3", 2, {{"rope_parameters", {{"full_attention", {}}, {"sliding_attention", {}}}}}),
      {"per-layer-type rope parameters are implemented for gemma3_text only"});
  bad(family_config("llama", 2, {{"rope_parameters", {{"rope_type", "linear"}, {"rope_theta", 1e4}}}}),
      {"'rope_parameters.factor' is missing"});
}

TEST(Checkpoint, FamilyWeightsAreNamed) {
  // A Llama's weights under a qwen2 config: its q/k/v biases are missing.
  const TinySpec s;
  const fs::path dir = temp_dir("family-weights");
  write_checkpoint(dir, tiny_config(s), tiny_weights(s, 1));
  expect_input_error([&] { llama::Model(config_of(family_config("qwen2", 2)), llama::Checkpoint(dir.string()), at::kFloat, at::kCPU); },
                     {"model.layers.0.self_attn.q_proj.bias"});
  expect_input_error([&] { llama::Model(config_of(family_config("qwen3", 2)), llama::Checkpoint(dir.string()), at::kFloat, at::kCPU); },
                     {"model.layers.0.self_attn.q_norm.weight"});
  expect_input_error([&] { llama::Model(config_of(family_config("gemma2", 2)), llama::Checkpoint(dir.string()), at::kFloat, at::kCPU); },
                     {"model.layers.0.pre_feedforward_layernorm.weight"});
  fs::remove_all(dir);
}

// ---- requests ----

std::vector<llama::Request> parse_text(const std::string& text) {
  std::istringstream in(text);
  return llama::parse_requests("req.jsonl", in, {100, 9});
}

TEST(Requests, ParsesLinesAndDefaults) {
  const auto r = parse_text("{\"id\": \"a\", \"prompt\": [1, 2, 3], \"max_new_tokens\": 4}\r\n\n  \n{\"id\": \"b\", \"prompt\": [99]}\n");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].id, "a");
  EXPECT_EQ(r[0].prompt, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r[0].max_new_tokens, 4);
  EXPECT_EQ(r[1].max_new_tokens, 9);
  EXPECT_EQ(r[1].line, 4);
  EXPECT_EQ(llama::output_line("a", {5, 6}), "{\"id\":\"a\",\"tokens\":[5,6]}");
}

TEST(Requests, BadLinesNameFileLineAndField) {
  const std::string ok = "{\"id\": \"a\", \"prompt\": [1]}\n";
  const auto bad = [&](const std::string& line, std::initializer_list<const char*> fragments) {
    expect_input_error([&] { parse_text(ok + line + "\n"); }, fragments);
  };
  bad("{\"id\": \"b\", \"prompt\": [1, 2", {"req.jsonl:2:", "not valid JSON"});
  bad("[1, 2]", {"req.jsonl:2:", "expected a JSON object"});
  bad("{\"prompt\": [1]}", {"req.jsonl:2:", "field 'id'"});
  bad("{\"id\": 7, \"prompt\": [1]}", {"req.jsonl:2:", "field 'id' expected a string, got 7"});
  bad("{\"id\": \"a\", \"prompt\": [1]}", {"req.jsonl:2:", "already the id of line 1"});
  bad("{\"id\": \"b\"}", {"req.jsonl:2:", "field 'prompt'"});
  bad("{\"id\": \"b\", \"prompt\": []}", {"req.jsonl:2:", "non-empty array"});
  bad("{\"id\": \"b\", \"prompt\": [1, 100]}", {"req.jsonl:2:", "'prompt[1]'", "[0, 100)", "got 100"});
  bad("{\"id\": \"b\", \"prompt\": [-1]}", {"'prompt[0]'"});
  bad("{\"id\": \"b\", \"prompt\": [1.5]}", {"'prompt[0]'"});
  bad("{\"id\": \"b\", \"prompt\": [18446744073709551615]}", {"'prompt[0]'"});
  bad("{\"id\": \"b\", \"prompt\": [1], \"max_new_tokens\": 0}", {"'max_new_tokens'"});
  bad("{\"id\": \"b\", \"prompt\": [1], \"max_new_token\": 3}", {"unknown field 'max_new_token'"});
  expect_input_error([] { llama::read_requests("/nonexistent/requests.jsonl", {10, 1}); },
                     {"/nonexistent/requests.jsonl", "cannot open"});
}

TEST(Requests, APromptThePoolCanNeverHoldIsNamed) {
  const auto r = parse_text("{\"id\": \"a\", \"prompt\": [1, 2, 3]}\n{\"id\": \"b\", \"prompt\": [1, 2, 3, 4, 5, 6, 7]}\n");
  llama::check_fits("req.jsonl", r, 4, 4);  // b: 7 + 9 - 1 = 15 tokens, 4 pages of 4
  expect_input_error([&] { llama::check_fits("req.jsonl", r, 3, 4); }, {"req.jsonl:2:", "field 'prompt'", "4 pages"});
}

// ---- the engine against a plain forward pass ----

/// The tiny model's forward over a whole sequence, with contiguous causal
/// attention (no cache): the logits of its last token.
at::Tensor plain_logits(const std::map<std::string, at::Tensor>& w, const TinySpec& s, const llama::LlamaConfig& c,
                        const std::vector<int64_t>& tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t D = s.head_dim;
  at::Tensor x = w.at("model.embed_tokens.weight").index_select(0, at::tensor(tokens, at::kLong));  // [T, hidden]
  const at::Tensor inv = llama::rope_inv_freq(c);
  const at::Tensor freqs = at::arange(T, at::kFloat).unsqueeze(1) * inv.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().unsqueeze(1), sin = emb.sin().unsqueeze(1);  // [T, 1, D]
  const auto norm = [&](const at::Tensor& v, const at::Tensor& g) {
    return g * (v * at::rsqrt(v.pow(2).mean(-1, true) + 1e-5));
  };
  const at::Tensor causal = at::ones({T, T}, at::kBool).triu(1);
  // Sliding layers also hide key j from query i when j <= i - window.
  const at::Tensor windowed = s.window > 0 ? causal.logical_or(at::ones({T, T}, at::kBool).tril(-s.window)) : causal;
  const auto proj = [&](const at::Tensor& h, const std::string& name) {
    return w.count(name + ".bias") != 0 ? at::linear(h, w.at(name + ".weight"), w.at(name + ".bias"))
                                        : at::linear(h, w.at(name + ".weight"));
  };
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const at::Tensor& mask = s.window > 0 && l >= 1 ? windowed : causal;
    const at::Tensor h = norm(x, w.at(p + "input_layernorm.weight"));
    at::Tensor q = proj(h, p + "self_attn.q_proj").view({T, s.heads, D});
    at::Tensor k = proj(h, p + "self_attn.k_proj").view({T, s.kv_heads, D});
    const at::Tensor v = proj(h, p + "self_attn.v_proj").view({T, s.kv_heads, D});
    q = q * cos + llama::rotate_half(q) * sin;
    k = k * cos + llama::rotate_half(k) * sin;
    const int64_t group = s.heads / s.kv_heads;
    const at::Tensor kk = k.repeat_interleave(group, 1).permute({1, 2, 0});  // [Hq, D, T]
    const at::Tensor vv = v.repeat_interleave(group, 1).permute({1, 0, 2});  // [Hq, T, D]
    at::Tensor scores = at::matmul(q.permute({1, 0, 2}), kk) / std::sqrt(static_cast<double>(D));
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    const at::Tensor attn = at::matmul(at::softmax(scores, -1), vv).permute({1, 0, 2}).reshape({T, s.heads * D});
    x = x + at::linear(attn, w.at(p + "self_attn.o_proj.weight"));
    const at::Tensor h2 = norm(x, w.at(p + "post_attention_layernorm.weight"));
    x = x + at::linear(at::silu(at::linear(h2, w.at(p + "mlp.gate_proj.weight"))) *
                           at::linear(h2, w.at(p + "mlp.up_proj.weight")),
                       w.at(p + "mlp.down_proj.weight"));
  }
  const at::Tensor last = norm(x.narrow(0, T - 1, 1), w.at("model.norm.weight"));
  return at::linear(last, s.tie ? w.at("model.embed_tokens.weight") : w.at("lm_head.weight"))[0];
}

struct Expected {
  std::vector<int64_t> tokens;
  std::vector<at::Tensor> logits;
};

/// Window 0: a Llama, one pool; else a Qwen2 of 3 layers whose layers 1
/// and 2 slide (TinySpec::window): two pools, two tables.
template <int64_t Window>
class EngineVsPlainT : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    spec_.llama3 = Window == 0;
    spec_.kv_heads = 1;  // MQA: query heads 0-3 all read kv head 0
    spec_.window = Window;
    if (Window > 0) spec_.layers = 3;
    weights_ = new std::map<std::string, at::Tensor>(tiny_weights(spec_, 7));
    dir_ = new fs::path(temp_dir(Window > 0 ? "engine-sliding" : "engine"));
    nlohmann::json config = tiny_config(spec_);
    config["eos_token_id"] = nullptr;
    write_checkpoint(*dir_, config, *weights_);
    config_ = new llama::LlamaConfig(config_of(config));
    // requests: several lengths, three sharing a 20-token prefix
    at::manual_seed(3);
    const auto random_tokens = [](int64_t n) {
      const at::Tensor t = at::randint(spec_.vocab, {n}, at::kLong);
      return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
    };
    const std::vector<int64_t> shared = random_tokens(20);
    const std::vector<int64_t> lengths = {1, 7, 33, 0, 5, 0};
    requests_ = new std::vector<llama::Request>();
    for (size_t i = 0; i < lengths.size(); ++i) {
      llama::Request r;
      // Appended, not "r" + std::to_string(i): g++ 12 -O2 warns (-Wrestrict, a false
      // positive, GCC PR 105329) on that expression against torch 2.x's headers.
      r.id = "r";
      r.id += std::to_string(i);
      r.prompt = i >= 3 ? shared : std::vector<int64_t>{};
      const auto tail = random_tokens(lengths[i]);
      r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
      if (r.prompt.empty()) r.prompt = random_tokens(1);
      r.max_new_tokens = 6 + static_cast<int64_t>(i);
      requests_->push_back(r);
    }
    // the plain run: every step recomputes the whole sequence
    expected_ = new std::map<std::string, Expected>();
    for (const auto& r : *requests_) {
      Expected e;
      std::vector<int64_t> seq = r.prompt;
      for (int64_t i = 0; i < r.max_new_tokens; ++i) {
        const at::Tensor logits = plain_logits(*weights_, spec_, *config_, seq);
        const at::Tensor top = std::get<0>(logits.topk(2));
        min_gap_ = std::min(min_gap_, (top[0] - top[1]).item<double>());
        const int64_t next = logits.argmax().item<int64_t>();
        e.tokens.push_back(next);
        e.logits.push_back(logits);
        seq.push_back(next);
      }
      (*expected_)[r.id] = std::move(e);
    }
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete weights_;
    delete dir_;
    delete config_;
    delete requests_;
    delete expected_;
  }

  void random_schedules(int runs, uint32_t seed);

  /// Serves every request; checks tokens and logits against the plain run.
  /// The sliding pool has n_pages_sliding pages (-1: n_pages).
  template <class Layout>
  llama::SchedulerStats serve(int64_t page_size, int64_t n_pages, llama::SchedulerOptions options,
                              int64_t host_pages = -1, int64_t n_pages_sliding = -1) {
    options.keep_logits = true;
    const llama::Model model(*config_, llama::Checkpoint(dir_->string()), at::kFloat, at::kCPU);
    llama::KvCaches<Layout> caches;
    const auto make = [&](int64_t layers, int64_t pages) {
      return std::make_unique<pagedkv::PagedCache<Layout>>(layers, pages, page_size, spec_.kv_heads, spec_.head_dim,
                                                           at::TensorOptions().dtype(at::kFloat));
    };
    caches.full = make(model.n_full_layers(), n_pages);
    if (host_pages > 0) caches.full_host = make(model.n_full_layers(), host_pages);
    if (model.n_sliding_layers() > 0) {
      caches.sliding = make(model.n_sliding_layers(), n_pages_sliding > 0 ? n_pages_sliding : n_pages);
      if (host_pages > 0) caches.sliding_host = make(model.n_sliding_layers(), host_pages);
    }
    std::map<std::string, llama::Finished> got;
    llama::SchedulerStats stats;
    {
      llama::Scheduler<Layout> scheduler(model, caches, options,
                                         [&](llama::Finished&& f) { got[f.id] = std::move(f); });
      for (const auto& r : *requests_) scheduler.add(r);
      while (scheduler.step()) {
      }
      stats = scheduler.stats();
    }
    if (caches.sliding) {
      EXPECT_EQ(caches.sliding->n_free(), caches.sliding->n_pages()) << "sliding pages leaked";
    }
    const pagedkv::PagedCache<Layout>& cache = *caches.full;
    EXPECT_EQ(cache.n_free(), cache.n_pages()) << "pages leaked";
    EXPECT_GT(min_gap_, 2e-4) << "the plain run has a near-tie; change the seeds";
    for (const auto& r : *requests_) {
      const Expected& e = expected_->at(r.id);
      if (got.count(r.id) != 1) {
        ADD_FAILURE() << "no output for " << r.id;
        continue;
      }
      EXPECT_EQ(got[r.id].tokens, e.tokens) << r.id;
      for (size_t i = 0; i < e.logits.size() && i < got[r.id].logits.size(); ++i) {
        const at::Tensor mine = at::tensor(got[r.id].logits[i]);
        EXPECT_LE((mine - e.logits[i]).abs().max().item<double>(), 1e-4) << r.id << " step " << i;
      }
    }
    return stats;
  }

  static TinySpec spec_;
  static std::map<std::string, at::Tensor>* weights_;
  static fs::path* dir_;
  static llama::LlamaConfig* config_;
  static std::vector<llama::Request>* requests_;
  static std::map<std::string, Expected>* expected_;
  static double min_gap_;
};

template <int64_t W>
TinySpec EngineVsPlainT<W>::spec_;
template <int64_t W>
std::map<std::string, at::Tensor>* EngineVsPlainT<W>::weights_ = nullptr;
template <int64_t W>
fs::path* EngineVsPlainT<W>::dir_ = nullptr;
template <int64_t W>
llama::LlamaConfig* EngineVsPlainT<W>::config_ = nullptr;
template <int64_t W>
std::vector<llama::Request>* EngineVsPlainT<W>::requests_ = nullptr;
template <int64_t W>
std::map<std::string, Expected>* EngineVsPlainT<W>::expected_ = nullptr;
template <int64_t W>
double EngineVsPlainT<W>::min_gap_ = std::numeric_limits<double>::infinity();

using EngineVsPlain = EngineVsPlainT<0>;
/// A window of 5 under prompts of up to 53 tokens, with pages of 1 to 7:
/// windows start inside pages and on their boundaries.
using SlidingEngineVsPlain = EngineVsPlainT<5>;

// Speculative decoding: the drafts verified in the step's pass and the
// rejected ones rolled back leave the tokens and the logits of each token
// as the plain run has them, batched, with the prefix cache, under
// preemption by swap and by recompute.
TEST_F(EngineVsPlain, SpeculativeDecodingKeepsTokensAndLogits) {
  for (const int64_t k : {1, 3, 8}) {
    llama::SchedulerOptions o;
    o.speculate = k;
    o.max_batch_tokens = 24;
    const auto s = serve<pagedkv::NHD>(4, 200, o);
    EXPECT_GT(s.spec_proposed_tokens, 0) << "K=" << k;
    EXPECT_LE(s.spec_accepted_tokens, s.spec_proposed_tokens) << "K=" << k;
    o.swap = false;
    serve<pagedkv::HND>(3, 24, o);
    o.swap = true;
    serve<pagedkv::NHD>(1, 60, o, 200);
  }
}

// On two tables: the full one truncates the rejected drafts, the windowed
// one never commits them.
TEST_F(SlidingEngineVsPlain, SpeculativeDecodingKeepsTokensAndLogits) {
  for (const int64_t k : {1, 4}) {
    llama::SchedulerOptions o;
    o.speculate = k;
    o.max_batch_tokens = 24;
    const auto s = serve<pagedkv::NHD>(4, 200, o);
    EXPECT_GT(s.spec_proposed_tokens, 0) << "K=" << k;
    o.swap = false;
    serve<pagedkv::HND>(3, 24, o);
    o.swap = true;
    // Pages of 1: a request's window and step need 5 - 1 + 24 + 1 pages.
    serve<pagedkv::NHD>(1, 60, o, 200, /*n_pages_sliding=*/32);
  }
}

TEST(Speculative, PromptLookupDraftsWhatFollowedTheLongestEarlierMatch) {
  using llama::prompt_lookup_draft;
  using V = std::vector<int64_t>;
  EXPECT_EQ(prompt_lookup_draft({}, 4), V{});
  EXPECT_EQ(prompt_lookup_draft({5}, 4), V{});
  EXPECT_EQ(prompt_lookup_draft({1, 2, 3}, 4), V{}) << "the last token never occurred before";
  EXPECT_EQ(prompt_lookup_draft({1, 2, 3, 1}, 4), (V{2, 3, 1}));
  EXPECT_EQ(prompt_lookup_draft({1, 2, 3, 1}, 2), (V{2, 3}));
  // "9 1" matches at 0-1 (two tokens) and "1" alone at 4: the longer match wins.
  EXPECT_EQ(prompt_lookup_draft({9, 1, 7, 7, 1, 8, 9, 1}, 3), (V{7, 7, 1}));
  // Equally long matches: the latest.
  EXPECT_EQ(prompt_lookup_draft({4, 5, 4, 6, 4}, 1), (V{6}));
  EXPECT_EQ(prompt_lookup_draft({1, 2, 3}, 0), V{});
}

TEST_F(EngineVsPlain, AllAtOnceWithChunkedPrefillAndPrefixCache) {
  llama::SchedulerOptions o;
  o.max_batch_tokens = 16;
  const auto s = serve<pagedkv::NHD>(4, 200, o);
  EXPECT_GT(s.chunks, 0);
  EXPECT_GT(s.peak_batch_seqs, 1);
  EXPECT_GT(s.prefix_hit_tokens, 0);
  EXPECT_EQ(s.preempted_swap + s.preempted_recompute, 0);
}

TEST_F(EngineVsPlain, OneAtATimeWithoutPrefixCacheHND) {
  llama::SchedulerOptions o;
  o.max_seqs = 1;
  o.prefix_cache = false;
  const auto s = serve<pagedkv::HND>(3, 200, o);
  EXPECT_EQ(s.peak_running, 1);
  EXPECT_EQ(s.prefix_hit_tokens, 0);
}

TEST_F(EngineVsPlain, SmallPoolSwapsOut) {
  llama::SchedulerOptions o;
  o.max_batch_tokens = 24;
  const auto s = serve<pagedkv::HND>(5, 9, o, /*host_pages=*/64);  // r2: 33 + 8 - 1 tokens = 9 pages of 5
  EXPECT_GT(s.preempted_swap, 0);
}

TEST_F(EngineVsPlain, SmallPoolRecomputes) {
  llama::SchedulerOptions o;
  o.swap = false;
  const auto s = serve<pagedkv::NHD>(1, 41, o);
  EXPECT_GT(s.preempted_recompute, 0);
  EXPECT_GT(s.recomputed_tokens, 0);
}

TEST_F(EngineVsPlain, FullHostCacheFallsBackToRecompute) {
  llama::SchedulerOptions o;
  const auto s = serve<pagedkv::NHD>(4, 11, o, /*host_pages=*/1);
  EXPECT_GT(s.preempted_recompute, 0);
}

}  // namespace

namespace {

/// Random engine settings, each served in full against the plain run: the
/// scheduler must terminate, leak no page and give the same tokens whatever
/// it chose to batch, chunk, cache, swap or recompute.
template <int64_t Window>
void EngineVsPlainT<Window>::random_schedules(int runs, uint32_t seed) {
  std::mt19937 rng(seed);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int64_t swapped = 0, recomputed = 0, chunked = 0;
  for (int run = 0; run < runs; ++run) {
    const int64_t page_size = pick(1, 7);
    int64_t need = 0;  // the largest request alone
    for (const auto& r : *requests_) need = std::max(need, llama::pages_needed(r, page_size));
    llama::SchedulerOptions o;
    o.max_batch_tokens = pick(1, 40);
    o.max_seqs = pick(1, 6);
    o.prefix_cache = pick(0, 1) == 1;
    o.swap = pick(0, 2) != 0;
    const int64_t n_pages = need + pick(0, need);  // tight pools: preemption and eviction
    const int64_t host_pages = pick(0, 1) == 1 ? pick(1, 3 * need) : -1;
    int64_t n_sliding = -1;
    if (Window > 0) {  // a tight sliding pool too
      int64_t need_sliding = 0;
      for (const auto& r : *requests_) {
        need_sliding = std::max(need_sliding, llama::pages_needed(r, page_size, Window, o.max_batch_tokens));
      }
      n_sliding = need_sliding + pick(0, need_sliding);
    }
    SCOPED_TRACE("run " + std::to_string(run) + ": page_size " + std::to_string(page_size) + ", pages " +
                 std::to_string(n_pages) + ", sliding pages " + std::to_string(n_sliding) + ", host pages " +
                 std::to_string(host_pages) + ", budget " + std::to_string(o.max_batch_tokens) + ", max_seqs " +
                 std::to_string(o.max_seqs) + ", prefix " + std::to_string(o.prefix_cache) + ", swap " +
                 std::to_string(o.swap));
    const auto s = run % 2 == 0 ? serve<pagedkv::NHD>(page_size, n_pages, o, host_pages, n_sliding)
                                : serve<pagedkv::HND>(page_size, n_pages, o, host_pages, n_sliding);
    swapped += s.preempted_swap;
    recomputed += s.preempted_recompute;
    chunked += s.chunks;
  }
  EXPECT_GT(swapped, 0);
  EXPECT_GT(recomputed, 0);
  EXPECT_GT(chunked, 0);
}

TEST_F(EngineVsPlain, RandomSchedulesAgree) { random_schedules(64, 11); }

// ---- sliding-window layers: a second pool and a windowed table ----

TEST_F(SlidingEngineVsPlain, AllAtOnceChunkedWithoutPrefixCache) {
  llama::SchedulerOptions o;
  o.max_batch_tokens = 16;
  const auto s = serve<pagedkv::NHD>(4, 200, o);  // prefix_cache asked for: off over sliding layers
  EXPECT_GT(s.chunks, 0);
  EXPECT_GT(s.peak_batch_seqs, 1);
  EXPECT_EQ(s.prefix_hit_tokens, 0);
  EXPECT_GT(s.peak_pages_sliding, 0);
  EXPECT_LT(s.peak_pages_sliding, s.peak_pages_full);  // out-of-window pages went back
  EXPECT_LE(s.peak_pages, s.peak_pages_full + s.peak_pages_sliding);  // the peak of the sum
  EXPECT_GE(s.peak_pages, s.peak_pages_full);
}

TEST_F(SlidingEngineVsPlain, PageOfOneAndOfSevenHND) {
  llama::SchedulerOptions o;
  o.max_seqs = 2;
  for (int64_t page_size : {1, 7}) {
    SCOPED_TRACE("page_size " + std::to_string(page_size));
    const auto s = serve<pagedkv::HND>(page_size, 400, o);
    EXPECT_LT(s.peak_pages_sliding, s.peak_pages_full);
  }
}

TEST_F(SlidingEngineVsPlain, SmallSlidingPoolSwapsBothTables) {
  llama::SchedulerOptions o;
  o.max_batch_tokens = 8;
  // A request's window and step: ceil((5 - 1 + 8) / 2) + 1 = 7 pages of 2.
  const auto s = serve<pagedkv::NHD>(2, 200, o, /*host_pages=*/200, /*n_pages_sliding=*/8);
  EXPECT_GT(s.preempted_swap, 0);
  EXPECT_LE(s.peak_pages_sliding, 8);
}

TEST_F(SlidingEngineVsPlain, SmallFullPoolRecomputes) {
  llama::SchedulerOptions o;
  o.swap = false;
  const auto s = serve<pagedkv::HND>(3, 20, o);
  EXPECT_GT(s.preempted_recompute, 0);
}

TEST_F(SlidingEngineVsPlain, RandomSchedulesAgree) { random_schedules(24, 12); }

}  // namespace

// ---- the fuzz harnesses' seeds (fuzz/llama_inputs.hpp), replayed ----

namespace {

void replay(const char* corpus, void (*run)(const uint8_t*, size_t)) {
  const fs::path dir = fs::path(PAGEDKV_SOURCE_DIR) / "fuzz" / corpus;
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  int n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
      run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    } catch (const llama_fuzz::Failure& f) {
      ADD_FAILURE() << entry.path().filename() << ": " << f.what();
    }
    ++n;
  }
  EXPECT_GT(n, 0);
}

TEST(FuzzSeeds, Safetensors) { replay("corpus-safetensors", llama_fuzz::run_safetensors_input); }
TEST(FuzzSeeds, Requests) { replay("corpus-requests", llama_fuzz::run_requests_input); }

}  // namespace
