// Runs an operation script (see conformance.py) against pagedkv and prints
// one result line per operation, in the format conformance.py compares with
// the Python reference. Uses only the public API.
//
//   pagedkv_script_runner NHD|HND < script.txt
#include <ATen/ATen.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include "pagedkv/pagedkv.hpp"

namespace {

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  throw std::runtime_error("unknown dtype " + name);
}

/// The values both sides generate for a write: exact in every dtype used.
at::Tensor values(at::IntArrayRef shape, int64_t seed, at::ScalarType dtype) {
  const at::Tensor i = at::arange(c10::multiply_integers(shape), at::kLong);
  return (((i * 7 + seed * 131) % 251 - 125).to(at::kFloat) / 8.0).view(shape).to(dtype);
}

at::Tensor read_table(std::istringstream& in, int64_t rows, int64_t cols) {
  at::Tensor t = at::empty({rows, cols}, at::kLong);
  for (int64_t i = 0; i < rows * cols; ++i) in >> t.data_ptr<int64_t>()[i];
  return t;
}

void print_values(const char* label, const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat).contiguous();
  std::printf(" %s", label);
  for (int64_t i = 0; i < f.numel(); ++i) std::printf(" %g", static_cast<double>(f.data_ptr<float>()[i]));
}

template <class Layout>
int run(std::istream& script) {
  std::unique_ptr<pagedkv::PagedCache<Layout>> cache_owner;
  at::ScalarType dtype = at::kFloat;
  std::string line;
  while (std::getline(script, line)) {
    std::istringstream in(line);
    std::string op;
    in >> op;
    if (op == "cache") {  // starts a new script: cache n_layers n_pages page_size heads dim dtype
      std::vector<int64_t> dims(5);
      std::string dtype_name;
      in >> dims[0] >> dims[1] >> dims[2] >> dims[3] >> dims[4] >> dtype_name;
      dtype = parse_dtype(dtype_name);
      cache_owner = std::make_unique<pagedkv::PagedCache<Layout>>(dims[0], dims[1], dims[2], dims[3], dims[4],
                                                                  at::TensorOptions().dtype(dtype));
      std::printf("cache\n");
      continue;
    }
    if (op.empty()) continue;
    if (!cache_owner) throw std::runtime_error("script must start with a cache line");
    auto& cache = *cache_owner;
    if (op == "alloc") {
      std::printf("alloc %lld\n", static_cast<long long>(cache.alloc()));
    } else if (op == "alloc_n") {
      int64_t n = 0;
      in >> n;
      std::printf("alloc_n");
      for (int64_t p : cache.alloc_n(n)) std::printf(" %lld", static_cast<long long>(p));
      std::printf("\n");
    } else if (op == "free") {
      int64_t page = 0;
      in >> page;
      cache.free(page);
      std::printf("free n_free=%lld\n", static_cast<long long>(cache.n_free()));
    } else if (op == "write") {
      int64_t layer = 0, start = 0, batch = 0, seq = 0, seed = 0, cols = 0;
      in >> layer >> start >> batch >> seq >> seed >> cols;
      const at::Tensor pt = read_table(in, batch, cols);
      const std::vector<int64_t> shape{batch, seq, cache.n_kv_heads(), cache.head_dim()};
      cache.bind(pt).write(layer, start, values(shape, seed, dtype), values(shape, seed + 1, dtype));
      std::printf("write ok\n");
    } else if (op == "gather") {
      int64_t layer = 0, total_len = 0, batch = 0, cols = 0;
      in >> layer >> total_len >> batch >> cols;
      const at::Tensor pt = read_table(in, batch, cols);
      const auto kv = cache.bind(pt, total_len).gather(layer);
      std::printf("gather %lld %lld", static_cast<long long>(kv.first.size(0)),
                  static_cast<long long>(kv.first.size(1)));
      print_values("k", kv.first);
      print_values("v", kv.second);
      std::printf("\n");
    } else {
      std::cerr << "unknown op: " << line << "\n";
      return 2;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || (std::string(argv[1]) != "NHD" && std::string(argv[1]) != "HND")) {
    std::cerr << "usage: " << argv[0] << " NHD|HND < script\n"
                 "Runs operation scripts (tests/reference/conformance.py) and prints one result per line.\n";
    return 2;
  }
  try {
    return std::string(argv[1]) == "NHD" ? run<pagedkv::NHD>(std::cin) : run<pagedkv::HND>(std::cin);
  } catch (const std::exception& e) {
    std::cerr << "pagedkv_script_runner: " << e.what() << "\n";
    return 1;
  }
}
