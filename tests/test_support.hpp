// Shared test helpers: the targets every device-parametrised test runs on,
// the fixture they derive from, small builders for page tables and K/V
// tensors, and the checks that a failed call threw and changed nothing.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "pagedkv/pagedkv.hpp"

namespace pagedkv_test {

/// Re-exported so `using namespace pagedkv_test;` is the one using line a test file needs.
using pagedkv::HND;
using pagedkv::NHD;
using pagedkv::PagedCache;

/// One vector path of the CPU attention kernel: an instruction set and, on
/// AVX-512, the decode step it takes (cpu/attention/decode.hpp).
struct KernelPath {
  pagedkv::simd::Isa isa;
  pagedkv::cpu::attention::DecodeStep step;

  /// "avx2", "avx512", "avx512 with the avx512 decode step", ...
  std::string name() const {
    std::string name = pagedkv::simd::isa_name(isa);
    if (step == pagedkv::cpu::attention::DecodeStep::avx2) name += " with the avx2 decode step";
    if (step == pagedkv::cpu::attention::DecodeStep::avx512) name += " with the avx512 decode step";
    return name;
  }
};

/// Every vector path this CPU runs: AVX2, and AVX-512 with each decode
/// step (the one its CPU picks may differ from machine to machine).
inline std::vector<KernelPath> vector_kernel_paths() {
  using pagedkv::cpu::attention::DecodeStep;
  using pagedkv::simd::Isa;
  std::vector<KernelPath> paths;
  for (const Isa isa : pagedkv::simd::available_isas()) {
    if (isa == Isa::avx512) {
      paths.push_back({isa, DecodeStep::avx2});
      paths.push_back({isa, DecodeStep::avx512});
    } else if (isa != Isa::portable) {
      paths.push_back({isa, DecodeStep::best});
    }
  }
  return paths;
}

/// Runs the CPU attention kernel on `path` on the calling thread, for one scope.
class ScopedKernelPath {
 public:
  explicit ScopedKernelPath(const KernelPath& path) : isa_(path.isa), step_(path.step) {}

 private:
  pagedkv::simd::ScopedIsa isa_;
  pagedkv::cpu::attention::ScopedDecodeStep step_;
};

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

/// How gtest prints a Target (found by ADL): its name. Without it gtest
/// dumps the struct's bytes, and ctest's test names ended in
/// "# GetParam() = 16-byte object <01-BD ...>".
inline void PrintTo(const Target& target, std::ostream* os) { *os << target.name; }

/// Skips the calling test when its target's device is missing.
#define PAGEDKV_SKIP_IF_UNAVAILABLE(target)                                       \
  do {                                                                            \
    if ((target).device == at::kCUDA && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

/// Base fixture of every per-target test: skips a missing device, selects the target's backend.
class TargetTest : public ::testing::TestWithParam<Target> {
 protected:
  void SetUp() override { PAGEDKV_SKIP_IF_UNAVAILABLE(GetParam()); }
  /// The target's device, for moving index tensors onto it.
  at::Device device() const { return at::Device(GetParam().device); }
  /// Tensor options for a cache or K/V tensor on the target's device.
  at::TensorOptions opts(at::ScalarType dtype = at::kFloat) const {
    return at::TensorOptions().dtype(dtype).device(GetParam().device);
  }
  /// The target's backend, selected for the test's lifetime.
  pagedkv::ScopedBackend backend_{GetParam().backend};
};

/// Runs `body` once with an NHD tag and once with an HND tag, so one test body covers both layouts.
template <class Body>
void for_each_layout(Body&& body) {
  body(NHD{});
  body(HND{});
}

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

/// Expects `call` to throw c10::Error whose message has every one of `parts`: every failure-path test's check.
template <class Call>
void expect_error(Call&& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "expected c10::Error containing '" << parts.front() << "'";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg;
  }
}

/// What a failed call must leave as it was: K/V storage (a cpu copy), every ref_count, n_free.
struct CacheSnapshot {
  at::Tensor k, v;
  at::Tensor k_scales, v_scales;  // undefined for a native side
  std::vector<int64_t> refs;
  int64_t n_free;

  template <class Cache>
  explicit CacheSnapshot(const Cache& cache)
      : k(cache.k_cache().cpu().clone()),
        v(cache.v_cache().cpu().clone()),
        k_scales(cache.k_scales().defined() ? cache.k_scales().cpu().clone() : at::Tensor()),
        v_scales(cache.v_scales().defined() ? cache.v_scales().cpu().clone() : at::Tensor()),
        n_free(cache.n_free()) {
    for (int64_t p = 0; p < cache.n_pages(); ++p) refs.push_back(cache.ref_count(p));
  }

  /// Expects `cache` to be as it was; `what` prefixes the failure messages.
  template <class Cache>
  void expect_same(const Cache& cache, const std::string& what = "") const {
    const std::string prefix = what.empty() ? "" : what + ": ";
    EXPECT_TRUE(bitwise_equal(cache.k_cache(), k)) << prefix << "k_cache changed";
    EXPECT_TRUE(bitwise_equal(cache.v_cache(), v)) << prefix << "v_cache changed";
    EXPECT_EQ(cache.k_scales().defined(), k_scales.defined()) << prefix << "k_scales";
    if (k_scales.defined()) {
      EXPECT_TRUE(bitwise_equal(cache.k_scales(), k_scales)) << prefix << "k_scales changed";
    }
    EXPECT_EQ(cache.v_scales().defined(), v_scales.defined()) << prefix << "v_scales";
    if (v_scales.defined()) {
      EXPECT_TRUE(bitwise_equal(cache.v_scales(), v_scales)) << prefix << "v_scales changed";
    }
    EXPECT_EQ(cache.n_free(), n_free) << what;
    for (int64_t p = 0; p < cache.n_pages(); ++p)
      EXPECT_EQ(cache.ref_count(p), refs[static_cast<size_t>(p)]) << prefix << "page " << p;
  }
};

}  // namespace pagedkv_test
