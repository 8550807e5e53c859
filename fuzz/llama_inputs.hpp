// The checks behind fuzz_safetensors and fuzz_requests, on one input each:
// examples/llama's safetensors reader and request reader must accept an
// input or reject it with llama::InputError, never crash, read out of
// bounds (ASan/UBSan in the fuzz build) or throw anything else; and what
// they accept must be what the input says. examples/llama/tests/test_llama.cpp
// replays the committed seeds through the same functions in every test build.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../examples/llama/requests.hpp"
#include "../examples/llama/safetensors.hpp"

namespace llama_fuzz {

/// A broken promise of a reader (the harness aborts on it).
class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The input as a whole safetensors file: a header that parses must describe
/// tensors inside the input, and each loadable tensor must read back the
/// input's bytes.
inline void run_safetensors_input(const uint8_t* data, size_t size) {
  llama::SafetensorsHeader h;
  try {
    h = llama::SafetensorsHeader::parse("fuzz.safetensors", data, size);
  } catch (const llama::InputError&) {
    return;
  }
  for (const auto& [name, t] : h.tensors()) {
    if (h.data_start() > size || t.begin > t.end || t.end > size - h.data_start()) {
      throw Failure("tensor '" + name + "' accepted outside the input");
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    if (numel * llama::element_size(t.dtype) != t.end - t.begin) throw Failure("tensor '" + name + "': size mismatch accepted");
    try {
      const at::Tensor x = llama::read_tensor("fuzz.safetensors", data, size, h, name);
      if (llama::weight_dtype(t.dtype) == at::ScalarType::Undefined) throw Failure("non-weight dtype loaded");
      if (x.numel() > 0 && std::memcmp(x.data_ptr(), data + h.data_start() + t.begin, t.end - t.begin) != 0) {
        throw Failure("tensor '" + name + "' read other bytes than its range");
      }
    } catch (const llama::InputError&) {
      if (llama::weight_dtype(t.dtype) != at::ScalarType::Undefined) throw Failure("a valid weight failed to load");
    }
  }
}

/// The input as a request file (vocabulary 1000, default max_new_tokens 16):
/// what parses must hold what the reader promises, and each output line must
/// read back as the id and tokens it was made from.
inline void run_requests_input(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::vector<llama::Request> requests;
  try {
    requests = llama::parse_requests("fuzz.jsonl", in, {1000, 16});
  } catch (const llama::InputError&) {
    return;
  }
  std::set<std::string> ids;
  int64_t last_line = 0;
  for (const llama::Request& r : requests) {
    if (!ids.insert(r.id).second) throw Failure("duplicate id accepted: " + r.id);
    if (r.prompt.empty()) throw Failure("empty prompt accepted");
    for (int64_t t : r.prompt) {
      if (t < 0 || t >= 1000) throw Failure("token outside the vocabulary accepted");
    }
    if (r.max_new_tokens < 1 || r.max_new_tokens > (int64_t{1} << 30)) throw Failure("bad max_new_tokens accepted");
    if (r.line <= last_line) throw Failure("line numbers out of order");
    last_line = r.line;
    const nlohmann::json back = nlohmann::json::parse(llama::output_line(r.id, r.prompt));
    if (back["id"].get<std::string>() != r.id || back["tokens"].get<std::vector<int64_t>>() != r.prompt) {
      throw Failure("output line does not read back");
    }
  }
  try {
    llama::check_fits("fuzz.jsonl", requests, 64, 16);
  } catch (const llama::InputError&) {
  }
}

}  // namespace llama_fuzz
