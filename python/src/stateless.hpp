// The stateless ops' shared pieces: how an op's call is checked and run
// once its cache tensors are validated (op_checks::Storage). The kernels
// are the C++ library's own, reached through the operations layer
// (pagedkv/ops/) exactly as PagedCache reaches them: the CPU kernels for
// CPU tensors, the CUDA kernels for CUDA tensors in a CUDA build, the ATen
// path on any other device.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "op_checks.hpp"

namespace pagedkv_py {

/// The page table on the host (a device table is copied once, as the classes do).
inline at::Tensor on_host(const at::Tensor& t) { return t.device().is_cpu() ? t : t.to(at::kCPU); }

/// Runs an op's body; a c10::IndexError (TORCH_CHECK_INDEX, which Python
/// would raise as IndexError) becomes a c10::Error with the same message,
/// so that every bad call of an op raises RuntimeError.
template <class F>
decltype(auto) op_body(F&& f) {
  try {
    return f();
  } catch (const c10::IndexError& e) {
    TORCH_CHECK(false, e.what_without_backtrace());
  }
}

}  // namespace pagedkv_py
