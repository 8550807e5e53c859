// NVRTC, loaded at run time (dynlib.hpp), and the compilation of one
// program to a cubin (or PTX for an architecture the NVRTC does not know).
// Declared here with plain C types (handles as void*, results as int: the
// ABI of nvrtc.h's enums and opaque pointers), so that no CUDA header is
// needed to build pagedkv: a CPU-only libtorch compiles this too, and the
// CI's compile test uses it to compile every kernel without a GPU.
//
// Which NVRTC: $PAGEDKV_NVRTC (a path) if set; else one the process has
// loaded already (torch's, libnvrtc.so.13 / .12); else one shipped beside
// torch's libraries (torch/lib/libnvrtc*, the wheel's nvidia/cu13/lib,
// nvidia/cuda_nvrtc/lib, nvidia/cu12/lib); else the system's (the loader's
// path, then /usr/local/cuda/lib64).
#pragma once

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "pagedkv/cuda/dynlib.hpp"

namespace pagedkv {
namespace cuda {

/// NVRTC's functions and what the library said about itself.
struct Nvrtc {
  using Program = void*;
  const char* (*GetErrorString)(int) = nullptr;
  int (*Version)(int*, int*) = nullptr;
  int (*GetNumSupportedArchs)(int*) = nullptr;
  int (*GetSupportedArchs)(int*) = nullptr;
  int (*CreateProgram)(Program*, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  int (*DestroyProgram)(Program*) = nullptr;
  int (*CompileProgram)(Program, int, const char* const*) = nullptr;
  int (*GetProgramLogSize)(Program, size_t*) = nullptr;
  int (*GetProgramLog)(Program, char*) = nullptr;
  int (*GetCUBINSize)(Program, size_t*) = nullptr;
  int (*GetCUBIN)(Program, char*) = nullptr;
  int (*GetPTXSize)(Program, size_t*) = nullptr;
  int (*GetPTX)(Program, char*) = nullptr;

  std::string path;        ///< the library loaded
  int major = 0;           ///< its version
  int minor = 0;
  std::vector<int> archs;  ///< the sm_XY it compiles for (XY = 10 * major + minor)

  /// Throws c10::Error naming `call` unless `result` is NVRTC_SUCCESS.
  void check(int result, const char* call) const {
    TORCH_CHECK(result == 0, "pagedkv::cuda: ", call, " failed: ", GetErrorString != nullptr ? GetErrorString(result) : "",
                " (", path, ")");
  }
  bool supports(int arch) const { return std::find(archs.begin(), archs.end(), arch) != archs.end(); }
};

/// NVRTC from the library at `path`; throws c10::Error if it cannot be
/// loaded or lacks a function.
inline Nvrtc load_nvrtc(const std::string& path) {
  void* handle = dynlib::open(path);
  TORCH_CHECK(handle != nullptr, "pagedkv::cuda: cannot load NVRTC from ", path, ": ", dlerror());
  Nvrtc n;
  n.path = dynlib::path_of(handle, path);
  const std::string& lib = n.path;
  n.GetErrorString = dynlib::symbol<decltype(n.GetErrorString)>(handle, "nvrtcGetErrorString", lib);
  n.Version = dynlib::symbol<decltype(n.Version)>(handle, "nvrtcVersion", lib);
  n.GetNumSupportedArchs = dynlib::symbol<decltype(n.GetNumSupportedArchs)>(handle, "nvrtcGetNumSupportedArchs", lib);
  n.GetSupportedArchs = dynlib::symbol<decltype(n.GetSupportedArchs)>(handle, "nvrtcGetSupportedArchs", lib);
  n.CreateProgram = dynlib::symbol<decltype(n.CreateProgram)>(handle, "nvrtcCreateProgram", lib);
  n.DestroyProgram = dynlib::symbol<decltype(n.DestroyProgram)>(handle, "nvrtcDestroyProgram", lib);
  n.CompileProgram = dynlib::symbol<decltype(n.CompileProgram)>(handle, "nvrtcCompileProgram", lib);
  n.GetProgramLogSize = dynlib::symbol<decltype(n.GetProgramLogSize)>(handle, "nvrtcGetProgramLogSize", lib);
  n.GetProgramLog = dynlib::symbol<decltype(n.GetProgramLog)>(handle, "nvrtcGetProgramLog", lib);
  n.GetCUBINSize = dynlib::symbol<decltype(n.GetCUBINSize)>(handle, "nvrtcGetCUBINSize", lib);
  n.GetCUBIN = dynlib::symbol<decltype(n.GetCUBIN)>(handle, "nvrtcGetCUBIN", lib);
  n.GetPTXSize = dynlib::symbol<decltype(n.GetPTXSize)>(handle, "nvrtcGetPTXSize", lib);
  n.GetPTX = dynlib::symbol<decltype(n.GetPTX)>(handle, "nvrtcGetPTX", lib);
  n.check(n.Version(&n.major, &n.minor), "nvrtcVersion");
  int count = 0;
  n.check(n.GetNumSupportedArchs(&count), "nvrtcGetNumSupportedArchs");
  n.archs.resize(static_cast<size_t>(count));
  if (count > 0) n.check(n.GetSupportedArchs(n.archs.data()), "nvrtcGetSupportedArchs");
  return n;
}

/// Where NVRTC may be, in the order they are tried.
inline std::vector<std::string> nvrtc_candidates() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("PAGEDKV_NVRTC")) {
    if (*env != '\0') out.emplace_back(env);
  }
  // torch's own libraries: libtorch_cpu holds at::globalContext.
  at::Context& (*global_context)() = &at::globalContext;
  void* address = nullptr;
  std::memcpy(&address, &global_context, sizeof(address));
  const std::string torch_lib = dynlib::directory_of(address);
  if (!torch_lib.empty()) {
    for (const std::string& f : dynlib::files_with_prefix(torch_lib, "libnvrtc")) {
      if (f.find("builtins") == std::string::npos) out.push_back(f);
    }
    for (const char* rel : {"/../../nvidia/cu13/lib/libnvrtc.so.13", "/../../nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
                            "/../../nvidia/cu12/lib/libnvrtc.so.12", "/../../nvidia/cuda_nvrtc/lib/libnvrtc.so.13"}) {
      out.push_back(torch_lib + rel);
    }
  }
  for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) out.emplace_back(name);
  out.emplace_back("/usr/local/cuda/lib64/libnvrtc.so");
  return out;
}

