// Which caches take the CUDA kernels, and the Executor that runs them: a
// cache on a CUDA device of a PAGEDKV_WITH_CUDA build, unless
// ScopedBackend(Backend::generic) forces the ATen path. Tests can route
// CPU caches through the same host code with an emulated executor
// (ScopedExecutor), which is how the CUDA path's checks, binds and launches
// are tested without a GPU.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "pagedkv/cuda/config.hpp"
#include "pagedkv/cuda/device_executor.hpp"
#include "pagedkv/cuda/launch.hpp"
#include "pagedkv/kernels.hpp"

namespace pagedkv {
namespace cuda {

namespace detail {
inline Executor*& executor_override() noexcept {
  thread_local Executor* executor = nullptr;
  return executor;
}
}  // namespace detail

/// For one scope of the calling thread, CPU caches take the CUDA path with
/// `executor` (the tests' CPU emulator) instead of the CPU kernels.
class ScopedExecutor {
 public:
  explicit ScopedExecutor(Executor& executor) : previous_(detail::executor_override()) {
    detail::executor_override() = &executor;
  }
  ~ScopedExecutor() { detail::executor_override() = previous_; }
  ScopedExecutor(const ScopedExecutor&) = delete;
  ScopedExecutor& operator=(const ScopedExecutor&) = delete;

 private:
  Executor* previous_;
};

/// Whether a cache on `device` takes the CUDA kernels.
inline bool use_cuda_kernels(const at::Device& device) {
  if (pagedkv::detail::backend_override() != Backend::automatic) return false;
  if (detail::executor_override() != nullptr) return device.is_cpu();
  return PAGEDKV_WITH_CUDA && device.is_cuda();
}

/// The executor for a cache on `device` (use_cuda_kernels(device)).
inline Executor& executor_for(const at::Device& device) {
  Executor* e = detail::executor_override();
#if PAGEDKV_WITH_CUDA
  if (e == nullptr) e = &DeviceExecutor::of(device.index());
#endif
  TORCH_CHECK(e != nullptr, "pagedkv::cuda: built without CUDA support (PAGEDKV_WITH_CUDA), no kernels for ", device);
  return *e;
}

/// Compiles and loads `kernels` for `device` now, if a GPU runs them
/// (bind calls it, so that no per-layer call compiles).
inline void prepare(const at::Device& device, const std::vector<KernelKey>& kernels) {
  if (detail::executor_override() != nullptr) return;
#if PAGEDKV_WITH_CUDA
  DeviceExecutor::of(device.index()).prepare(kernels);
#else
  (void)device;
  (void)kernels;
#endif
}

/// Whether the current stream of `device` is capturing a CUDA graph
/// (a host query, no sync): what may not be uploaded then.
inline bool capturing(const at::Device& device) {
  if (detail::executor_override() != nullptr) return false;
#if PAGEDKV_WITH_CUDA
  return DeviceExecutor::of(device.index()).capturing();
#else
  (void)device;
  return false;
#endif
}

}  // namespace cuda
}  // namespace pagedkv
