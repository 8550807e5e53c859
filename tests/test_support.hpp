// Shared test helpers: the targets every device-parametrised test runs on,
// and small builders for page tables and K/V tensors.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pagedkv/pagedkv.hpp"

namespace pagedkv_test {

/// Where a test runs: a device plus the kernels the cache uses there.
struct Target {
  at::DeviceType device;
  pagedkv::Backend backend;
  const char* name;
};

/// CPU with the hand-written kernels, CPU forced through the ATen path
/// (the one CUDA caches take), and CUDA (skipped when no GPU is visible).
inline std::vector<Target> all_targets() {
  return {{at::kCPU, pagedkv::Backend::automatic, "cpu"},
          {at::kCPU, pagedkv::Backend::generic, "cpu_generic"},
          {at::kCUDA, pagedkv::Backend::automatic, "cuda"}};
}

inline std::string target_name(const ::testing::TestParamInfo<Target>& info) { return info.param.name; }

/// Skips the calling test when its target's device is missing.
#define PAGEDKV_SKIP_IF_UNAVAILABLE(target)                                       \
  do {                                                                            \
    if ((target).device == at::kCUDA && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

/// A page table [rows, cols] from host values.
inline at::Tensor table(const std::vector<std::vector<int64_t>>& rows, at::ScalarType dtype = at::kLong) {
  const int64_t n_rows = static_cast<int64_t>(rows.size());
  const int64_t n_cols = n_rows == 0 ? 0 : static_cast<int64_t>(rows[0].size());
  at::Tensor t = at::empty({n_rows, n_cols}, at::kLong);
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t c = 0; c < n_cols; ++c) t[r][c] = rows[static_cast<size_t>(r)][static_cast<size_t>(c)];
  return t.to(dtype);
}

/// A 1-D integer tensor.
inline at::Tensor ints(const std::vector<int64_t>& values, at::ScalarType dtype = at::kLong) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  for (size_t i = 0; i < values.size(); ++i) t[static_cast<int64_t>(i)] = values[i];
  return t.to(dtype);
}

/// Deterministic, exactly representable values (fp16 and bf16 hold them
/// exactly), distinct per element and per `seed`.
inline at::Tensor pattern(at::IntArrayRef shape, int64_t seed, at::TensorOptions options) {
  at::Tensor t = at::arange(at::IntArrayRef(shape).empty() ? 1 : c10::multiply_integers(shape), at::kLong);
  t = ((t * 7 + seed * 131) % 251 - 125).to(at::kFloat) / 8.0;
  return t.view(shape).to(options);
}

/// Bitwise equality (NaN-safe, dtype-agnostic).
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const at::Tensor ac = a.cpu().contiguous();
  const at::Tensor bc = b.cpu().contiguous();
  return ac.numel() == 0 ||
         std::memcmp(ac.data_ptr(), bc.data_ptr(), static_cast<size_t>(ac.numel()) * ac.element_size()) == 0;
}

}  // namespace pagedkv_test
