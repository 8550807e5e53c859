// Every CUDA kernel pagedkv can launch compiles with NVRTC for sm_80 and
// sm_90, with no error and no warning, and the parameter structs agree
// between host and device (the program's static_asserts). No GPU or driver
// is needed: this runs in CI, where a syntax error in a kernel must fail.
// The NVRTC is the CUDA toolkit's that CMake found (PAGEDKV_TEST_NVRTC), or
// the one pagedkv finds at run time; built with -DPAGEDKV_REQUIRE_NVRTC=ON
// (CI) the test fails when there is none, otherwise it skips.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "pagedkv/cuda/nvrtc.hpp"
#include "pagedkv/cuda/program.hpp"
#include "pagedkv/cuda/variants.hpp"

#ifndef PAGEDKV_REQUIRE_NVRTC
#define PAGEDKV_REQUIRE_NVRTC 0
#endif

namespace {

namespace pc = pagedkv::cuda;

/// The NVRTC to compile with, or null (with the reason in `why`).
const pc::Nvrtc* find_nvrtc(std::string& why) {
  static pc::Nvrtc loaded;
  static std::string failure;
  static const bool found = [] {
#ifdef PAGEDKV_TEST_NVRTC
    try {
      loaded = pc::load_nvrtc(PAGEDKV_TEST_NVRTC);
      return true;
    } catch (const c10::Error& e) {
      failure = std::string(e.what_without_backtrace()) + "\n";
    }
#endif
    try {
      loaded = pc::nvrtc();
      return true;
    } catch (const c10::Error& e) {
      failure += e.what_without_backtrace();
    }
    return false;
  }();
  why = failure;
  return found ? &loaded : nullptr;
}

#define PAGEDKV_NEED_NVRTC(nv)                                                                 \
  std::string why;                                                                             \
  const pc::Nvrtc* nv = find_nvrtc(why);                                                       \
  if (nv == nullptr) {                                                                         \
    if (PAGEDKV_REQUIRE_NVRTC) FAIL() << "NVRTC is required here (PAGEDKV_REQUIRE_NVRTC): " << why; \
    GTEST_SKIP() << "no NVRTC: " << why;                                                       \
  }

TEST(CudaNvrtc, EveryKernelCompilesForSm80AndSm90WithoutWarnings) {
  PAGEDKV_NEED_NVRTC(nv);
  const std::vector<pc::KernelKey> kernels = pc::all_kernels(128, {1, 3, 80, 256});
  const std::string source = pc::program_source(kernels);
  // The two architectures compile at once (NVRTC compiles separate programs on separate threads).
  const int archs[] = {80, 90};
  pc::Compiled out[2];
  std::string failure[2];
  double seconds[2] = {};
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      const auto start = std::chrono::steady_clock::now();
      try {
        out[i] = pc::compile(*nv, source, "pagedkv_all_kernels.cu", archs[i], /*ptx=*/false);
      } catch (const c10::Error& e) {
        failure[i] = e.what_without_backtrace();
      }
      seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(failure[i].empty()) << failure[i];
    EXPECT_TRUE(out[i].log.empty()) << "sm_" << archs[i] << " warnings:\n" << out[i].log;
    std::printf("sm_%d: %zu kernels, %zu-byte cubin, %.1f s (NVRTC %d.%d, %s)\n", archs[i], kernels.size(),
                out[i].image.size(), seconds[i], nv->major, nv->minor, nv->path.c_str());
    // Every entry point is in the cubin's symbols under its own name.
    for (const pc::KernelKey& k : kernels) {
      EXPECT_NE(out[i].image.find(k.entry() + std::string(1, '\0')), std::string::npos) << k.entry();
    }
  }
}

/// The check can fail: a syntax error, a warning and a parameter struct the
/// device sees differently are each reported.
TEST(CudaNvrtc, ReportsErrorsWarningsAndParameterMismatches) {
  PAGEDKV_NEED_NVRTC(nv);
  const std::string good = pc::program_source({pc::write_native_kernel()});
  try {
    (void)pc::compile(*nv, good + "namespace pkv { PKV_DEVICE int broken( { return 0; } }\n", "broken.cu", 80, false);
    ADD_FAILURE() << "a syntax error compiled";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("error"), std::string::npos) << e.what();
  }
  const pc::Compiled warned =
      pc::compile(*nv, good + "__device__ int warned() { int unused_variable; return 1; }\n", "warned.cu", 80, false);
  EXPECT_FALSE(warned.log.empty()) << "an unused variable gave no warning";
  std::string mismatched = good;
  const std::string field = "  pkv_i64 n_tokens;\n";
  const size_t at = mismatched.find(field);
  ASSERT_NE(at, std::string::npos);
  mismatched.replace(at, field.size(), "  pkv_i32 n_tokens;\n");
  try {
    (void)pc::compile(*nv, mismatched, "mismatched.cu", 80, false);
    ADD_FAILURE() << "a parameter struct of another layout compiled";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs between the host and the device"), std::string::npos) << e.what();
  }
}

}  // namespace
