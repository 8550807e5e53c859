// Which kernels an operation runs: the one table every operation of
// ops/ consults (PyTorch's DispatchStub plays this part for ATen). The
// backends: the hand-written CPU kernels (cpu/), the CUDA kernels compiled
// at run time (cuda/, PAGEDKV_WITH_CUDA builds), and the device-agnostic
// ATen path (generic/) for any other device, or for every device under
// ScopedBackend(Backend::generic), which lets tests compare the paths.
// Nothing outside ops/ asks which backend runs.
#pragma once

#include <ATen/ATen.h>

#include "pagedkv/cuda/config.hpp"
#include "pagedkv/cuda/executor.hpp"

namespace pagedkv {
namespace ops {

/// Which kernels a thread's calls use. `automatic`: the table below.
/// `generic`: the ATen path everywhere.
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

/// The backends an operation may run on.
enum class Kernels {
  cpu,      ///< cpu/: hand-written kernels on host memory
  cuda,     ///< cuda/: kernels compiled by NVRTC, launched on the current stream
  generic,  ///< generic/: ATen operations, any device
};

/// The kernels that run an operation on storage of `device`:
///
/// | device | Backend::automatic                                   | Backend::generic |
/// |--------|------------------------------------------------------|------------------|
/// | cpu    | cpu (cuda while a cuda::ScopedExecutor emulates it)  | generic          |
/// | cuda   | cuda in PAGEDKV_WITH_CUDA builds, else generic       | generic          |
/// | other  | generic                                              | generic          |
///
/// The emulation row is how the tests run the CUDA path's host code, its
/// checks, binds and launches, on CPU tensors without a GPU.
inline Kernels kernels_for(const at::Device& device) {
  if (detail::backend_override() != Backend::automatic) return Kernels::generic;
  if (cuda::emulated()) return device.is_cpu() ? Kernels::cuda : Kernels::generic;
  if (device.is_cpu()) return Kernels::cpu;
  return PAGEDKV_WITH_CUDA && device.is_cuda() ? Kernels::cuda : Kernels::generic;
}

/// Whether storage on `device` runs the CPU kernels.
inline bool use_cpu_kernels(const at::Device& device) { return kernels_for(device) == Kernels::cpu; }

/// Whether storage on `device` runs the CUDA kernels.
inline bool use_cuda_kernels(const at::Device& device) { return kernels_for(device) == Kernels::cuda; }

}  // namespace ops
}  // namespace pagedkv
