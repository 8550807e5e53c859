// The Executor of a CUDA device (PAGEDKV_WITH_CUDA builds only): kernels
// compiled by NVRTC for the device's architecture (or found in the disk
// cache, kernel_cache.hpp), loaded into the device's primary context (the
// one torch uses) with the driver API, and launched on torch's current
// stream of the device. One per device, for the life of the process;
// thread-safe. Compiling and loading happen in prepare() (called by bind)
// or at a kernel's first launch, never inside a CUDA graph capture: a
// launch that would need them while the stream captures throws instead.
#pragma once

#include "pagedkv/cuda/config.hpp"

#if PAGEDKV_WITH_CUDA

#include <c10/core/Device.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "pagedkv/cuda/driver.hpp"
#include "pagedkv/cuda/kernel_cache.hpp"
#include "pagedkv/cuda/launch.hpp"
#include "pagedkv/cuda/nvrtc.hpp"
#include "pagedkv/cuda/program.hpp"

namespace pagedkv {
namespace cuda {

class DeviceExecutor final : public Executor {
 public:
  /// The executor of CUDA device `index` (created on first use).
  static DeviceExecutor& of(c10::DeviceIndex index) {
    static std::mutex mutex;
    static std::map<int, std::unique_ptr<DeviceExecutor>> executors;
    std::lock_guard<std::mutex> lock(mutex);
    std::unique_ptr<DeviceExecutor>& e = executors[index];
    if (!e) e.reset(new DeviceExecutor(index));
    return *e;
  }

  DeviceExecutor(const DeviceExecutor&) = delete;
  DeviceExecutor& operator=(const DeviceExecutor&) = delete;

  void launch(const Launch& l) override {
    const c10::cuda::CUDAGuard guard(index_);
    make_context_current();
    const Function f = function(l.kernel);
    const Driver& d = driver();
    if (l.shared_bytes > f.shared_limit) raise_shared_limit(l.kernel, l.shared_bytes);
    void* stream = c10::cuda::getCurrentCUDAStream(index_).stream();
    void* args[] = {const_cast<void*>(l.params)};
    d.check(d.LaunchKernel(f.handle, l.grid.x, l.grid.y, l.grid.z, static_cast<unsigned>(l.kernel.block_threads), 1, 1,
                           l.shared_bytes, stream, args, nullptr),
            "cuLaunchKernel");
  }

  int sm_count() const override { return sm_count_; }
  int max_shared_bytes() const override { return max_shared_; }

  /// Compiles (in one NVRTC program) and loads every kernel of `kernels`
  /// not loaded yet. Not inside a CUDA graph capture.
  void prepare(const std::vector<KernelKey>& kernels) {
    std::vector<KernelKey> missing;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const KernelKey& k : kernels) {
        if (functions_.count(k.entry()) == 0) missing.push_back(k);
      }
    }
    if (missing.empty()) return;
    const c10::cuda::CUDAGuard guard(index_);
    make_context_current();
    load(missing);
  }

  /// Whether torch's current stream of this device is capturing a CUDA graph.
  bool capturing() const {
    const Driver& d = driver();
    int status = detail::kCaptureStatusNone;
    d.check(d.StreamIsCapturing(c10::cuda::getCurrentCUDAStream(index_).stream(), &status), "cuStreamIsCapturing");
    return status != detail::kCaptureStatusNone;
  }

  /// The architecture kernels are compiled for (10 * major + minor), and
  /// whether as PTX (for an NVRTC that does not know the device).
  int arch() const { return arch_; }
  bool ptx() const { return ptx_; }

 private:
  struct Function {
    void* handle = nullptr;
    uint32_t shared_limit = 48 << 10;  ///< dynamic shared memory allowed so far
  };

