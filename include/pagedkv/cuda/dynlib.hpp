// Shared libraries opened at run time (dlopen): the CUDA driver (libcuda)
// and NVRTC, which pagedkv uses without linking them, so that a program
// built by g++ against a CUDA build of libtorch needs nothing at link time
// and a CPU-only build never touches them. Libraries stay open for the
// life of the process (their function pointers are kept).
#pragma once

#include <c10/util/Exception.h>
#include <dirent.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace pagedkv {
namespace cuda {
namespace dynlib {

/// dlopen(path): with `already_loaded`, only a library the process has
/// loaded (RTLD_NOLOAD). Null when it cannot be opened.
inline void* open(const std::string& path, bool already_loaded = false) {
  return dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | (already_loaded ? RTLD_NOLOAD : 0));
}

/// The file a handle was opened from ("" if dlinfo cannot tell).
inline std::string path_of(void* handle, const std::string& fallback) {
  char path[4096] = {};
  if (handle != nullptr && dlinfo(handle, RTLD_DI_ORIGIN, path) == 0) {
    // RTLD_DI_ORIGIN gives the directory; the name is the fallback's last component.
    const std::string name = fallback.substr(fallback.find_last_of('/') + 1);
    return std::string(path) + "/" + name;
  }
  return fallback;
}

/// The function `name` of `handle` as F (a function pointer type); throws
/// c10::Error naming the library when it is missing.
template <class F>
F symbol(void* handle, const char* name, const std::string& library) {
  void* s = dlsym(handle, name);
  TORCH_CHECK(s != nullptr, "pagedkv::cuda: ", library, " has no function ", name);
  F f;
  static_assert(sizeof(f) == sizeof(s), "function and object pointers of one size");
  std::memcpy(&f, &s, sizeof(f));
  return f;
}

/// The directory of the shared object that holds `address` ("" if unknown).
inline std::string directory_of(const void* address) {
  Dl_info info;
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string file = info.dli_fname;
  const size_t slash = file.find_last_of('/');
  return slash == std::string::npos ? "." : file.substr(0, slash);
}

/// Files of `directory` whose name starts with `prefix` and contains
/// ".so", sorted (none if the directory cannot be read).
inline std::vector<std::string> files_with_prefix(const std::string& directory, const std::string& prefix) {
  std::vector<std::string> out;
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return out;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.compare(0, prefix.size(), prefix) == 0 && name.find(".so") != std::string::npos) {
      out.push_back(directory + "/" + name);
    }
  }
  closedir(dir);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace dynlib
}  // namespace cuda
}  // namespace pagedkv
