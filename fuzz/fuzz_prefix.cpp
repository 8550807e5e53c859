// libFuzzer target: decodes each input into a configuration (a cache and a
// host cache, each with a SequenceTable, a PrefixCache on the first) and a
// script of prefix-cache and table calls (fuzz/prefix_script.hpp), and
// checks the cache against a model.
// Build and run: `make fuzz FUZZ_SECONDS=60` (fuzz/README.md).
#include <ATen/Parallel.h>
#include <c10/util/Logging.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "prefix_script.hpp"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  at::set_num_threads(1);
  // Bad calls throw c10::Error often; skip its C++ backtrace.
  c10::SetStackTraceFetcher([] { return std::string(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool trace = std::getenv("PAGEDKV_FUZZ_TRACE") != nullptr;
  pagedkv_fuzz::PrefixOptions options;
  options.trace = trace;
  try {
    pagedkv_fuzz::run_prefix_script(data, size, options);
  } catch (const pagedkv_fuzz::Failure& failure) {
    std::fprintf(stderr, "pagedkv fuzz failure: %s\n", failure.what());
    std::abort();
  }
  return 0;
}
