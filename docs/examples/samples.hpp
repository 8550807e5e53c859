// What the docs samples share: expect(), which throws when a claim the docs
// make does not hold, and the samples main.cpp runs. Each sample is a
// function in its own file; the regions between `//! [name]` lines are
// quoted verbatim by the docs (scripts/check-docs keeps them equal).
#pragma once

#include <stdexcept>
#include <string>

namespace docs {

/// Throws naming `what` unless `ok`: a sample that runs proves its claims.
inline void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("docs sample: expected " + what);
}

void cache_sample();         // cache.cpp: docs/cache.md
void attention_sample();     // attention.cpp: docs/attention.md
void quantization_sample();  // quantization.cpp: docs/quantization.md
void sequences_sample();     // sequences.cpp: docs/sequences.md
void prefix_cache_sample();  // prefix_cache.cpp: docs/sequences.md
void transfer_sample();      // transfer.cpp: docs/transfer.md
void tiers_sample();         // tiers.cpp: docs/tiers.md

}  // namespace docs
