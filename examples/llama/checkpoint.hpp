// A checkpoint directory as transformers' save_pretrained writes it:
// model.safetensors, or model.safetensors.index.json ({"weight_map":
// {tensor name: shard file}}) and the shards it names. Tensor names map to
// the file that holds them; take() reads a tensor and checks its shape.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "errors.hpp"
#include "safetensors.hpp"

namespace llama {

/// "[a, b]" for messages.
inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

/// Reads a whole small text file (a config or an index); throws InputError.
inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(path, ": read error");
  return text.str();
}

class Checkpoint {
 public:
  /// Opens `dir`'s model.safetensors or, failing that, its sharded index.
  explicit Checkpoint(const std::string& dir) {
    namespace fs = std::filesystem;
    const fs::path single = fs::path(dir) / "model.safetensors";
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    if (fs::exists(single)) {
      add_file(single.string());
      for (const auto& [name, entry] : files_.back()->tensors()) where_[name] = files_.back().get();
      return;
    }
    if (!fs::exists(index)) fail(dir, ": no model.safetensors and no model.safetensors.index.json");
    const std::string index_path = index.string();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_text_file(index_path));
    } catch (const nlohmann::json::exception& e) {
      fail(index_path, ": not valid JSON (", e.what(), ")");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      fail(index_path, ": expected an object with a 'weight_map' object");
    }
    std::map<std::string, SafetensorsFile*> shards;
    for (const auto& [name, shard] : j["weight_map"].items()) {
      if (!shard.is_string()) fail(index_path, ": weight_map['", name, "'] is not a file name");
      const std::string file = shard.get<std::string>();
      // a shard is a file beside the index, never a path elsewhere
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        fail(index_path, ": weight_map['", name, "'] = '", file, "' is not a file name in ", dir);
      }
      auto it = shards.find(file);
      if (it == shards.end()) {
        add_file((fs::path(dir) / file).string());
        it = shards.emplace(file, files_.back().get()).first;
      }
      if (it->second->tensors().count(name) == 0) {
        fail(index_path, ": weight_map puts tensor '", name, "' in ", file, ", which has no such tensor");
      }
      where_[name] = it->second;
    }
  }

  /// Every tensor name the checkpoint holds.
  std::set<std::string> names() const {
    std::set<std::string> out;
    for (const auto& [name, file] : where_) out.insert(name);
    return out;
  }
  bool has(const std::string& name) const { return where_.count(name) != 0; }

  /// Reads `name`, which must have shape `shape` (`why` says where the
  /// expected shape comes from), as a CPU tensor of its stored dtype.
  at::Tensor take(const std::string& name, const std::vector<int64_t>& shape, const std::string& why) const {
    const auto it = where_.find(name);
    if (it == where_.end()) fail(dir_hint(), ": no tensor '", name, "' (", why, ")");
    const TensorEntry& t = it->second->tensors().at(name);
    if (t.shape != shape) {
      fail(it->second->path(), ": tensor '", name, "' has shape ", shape_string(t.shape), ", but ", why,
           " expects ", shape_string(shape));
    }
    return it->second->read(name);
  }

 private:
  void add_file(const std::string& path) { files_.push_back(std::make_unique<SafetensorsFile>(path)); }
  std::string dir_hint() const { return files_.empty() ? std::string("checkpoint") : files_.front()->path(); }

  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

}  // namespace llama
