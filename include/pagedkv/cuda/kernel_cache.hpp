// Compiled kernels kept on disk between processes: NVRTC takes about half
// a second per kernel, and every process of an engine (or of a test suite)
// would otherwise compile the same ones again. An entry is keyed by
// everything that decides its bytes (the program's text, NVRTC's version,
// the options, the architecture) and holds that key in full, so a hash
// collision or a stale entry is a miss, never a wrong kernel. Writes go to
// a temporary file renamed into place, so concurrent processes never read
// half an entry. Failures to read or write are misses, never errors.
//
// The directory: $PAGEDKV_KERNEL_CACHE (an empty value or "off": no cache),
// else $XDG_CACHE_HOME/pagedkv/kernels, else $HOME/.cache/pagedkv/kernels.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace pagedkv {
namespace cuda {
namespace kernel_cache {

/// The cache directory, or "" for none.
inline std::string directory() {
  if (const char* env = std::getenv("PAGEDKV_KERNEL_CACHE")) {
    const std::string dir = env;
    return dir == "off" ? std::string() : dir;
  }
  if (const char* xdg = std::getenv("XDG_CACHE_HOME")) {
    if (*xdg != '\0') return std::string(xdg) + "/pagedkv/kernels";
  }
  if (const char* home = std::getenv("HOME")) {
    if (*home != '\0') return std::string(home) + "/.cache/pagedkv/kernels";
  }
  return "";
}

/// 64-bit FNV-1a of `text`, from `seed`.
inline uint64_t fnv1a(const std::string& text, uint64_t seed = 14695981039346656037ull) {
  uint64_t h = seed;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

inline std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

/// The key of a compiled program: what it was compiled from and with.
inline std::string key_of(const std::string& source, const std::string& compiler) {
  return "pagedkv kernel cache 1\n" + compiler + "\nsource " + hex(fnv1a(source)) + " " +
         hex(fnv1a(source, 0x9E3779B97F4A7C15ull)) + " " + std::to_string(source.size()) + "\n";
}

/// Makes `dir` and its parents; false on failure.
inline bool make_directories(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at == dir.size() || dir[at] == '/') {
      const std::string part = dir.substr(0, at);
      if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
  }
  return true;
}

/// The entry of `key`, or "" on a miss.
inline std::string load(const std::string& key) {
  const std::string dir = directory();
  if (dir.empty()) return "";
  std::ifstream in(dir + "/" + hex(fnv1a(key)) + ".bin", std::ios::binary);
  if (!in) return "";
  std::stringstream contents;
  contents << in.rdbuf();
  const std::string all = contents.str();
  if (all.size() <= key.size() || all.compare(0, key.size(), key) != 0) return "";
  return all.substr(key.size());
}

/// Stores `image` under `key` (best effort).
inline void store(const std::string& key, const std::string& image) {
  const std::string dir = directory();
  if (dir.empty() || !make_directories(dir)) return;
  const std::string path = dir + "/" + hex(fnv1a(key)) + ".bin";
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return;
    out << key << image;
    if (!out) {
      std::remove(tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) std::remove(tmp.c_str());
}

}  // namespace kernel_cache
}  // namespace cuda
}  // namespace pagedkv