  explicit DeviceExecutor(c10::DeviceIndex index) : index_(index) {
    const Driver& d = driver();
    d.check(d.DeviceGet(&device_, index), "cuDeviceGet");
    d.check(d.DevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
    int major = 0, minor = 0;
    d.check(d.DeviceGetAttribute(&major, detail::kAttributeComputeCapabilityMajor, device_), "cuDeviceGetAttribute");
    d.check(d.DeviceGetAttribute(&minor, detail::kAttributeComputeCapabilityMinor, device_), "cuDeviceGetAttribute");
    d.check(d.DeviceGetAttribute(&sm_count_, detail::kAttributeMultiprocessorCount, device_), "cuDeviceGetAttribute");
    d.check(d.DeviceGetAttribute(&max_shared_, detail::kAttributeMaxSharedPerBlockOptin, device_),
            "cuDeviceGetAttribute");
    const Nvrtc& nv = nvrtc();
    TORCH_CHECK(nv.major * 1000 <= d.version, "pagedkv::cuda: NVRTC ", nv.major, ".", nv.minor, " (", nv.path,
                ") is newer than the CUDA driver (", d.version / 1000, ".", d.version % 1000 / 10,
                "), which cannot load its kernels: set PAGEDKV_NVRTC to an NVRTC of CUDA ", d.version / 1000,
                " or older");
    const int device_arch = 10 * major + minor;
    if (nv.supports(device_arch)) {
      arch_ = device_arch;
    } else {  // PTX for the newest architecture NVRTC knows below the device's; the driver compiles it
      for (const int a : nv.archs) {
        if (a <= device_arch) arch_ = a;
      }
      TORCH_CHECK(arch_ > 0, "pagedkv::cuda: NVRTC ", nv.major, ".", nv.minor, " compiles for none of sm_",
                  device_arch, " or older");
      ptx_ = true;
    }
  }

  void make_context_current() const {
    const Driver& d = driver();
    void* current = nullptr;
    d.check(d.CtxGetCurrent(&current), "cuCtxGetCurrent");
    if (current != context_) d.check(d.CtxSetCurrent(context_), "cuCtxSetCurrent");
  }

  Function function(const KernelKey& k) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = functions_.find(k.entry());
      if (it != functions_.end()) return it->second;
    }
    TORCH_CHECK(!capturing(), "pagedkv::cuda: kernel ", k.name(),
                " is not loaded yet and the stream is capturing a CUDA graph, where it cannot be compiled and loaded: "
                "run the step once before capturing (bind loads the kernels a cache needs)");
    load({k});
    std::lock_guard<std::mutex> lock(mutex_);
    return functions_.at(k.entry());
  }

  void raise_shared_limit(const KernelKey& k, uint32_t bytes) {
    TORCH_CHECK(static_cast<int>(bytes) <= max_shared_, "pagedkv::cuda: ", k.name(), " needs ", bytes,
                " bytes of shared memory, device ", static_cast<int>(index_), " allows ", max_shared_);
    std::lock_guard<std::mutex> lock(mutex_);
    Function& f = functions_.at(k.entry());
    if (bytes <= f.shared_limit) return;
    const Driver& d = driver();
    d.check(d.FuncSetAttribute(f.handle, detail::kFuncMaxDynamicSharedBytes, static_cast<int>(bytes)),
            "cuFuncSetAttribute");
    f.shared_limit = bytes;
  }

  /// Compiles `kernels` into one module (or finds it in the disk cache)
  /// and records their functions.
  void load(const std::vector<KernelKey>& kernels) {
    const Nvrtc& nv = nvrtc();
    const std::string source = program_source(kernels);
    std::string compiler = "NVRTC " + std::to_string(nv.major) + "." + std::to_string(nv.minor) + " " +
                           (ptx_ ? "compute_" : "sm_") + std::to_string(arch_);
    for (const std::string& o : compile_options(arch_, ptx_)) compiler += " " + o;
    const std::string key = kernel_cache::key_of(source, compiler);
    std::string image = kernel_cache::load(key);
    if (image.empty()) {
      image = compile(nv, source, "pagedkv_kernels.cu", arch_, ptx_).image;
      kernel_cache::store(key, image);
    }
    const Driver& d = driver();
    void* module = nullptr;
    d.check(d.ModuleLoadData(&module, image.data()), "cuModuleLoadData");
    std::lock_guard<std::mutex> lock(mutex_);
    for (const KernelKey& k : kernels) {
      Function f;
      d.check(d.ModuleGetFunction(&f.handle, module, k.entry().c_str()), "cuModuleGetFunction");
      functions_.emplace(k.entry(), f);
    }
  }

  c10::DeviceIndex index_;
  int device_ = 0;
  void* context_ = nullptr;
  int sm_count_ = 0;
  int max_shared_ = 0;
  int arch_ = 0;
  bool ptx_ = false;
  std::mutex mutex_;
  std::unordered_map<std::string, Function> functions_;  // by entry point
};

}  // namespace cuda
}  // namespace pagedkv

#endif  // PAGEDKV_WITH_CUDA
