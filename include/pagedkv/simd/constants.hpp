// The CPU attention kernel's block and tile sizes.
#pragma once

#include <cstdint>

namespace pagedkv {
namespace simd {

/// Tokens whose keys (and values) are read and converted at once: one block
/// is shared by every query row of a work item.
constexpr int64_t kKeyBlock = 32;
/// Query rows (queries x query heads) one work item handles.
constexpr int64_t kRowsPerTile = 64;
/// A context is split across threads only into pieces of at least this many tokens.
constexpr int64_t kMinSplitTokens = 256;
/// Query rows that share a kv head and are scored and accumulated in one
/// pass over a key block: each key or value vector loaded once serves all of
/// them (the query heads of a GQA group).
constexpr int kRowsAtOnce = 4;

}  // namespace simd
}  // namespace pagedkv
