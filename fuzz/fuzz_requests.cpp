// libFuzzer target: examples/llama's requests reader on arbitrary bytes
// (fuzz/llama_inputs.hpp says what is checked).
// Build and run: `make fuzz FUZZ_SECONDS=60` (fuzz/README.md).
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>

#include "llama_inputs.hpp"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    llama_fuzz::run_requests_input(data, size);
  } catch (const llama_fuzz::Failure& failure) {
    std::fprintf(stderr, "llama fuzz failure: %s\n", failure.what());
    std::abort();
  }
  return 0;
}
