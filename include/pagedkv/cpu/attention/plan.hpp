// How a paged_attention call is cut into work items for the CPU threads:
// query tiles x kv heads x key splits (flash-decoding), and the split tiles
// whose partial results are merged afterwards.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pagedkv/simd/constants.hpp"

namespace pagedkv {
namespace cpu {
namespace attention {

/// Queries [s0, s1) of sequence b, kv heads [h0, h0 + nh) (and their query
/// heads), against keys [t0, t1).
struct Work {
  int64_t b;
  int64_t s0, s1;
  int64_t h0, nh;
  int64_t t0, t1;
  int64_t partial;  ///< first scratch row of its partial result; -1: writes the output
};

/// A tile whose keys were split: split i's partial rows start at
/// partial + i * rows; they are merged into the output afterwards.
struct SplitTile {
  int64_t b;
  int64_t s0, s1;
  int64_t h0, nh;
  int64_t n_splits;
  int64_t partial;
};

struct Plan {
  std::vector<Work> work;
  std::vector<SplitTile> split;  ///< tiles to merge
  int64_t partial_rows = 0;      ///< scratch rows of (max, sum, acc[D])
  int64_t max_rows = 0;          ///< query rows of the largest work item
  int64_t heads = 1;             ///< kv heads per work item
};

/// The keys [first, end) the queries [s0, s1) of a row read, query 0 at
/// position first_pos: causal, from the earliest query's window start
/// (window > 0), through the last new token where a tree mask may show a
/// query later new tokens.
struct KeyRange {
  int64_t first;
  int64_t end;
};

inline KeyRange tile_keys(int64_t first_pos, int64_t s0, int64_t s1, int64_t n_queries, int64_t window,
                          bool tree_mask) {
  const int64_t first = window > 0 ? std::max<int64_t>(0, first_pos + s0 - window + 1) : 0;
  return {first, first_pos + (tree_mask ? n_queries : s1)};
}

/// Tiles the queries (and kv heads) and splits each tile's keys so that the
/// work items keep `n_threads` threads busy with about equal work.
/// Decode and short chunks take every kv head in one item: the item then
/// reads whole tokens (NHD) or whole pages (HND), contiguous memory. A
/// tile's keys are those tile_keys gives: a windowed decode's items cover
/// its window, not its context.
inline Plan plan(const std::vector<int64_t>& lengths,  // [B], each >= n_queries >= 1
                 int64_t n_queries, int64_t group, int64_t n_kv_heads, int64_t n_threads, int64_t window = 0,
                 bool tree_mask = false) {
  Plan p;
  int64_t tile = n_queries;
  if (n_queries * group * n_kv_heads <= simd::kRowsPerTile) {
    p.heads = n_kv_heads;
  } else {
    p.heads = 1;
    tile = std::min(n_queries, std::max<int64_t>(1, simd::kRowsPerTile / group));
  }
  p.max_rows = tile * group * p.heads;
  // Keys read x kv heads, over every tile: the total work.
  int64_t total = 0;
  for (const int64_t length : lengths) {
    for (int64_t s0 = 0; s0 < n_queries; s0 += tile) {
      const KeyRange keys = tile_keys(length - n_queries, s0, std::min(s0 + tile, n_queries), n_queries, window,
                                      tree_mask);
      total += keys.end - keys.first;
    }
  }
  total *= n_kv_heads;
  const int64_t target_items = n_threads <= 1 ? 1 : 4 * n_threads;
  int64_t chunk = std::max(simd::kMinSplitTokens, (total + target_items - 1) / target_items / p.heads);
  chunk = (chunk + simd::kKeyBlock - 1) / simd::kKeyBlock * simd::kKeyBlock;

  for (int64_t b = 0; b < static_cast<int64_t>(lengths.size()); ++b) {
    const int64_t first_pos = lengths[static_cast<size_t>(b)] - n_queries;  // position of query 0
    for (int64_t s0 = 0; s0 < n_queries; s0 += tile) {
      const int64_t s1 = std::min(s0 + tile, n_queries);
      const KeyRange keys = tile_keys(first_pos, s0, s1, n_queries, window, tree_mask);
      const int64_t n_splits = (keys.end - keys.first + chunk - 1) / chunk;
      const int64_t rows = (s1 - s0) * group * p.heads;
      for (int64_t h0 = 0; h0 < n_kv_heads; h0 += p.heads) {
        const int64_t partial = n_splits > 1 ? p.partial_rows : -1;
        if (n_splits > 1) {
          p.split.push_back({b, s0, s1, h0, p.heads, n_splits, partial});
          p.partial_rows += n_splits * rows;
        }
        for (int64_t i = 0; i < n_splits; ++i) {
          p.work.push_back({b, s0, s1, h0, p.heads, keys.first + i * chunk,
                            std::min(keys.first + (i + 1) * chunk, keys.end), n_splits > 1 ? partial + i * rows : -1});
        }
      }
    }
  }
  return p;
}

}  // namespace attention
}  // namespace cpu
}  // namespace pagedkv