/// The process's NVRTC (first of nvrtc_candidates() that loads; one the
/// process already holds comes first), loaded once; throws c10::Error
/// listing every place tried when there is none.
inline const Nvrtc& nvrtc() {
  static std::once_flag once;
  static Nvrtc instance;
  static std::string failure;
  std::call_once(once, [] {
    const std::vector<std::string> candidates = nvrtc_candidates();
    for (const bool loaded_only : {true, false}) {
      for (const std::string& c : candidates) {
        void* handle = dynlib::open(c, loaded_only);
        if (handle == nullptr) continue;
        try {
          instance = load_nvrtc(c);
          return;
        } catch (const c10::Error& e) {
          failure += std::string("\n  ") + c + ": " + e.what_without_backtrace();
        }
      }
    }
    failure = "pagedkv::cuda: no NVRTC found (set PAGEDKV_NVRTC to libnvrtc.so's path); tried:" + failure;
    for (const std::string& c : candidates) failure += "\n  " + c;
  });
  TORCH_CHECK(!instance.path.empty(), failure);
  return instance;
}

/// A compiled program: a cubin for sm_<arch>, or PTX for compute_<arch>.
struct Compiled {
  std::string image;  ///< the cubin's bytes, or the PTX text (NUL-terminated)
  bool is_ptx = false;
  std::string log;    ///< NVRTC's messages (warnings); empty when clean
};

/// The options every program is compiled with: C++17, one architecture,
/// line tables (for compute-sanitizer reports), IEEE float32 (no
/// fast-math: --prec-div and --prec-sqrt stay true, denormals are kept);
/// FMA contraction stays on, and code whose bits must equal the CPU's uses
/// the exactly rounded intrinsics (sources/prelude.hpp).
inline std::vector<std::string> compile_options(int arch, bool ptx) {
  return {"--std=c++17", (ptx ? "-arch=compute_" : "-arch=sm_") + std::to_string(arch), "-lineinfo",
          "--prec-div=true", "--prec-sqrt=true", "--ftz=false"};
}

/// Compiles `source` (named `name` in messages) for sm_<arch> (a cubin),
/// or compute_<arch> (PTX) with `ptx`. Throws c10::Error with NVRTC's log
/// when it fails.
inline Compiled compile(const Nvrtc& nv, const std::string& source, const std::string& name, int arch, bool ptx) {
  Nvrtc::Program program = nullptr;
  nv.check(nv.CreateProgram(&program, source.c_str(), name.c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  struct Destroy {
    const Nvrtc& nv;
    Nvrtc::Program* program;
    ~Destroy() { nv.DestroyProgram(program); }
  } destroy{nv, &program};
  const std::vector<std::string> options = compile_options(arch, ptx);
  std::vector<const char*> argv;
  for (const std::string& o : options) argv.push_back(o.c_str());
  const int result = nv.CompileProgram(program, static_cast<int>(argv.size()), argv.data());
  Compiled out;
  out.is_ptx = ptx;
  size_t log_size = 0;
  nv.check(nv.GetProgramLogSize(program, &log_size), "nvrtcGetProgramLogSize");
  if (log_size > 1) {
    out.log.resize(log_size);
    nv.check(nv.GetProgramLog(program, &out.log[0]), "nvrtcGetProgramLog");
    out.log.resize(log_size - 1);  // the terminating NUL
  }
  TORCH_CHECK(result == 0, "pagedkv::cuda: NVRTC ", nv.major, ".", nv.minor, " could not compile ", name, " for ",
              ptx ? "compute_" : "sm_", arch, ": ", nv.GetErrorString(result), "\n", out.log);
  size_t size = 0;
  if (ptx) {
    nv.check(nv.GetPTXSize(program, &size), "nvrtcGetPTXSize");
    out.image.resize(size);
    nv.check(nv.GetPTX(program, &out.image[0]), "nvrtcGetPTX");
  } else {
    nv.check(nv.GetCUBINSize(program, &size), "nvrtcGetCUBINSize");
    out.image.resize(size);
    nv.check(nv.GetCUBIN(program, &out.image[0]), "nvrtcGetCUBIN");
  }
  return out;
}

}  // namespace cuda
}  // namespace pagedkv
