// libFuzzer target: decodes each input into a configuration (a device and a
// host cache, each with a SequenceTable) and a script of SequenceTable calls
// (fuzz/sequence_script.hpp), and checks the tables against a model.
// Build and run: `make fuzz FUZZ_SECONDS=60` (fuzz/README.md).
#include <ATen/Parallel.h>
#include <c10/util/Logging.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "sequence_script.hpp"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // One thread: determinism and executions per second matter more here.
  at::set_num_threads(1);
  // Most scripts throw c10::Error often; its C++ backtrace (dladdr per
  // frame) would cost more than the call itself.
  c10::SetStackTraceFetcher([] { return std::string(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool trace = std::getenv("PAGEDKV_FUZZ_TRACE") != nullptr;
  pagedkv_fuzz::SequenceOptions options;
  options.trace = trace;
  try {
    pagedkv_fuzz::run_sequence_script(data, size, options);
  } catch (const pagedkv_fuzz::Failure& failure) {
    std::fprintf(stderr, "pagedkv fuzz failure: %s\n", failure.what());
    std::abort();
  }
  return 0;
}
