// Runs every docs sample (docs/examples/*.cpp) and names the one that fails.
// ctest `docs_examples`; the samples are small (caches of a few MiB).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>

#include "samples.hpp"

int main() {
  at::manual_seed(0);
  const struct {
    const char* name;
    void (*run)();
  } samples[] = {
      {"cache", docs::cache_sample},
      {"attention", docs::attention_sample},
      {"quantization", docs::quantization_sample},
      {"sequences", docs::sequences_sample},
      {"prefix_cache", docs::prefix_cache_sample},
      {"transfer", docs::transfer_sample},
      {"tiers", docs::tiers_sample},
  };
  int failed = 0;
  for (const auto& sample : samples) {
    try {
      sample.run();
      std::printf("ok      %s\n", sample.name);
    } catch (const c10::Error& e) {
      std::printf("FAILED  %s: %s\n", sample.name, e.what_without_backtrace());
      ++failed;
    } catch (const std::exception& e) {
      std::printf("FAILED  %s: %s\n", sample.name, e.what());
      ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}
