// libFuzzer target: decodes each input into a cache configuration and an
// operation script (fuzz/script.hpp) and checks the cache against a model.
// Build and run: `make fuzz FUZZ_SECONDS=60` (fuzz/README.md).
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>

#include "script.hpp"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // One thread: the kernels' chunking is exercised by the tests; here
  // determinism and executions per second matter more.
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool trace = std::getenv("PAGEDKV_FUZZ_TRACE") != nullptr;
  pagedkv_fuzz::Options options;
  options.trace = trace;
  try {
    pagedkv_fuzz::run_script(data, size, options);
  } catch (const pagedkv_fuzz::Failure& failure) {
    std::fprintf(stderr, "pagedkv fuzz failure: %s\n", failure.what());
    std::abort();
  }
  return 0;
}
