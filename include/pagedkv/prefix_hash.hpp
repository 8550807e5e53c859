// The chained 64-bit page hash that picks a prefix's candidates: the
// prefix cache's index, its KV events and the keys of the tiers below it
// (page_store.hpp) all chain it from a seed through each page's tokens.
// Fast, not cryptographic: every user compares tokens, so a collision only
// costs a comparison.
#pragma once

#include <cstdint>

namespace pagedkv {

namespace prefix_hash {

inline uint64_t mix(uint64_t x) noexcept {  // murmur3's finaliser: every bit reaches the low (slot) bits
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

/// Fast, not cryptographic: collisions only cost a token comparison.
/// Two independent lanes halve the multiply chain's latency.
inline uint64_t page(uint64_t seed, const int64_t* tokens, int64_t n_tokens) noexcept {
  uint64_t a = seed;
  uint64_t b = seed ^ 0x9e3779b97f4a7c15ULL;
  int64_t i = 0;
  for (; i + 1 < n_tokens; i += 2) {
    a = (a ^ static_cast<uint64_t>(tokens[i])) * 0x100000001b3ULL;
    b = (b ^ static_cast<uint64_t>(tokens[i + 1])) * 0xc6a4a7935bd1e995ULL;
  }
  if (i < n_tokens) a = (a ^ static_cast<uint64_t>(tokens[i])) * 0x100000001b3ULL;
  return mix(a ^ (b >> 1) ^ static_cast<uint64_t>(n_tokens));
}

inline uint64_t salt_seed(uint64_t salt) noexcept { return mix(salt ^ 0x5bd1e9955bd1e995ULL); }

}  // namespace prefix_hash

}  // namespace pagedkv
