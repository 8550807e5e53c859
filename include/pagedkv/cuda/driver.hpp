// The CUDA driver API, loaded at run time from the driver's libcuda.so.1
// (dynlib.hpp), with plain C types (handles as void*, CUresult and enums as
// int: cuda.h's ABI), so that building pagedkv needs no CUDA header and a
// CPU-only build never touches it. Only what the kernel launcher needs:
// device attributes, the primary context, modules, launches, and whether a
// stream is capturing a CUDA graph.
#pragma once

#include <c10/util/Exception.h>

#include <mutex>
#include <string>

#include "pagedkv/cuda/dynlib.hpp"

namespace pagedkv {
namespace cuda {

/// cuda.h's values of the enums used here.
namespace detail {
constexpr int kAttributeMultiprocessorCount = 16;       // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
constexpr int kAttributeComputeCapabilityMajor = 75;   // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttributeComputeCapabilityMinor = 76;   // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
constexpr int kAttributeMaxSharedPerBlockOptin = 97;   // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kFuncMaxDynamicSharedBytes = 8;          // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kCaptureStatusNone = 0;                  // CU_STREAM_CAPTURE_STATUS_NONE
}  // namespace detail

/// The driver's functions.
struct Driver {
  int (*Init)(unsigned) = nullptr;
  int (*DriverGetVersion)(int*) = nullptr;
  int (*DeviceGet)(int*, int) = nullptr;
  int (*DeviceGetAttribute)(int*, int, int) = nullptr;
  int (*DevicePrimaryCtxRetain)(void**, int) = nullptr;
  int (*CtxGetCurrent)(void**) = nullptr;
  int (*CtxSetCurrent)(void*) = nullptr;
  int (*ModuleLoadData)(void**, const void*) = nullptr;
  int (*ModuleGetFunction)(void**, void*, const char*) = nullptr;
  int (*FuncSetAttribute)(void*, int, int) = nullptr;
  int (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                      void**) = nullptr;
  int (*StreamIsCapturing)(void*, int*) = nullptr;
  int (*GetErrorName)(int, const char**) = nullptr;
  int (*GetErrorString)(int, const char**) = nullptr;

  std::string path;  ///< the library loaded
  int version = 0;   ///< cuDriverGetVersion: 1000 * major + 10 * minor

  /// Throws c10::Error naming `call` and the driver's error unless
  /// `result` is CUDA_SUCCESS.
  void check(int result, const char* call) const {
    if (result == 0) return;
    const char* name = nullptr;
    const char* text = nullptr;
    if (GetErrorName != nullptr) GetErrorName(result, &name);
    if (GetErrorString != nullptr) GetErrorString(result, &text);
    TORCH_CHECK(false, "pagedkv::cuda: ", call, " failed: ", name != nullptr ? name : "CUresult",
                " (", result, "): ", text != nullptr ? text : "");
  }
};

/// The driver of this process (libcuda.so.1: the copy torch loaded, else
/// the system's), initialised once; throws c10::Error when there is none.
inline const Driver& driver() {
  static std::once_flag once;
  static Driver d;
  static std::string failure;
  std::call_once(once, [] {
    void* handle = dynlib::open("libcuda.so.1", /*already_loaded=*/true);
    if (handle == nullptr) handle = dynlib::open("libcuda.so.1");
    if (handle == nullptr) {
      failure = std::string("pagedkv::cuda: cannot load the CUDA driver (libcuda.so.1): ") + dlerror();
      return;
    }
    try {
      const std::string lib = dynlib::path_of(handle, "libcuda.so.1");
      Driver x;
      x.Init = dynlib::symbol<decltype(x.Init)>(handle, "cuInit", lib);
      x.DriverGetVersion = dynlib::symbol<decltype(x.DriverGetVersion)>(handle, "cuDriverGetVersion", lib);
      x.DeviceGet = dynlib::symbol<decltype(x.DeviceGet)>(handle, "cuDeviceGet", lib);
      x.DeviceGetAttribute = dynlib::symbol<decltype(x.DeviceGetAttribute)>(handle, "cuDeviceGetAttribute", lib);
      x.DevicePrimaryCtxRetain =
          dynlib::symbol<decltype(x.DevicePrimaryCtxRetain)>(handle, "cuDevicePrimaryCtxRetain", lib);
      x.CtxGetCurrent = dynlib::symbol<decltype(x.CtxGetCurrent)>(handle, "cuCtxGetCurrent", lib);
      x.CtxSetCurrent = dynlib::symbol<decltype(x.CtxSetCurrent)>(handle, "cuCtxSetCurrent", lib);
      x.ModuleLoadData = dynlib::symbol<decltype(x.ModuleLoadData)>(handle, "cuModuleLoadData", lib);
      x.ModuleGetFunction = dynlib::symbol<decltype(x.ModuleGetFunction)>(handle, "cuModuleGetFunction", lib);
      x.FuncSetAttribute = dynlib::symbol<decltype(x.FuncSetAttribute)>(handle, "cuFuncSetAttribute", lib);
      x.LaunchKernel = dynlib::symbol<decltype(x.LaunchKernel)>(handle, "cuLaunchKernel", lib);
      x.StreamIsCapturing = dynlib::symbol<decltype(x.StreamIsCapturing)>(handle, "cuStreamIsCapturing", lib);
      x.GetErrorName = dynlib::symbol<decltype(x.GetErrorName)>(handle, "cuGetErrorName", lib);
      x.GetErrorString = dynlib::symbol<decltype(x.GetErrorString)>(handle, "cuGetErrorString", lib);
      x.path = lib;
      x.check(x.Init(0), "cuInit");
      x.check(x.DriverGetVersion(&x.version), "cuDriverGetVersion");
      d = x;
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
    }
  });
  TORCH_CHECK(!d.path.empty(), failure);
  return d;
}

}  // namespace cuda
}  // namespace pagedkv
