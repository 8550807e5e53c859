// The data-moving kernels, and which ones a call takes: the hand-written
// CPU kernels for CPU tensors (cpu/copy.hpp, cpu/write_gather.hpp,
// cpu/storage.hpp), the CUDA kernels for CUDA tensors in a build with
// PAGEDKV_WITH_CUDA (cuda/, docs/gpu.md), the device-agnostic ATen path for
// any other device (generic/kernels.hpp), or the ATen path everywhere under
// ScopedBackend(Backend::generic). Callers validate everything first;
// nothing in the kernels checks or throws, so a kernel that starts always
// finishes.
#pragma once

#include <ATen/ATen.h>

#include "pagedkv/cpu/copy.hpp"
#include "pagedkv/cpu/storage.hpp"
#include "pagedkv/cpu/write_gather.hpp"
#include "pagedkv/cuda/config.hpp"
#include "pagedkv/cuda/executor.hpp"
#include "pagedkv/generic/kernels.hpp"

namespace pagedkv {

/// Which kernels a call uses. `automatic`: hand-written ones for CPU
/// tensors, the CUDA kernels for CUDA tensors (PAGEDKV_WITH_CUDA builds),
/// the ATen path for any other device. `generic`: the ATen path everywhere
/// (lets tests compare the paths).
enum class Backend { automatic, generic };

namespace detail {
inline Backend& backend_override() noexcept {
  thread_local Backend backend = Backend::automatic;
  return backend;
}
}  // namespace detail

/// Sets the backend of the calling thread for one scope.
class ScopedBackend {
 public:
  explicit ScopedBackend(Backend backend) : previous_(detail::backend_override()) {
    detail::backend_override() = backend;
  }
  ~ScopedBackend() { detail::backend_override() = previous_; }
  ScopedBackend(const ScopedBackend&) = delete;
  ScopedBackend& operator=(const ScopedBackend&) = delete;

 private:
  Backend previous_;
};

namespace kernels {

/// Whether a cache on `device` uses the hand-written CPU kernels.
inline bool use_cpu_kernels(const at::Device& device) {
  return device.is_cpu() && detail::backend_override() == Backend::automatic;
}

/// Whether a cache on `device` runs the CUDA kernels: on a CUDA device of a
/// PAGEDKV_WITH_CUDA build; on the CPU while a cuda::ScopedExecutor routes
/// CPU caches through the CUDA path (the tests' emulator). Never under
/// ScopedBackend(Backend::generic). Callers ask this before use_cpu_kernels.
inline bool use_cuda_kernels(const at::Device& device) {
  if (detail::backend_override() != Backend::automatic) return false;
  if (cuda::emulated()) return device.is_cpu();
  return PAGEDKV_WITH_CUDA && device.is_cuda();
}
}  // namespace kernels
}  // namespace pagedkv
