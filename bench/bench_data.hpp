// The suite's fixed geometry and the data every benchmark builds on
// (patterns, shuffled page tables). Free of Google Benchmark, so that
// pagedkv_device_bench builds where only torch is (a GPU machine).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "pagedkv/kv_format.hpp"
#include "pagedkv/page_pool.hpp"

namespace pagedkv_bench {

// ---- the fixed suite geometry ----
constexpr int64_t kHeads = 8;
constexpr int64_t kHeadDim = 128;
constexpr int64_t kPageSize = 16;
constexpr int64_t kElemSize = 2;  // fp16
constexpr int64_t kTokenBytes = kHeads * kHeadDim * kElemSize;
inline at::TensorOptions half() { return at::TensorOptions().dtype(at::kHalf); }

// ---- data ----

/// Fills a tensor's bytes with a cheap deterministic pattern (fast enough for
/// GiB-sized caches; every 16-bit value is finite as fp16/bf16 because the
/// high exponent bits are masked).
inline void fill_pattern(const at::Tensor& t, uint64_t seed) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "fill_pattern: contiguous CPU tensor expected");
  auto* p = static_cast<uint16_t*>(t.data_ptr());
  const int64_t n = t.numel() * static_cast<int64_t>(t.element_size()) / 2;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<uint16_t>(x & 0xBBFFu);
  }
}

/// A [rows, cols] int64 page table whose row b maps its first pages[b]
/// columns (-1 after), with pages taken from `pool` (alloc_n) and shuffled
/// over the whole table, so neighbouring columns are far apart in memory.
inline at::Tensor shuffled_page_table(pagedkv::PagePool& pool, const std::vector<int64_t>& pages, int64_t cols,
                                      uint64_t seed) {
  const int64_t rows = static_cast<int64_t>(pages.size());
  const int64_t total = std::accumulate(pages.begin(), pages.end(), int64_t{0});
  std::vector<int64_t> ids = pool.alloc_n(total);
  TORCH_CHECK(static_cast<int64_t>(ids.size()) == total, "shuffled_page_table: pool too small");
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  at::Tensor table = at::full({rows, cols}, -1, at::kLong);
  int64_t* data = table.data_ptr<int64_t>();
  size_t next = 0;
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t c = 0; c < pages[static_cast<size_t>(b)]; ++c) data[b * cols + c] = ids[next++];
  return table;
}

/// Same, every row mapping `pages_per_row` pages.
inline at::Tensor shuffled_page_table(pagedkv::PagePool& pool, int64_t rows, int64_t pages_per_row, uint64_t seed) {
  return shuffled_page_table(pool, std::vector<int64_t>(static_cast<size_t>(rows), pages_per_row), pages_per_row,
                             seed);
}

/// Pages needed to hold `tokens` tokens.
inline int64_t pages_for(int64_t tokens) { return (tokens + kPageSize - 1) / kPageSize; }

/// Bytes per token of K (or V) in the pages: fp16 elements, or one-byte
/// codes plus a float32 scale per head vector (K and V in the same format).
inline int64_t page_token_bytes(const pagedkv::KVQuant& quant) {
  return pagedkv::is_quantized(quant.k) ? kHeads * (kHeadDim + 4) : kTokenBytes;
}

}  // namespace pagedkv_bench
