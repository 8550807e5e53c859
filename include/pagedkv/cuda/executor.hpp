// The Executor that runs a cache's CUDA kernels (ops::use_cuda_kernels
// says which caches run them): the device's, or, while a ScopedExecutor is
// active, the one it names. Tests route CPU caches through the CUDA path's
// host code with the CPU emulator that way: its checks, binds and launches
// are tested without a GPU.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "pagedkv/cuda/config.hpp"
#include "pagedkv/cuda/device_executor.hpp"
#include "pagedkv/cuda/launch.hpp"

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

/// Whether a ScopedExecutor routes CPU caches through the CUDA path.
inline bool emulated() noexcept { return detail::executor_override() != nullptr; }

/// The executor for a cache on `device` (ops::use_cuda_kernels(device)).
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
