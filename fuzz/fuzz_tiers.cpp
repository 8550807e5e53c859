// libFuzzer target: decodes each input into a configuration (a PrefixCache
// with host-memory and directory tiers over a small pool) and a script of
// requests, releases, evictions, persist, restarts and file corruption
// (fuzz/tier_script.hpp), and checks every match against a model built
// from the KV events.
// Build and run: `make fuzz FUZZ_SECONDS=60` (fuzz/README.md).
#include <ATen/Parallel.h>
#include <c10/util/Logging.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tier_script.hpp"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  at::set_num_threads(1);
  c10::SetStackTraceFetcher([] { return std::string(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool trace = std::getenv("PAGEDKV_FUZZ_TRACE") != nullptr;
  pagedkv_fuzz::TierOptions options;
  options.trace = trace;
  try {
    pagedkv_fuzz::run_tier_script(data, size, options);
  } catch (const pagedkv_fuzz::Failure& failure) {
    std::fprintf(stderr, "pagedkv fuzz failure: %s\n", failure.what());
    std::abort();
  }
  return 0;
}
