// The launches of paged attention on a CUDA cache (sources/attention.hpp):
// the decode kernel for one query per sequence, the prefill kernel for
// more, and the merge of split contexts. Every size that decides a grid or
// a split comes from shapes (batch, heads, head_dim, the page table's
// capacity max_pages x page_size, or the window's span when there is one)
// and the device's SM count, never from the lengths, which the kernels read
// on the device: a captured CUDA graph replays with the lengths of any
// later bind of the same shapes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "pagedkv/attention_options.hpp"
#include "pagedkv/cuda/launch.hpp"
#include "pagedkv/cuda/params.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"

namespace pagedkv {
namespace cuda {

/// Threads per block of the attention kernels (sources/attention.hpp).
constexpr int kAttentionThreads = 128;
/// A context is split only into pieces of at least this many tokens.
constexpr int64_t kMinSplitTokens = 256;
/// Shared memory a block uses without opting in (every CUDA GPU has 48 KiB).
constexpr int64_t kPlainSharedBytes = int64_t{48} << 10;
/// Query rows (queries x query heads) of one prefill block.
constexpr int64_t kPrefillRows = 16;

/// The largest head_dim the CUDA attention kernels take.
constexpr int64_t kMaxHeadDim = 512;

/// The decode kernel for K and V of one format. The dtype argument matters
/// only for native pages (the elements it loads); q and the output are
/// read and written by run-time dtype, so quantized pages of every dtype
/// share one kernel (dtype argument 0).
inline KernelKey attention_decode_kernel(int dtype, KVFormat format, int head_dim, int head_tile) {
  return kernel("attention_decode", "AttentionParams", kAttentionThreads,
                {is_quantized(format) ? 0 : dtype, static_cast<int>(format), head_dim, head_tile});
}
inline KernelKey attention_prefill_kernel() { return kernel("attention_prefill", "AttentionParams", kAttentionThreads); }
inline KernelKey attention_merge_kernel() { return kernel("attention_merge", "AttentionParams", kAttentionThreads); }

/// The decode kernel's query heads per block for GQA groups of `group`:
/// the whole group up to 8 (a power of two, rows past the group idle).
inline int decode_head_tile(int64_t group) {
  int tile = 1;
  while (tile < 8 && tile < group) tile *= 2;
  return tile;
}

/// Bytes of dynamic shared memory of the decode kernel (sources/attention.hpp):
/// queries [head_tile, D], stats [2, head_tile], warp sums [4, head_tile,
/// D], logits [head_tile, chunk].
inline int64_t decode_shared_bytes(int64_t head_tile, int64_t chunk, int64_t head_dim) {
  return 4 * (head_tile * head_dim + 2 * head_tile + 4 * head_tile * head_dim + head_tile * chunk);
}

/// Bytes of dynamic shared memory of the prefill kernel: pages and slots
/// [2, key_tile] (int64), keys [key_tile, D + 1], values [key_tile, D],
/// queries and accumulators [2, rows, D], weights [rows, 32], stats [rows, 2].
inline int64_t prefill_shared_bytes(int64_t key_tile, int64_t rows, int64_t head_dim) {
  return 16 * key_tile +
         4 * (key_tile * (head_dim + 1) + key_tile * head_dim + 2 * rows * head_dim + rows * 32 + 2 * rows);
}

/// How a context of `capacity` tokens is split: `n` splits of `chunk`
/// tokens (a multiple of `granule`, at most `max_chunk`), enough that
/// `base_blocks` x n blocks fill the device about twice over, each at least
/// kMinSplitTokens long.
struct Splits {
  int64_t chunk;
  int64_t n;
};
inline Splits choose_splits(int64_t capacity, int64_t base_blocks, int sm_count, int64_t max_chunk, int64_t granule) {
  capacity = std::max<int64_t>(capacity, 1);
  const int64_t wanted = (2 * static_cast<int64_t>(sm_count) + base_blocks - 1) / std::max<int64_t>(base_blocks, 1);
  const int64_t most = std::max<int64_t>(1, (capacity + kMinSplitTokens - 1) / kMinSplitTokens);
  int64_t n = std::min(std::max<int64_t>(wanted, 1), most);
  int64_t chunk = (capacity + n - 1) / n;
  chunk = (chunk + granule - 1) / granule * granule;
  chunk = std::min(chunk, std::max(granule, max_chunk / granule * granule));
  n = (capacity + chunk - 1) / chunk;
  return {chunk, n};
}

/// Whether the CUDA attention kernels take this head_dim (their shared
/// memory and the decode kernel's registers grow with it); larger ones use
/// the device-agnostic path.
inline bool attention_supports(int64_t head_dim, const Executor& ex) {
  return head_dim >= 1 && head_dim <= kMaxHeadDim &&
         prefill_shared_bytes(1, kPrefillRows, head_dim) <= ex.max_shared_bytes() &&
         decode_shared_bytes(8, 32, head_dim) <= ex.max_shared_bytes();
}

/// The most keys one block's queries see: a window's (with the new tokens
/// a prefill's later queries add) or the table's capacity. Splits divide
/// this span, which comes from shapes and options only.
inline int64_t key_span(int64_t capacity, int64_t n_queries, int64_t window) {
  return window > 0 ? std::min(capacity, window + n_queries - 1) : capacity;
}

/// Causal paged attention: q [B, Sq, n_heads, D] (the logical dtype, any
/// strides; D <= kMaxHeadDim, attention_supports) against the keys and values of one layer's sides through
/// `table`, each query s of sequence b at position lengths[b] - Sq + s
/// (lengths on the device), with `options` (window, softcap, sinks,
/// tree_mask on the device, as AttentionOptions says). Returns [B, Sq,
/// n_heads, D], contiguous. Inputs are validated by the caller; the
/// columns of `table` before the earliest query's window start are never
/// read. The options' paths have run under the CPU emulator only, not on
/// a GPU.
inline at::Tensor attention(Executor& ex, const params::TableRef& table, const int64_t* lengths,
                            const at::Tensor& q, const Side (&sides)[2], const PageGeometry& g, at::ScalarType dtype,
                            int64_t n_pages, const AttentionOptions& options) {
  const double scale = options.scale;
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2), D = g.head_dim;
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (batch == 0 || n_queries == 0) return out;
  const int dt = dtype_id(dtype);
  params::AttentionParams p{};
  p.table = table;
  p.lengths = lengths;
  p.q = tokens_ref(q);
  p.out = out.data_ptr();
  p.k = sides[0].pages;
  p.v = sides[1].pages;
  p.scale = scale;
  p.dtype = dt;
  p.k_format = static_cast<int64_t>(sides[0].format);
  p.v_format = static_cast<int64_t>(sides[1].format);
  p.batch = batch;
  p.n_queries = n_queries;
  p.n_heads = n_heads;
  p.n_kv_heads = g.n_heads;
  p.group = n_heads / g.n_heads;
  p.head_dim = D;
  p.page_size = g.page_size;
  p.page_shift = page_shift(g.page_size);
  p.n_pages = n_pages;
  p.window = options.window;
  p.softcap = options.softcap;
  if (options.sinks.defined()) {
    p.sinks = options.sinks.data_ptr<float>();
    p.sinks_stride = options.sinks.stride(0);
  }
  if (options.tree_mask.defined()) {
    // bool elements are bytes: element strides are byte strides.
    p.tree_mask = options.tree_mask.data_ptr();
    p.mask_batch = options.tree_mask.stride(0);
    p.mask_query = options.tree_mask.stride(1);
    p.mask_key = options.tree_mask.stride(2);
  }
  const int64_t span = key_span(table.cols * g.page_size, n_queries, options.window);
  KernelKey key;
  Dim3 grid;
  int64_t shared = 0;
  if (n_queries == 1 && sides[0].format == sides[1].format) {
    const int tile = decode_head_tile(p.group);
    p.head_tile = tile;
    p.n_head_tiles = (p.group + tile - 1) / tile;
    p.query_tile = 1;
    p.n_query_tiles = 1;
    int64_t budget = kPlainSharedBytes;
    if (decode_shared_bytes(tile, 32, D) > budget) budget = ex.max_shared_bytes();
    const int64_t max_chunk = (budget / 4 - 2 * tile - 5 * tile * D) / tile;
    const Splits s = choose_splits(span, batch * g.n_heads * p.n_head_tiles, ex.sm_count(), max_chunk, 32);
    p.split_tokens = s.chunk;
    p.n_splits = s.n;
    key = attention_decode_kernel(dt, sides[0].format, static_cast<int>(D), tile);
    shared = decode_shared_bytes(tile, s.chunk, D);
  } else {
    p.head_tile = std::min(p.group, kPrefillRows);
    p.n_head_tiles = (p.group + p.head_tile - 1) / p.head_tile;
    p.query_tile = std::min(n_queries, std::max<int64_t>(1, kPrefillRows / p.head_tile));
    p.n_query_tiles = (n_queries + p.query_tile - 1) / p.query_tile;
    const int64_t rows = p.query_tile * p.head_tile;
    int64_t budget = kPlainSharedBytes;
    if (prefill_shared_bytes(1, rows, D) > budget) budget = ex.max_shared_bytes();
    int64_t key_tile = 32;
    while (key_tile > 1 && prefill_shared_bytes(key_tile, rows, D) > budget) key_tile /= 2;
    p.key_tile = key_tile;
    const Splits s = choose_splits(span, batch * p.n_query_tiles * g.n_heads * p.n_head_tiles, ex.sm_count(),
                                   span + key_tile, key_tile);
    p.split_tokens = s.chunk;
    p.n_splits = s.n;
    key = attention_prefill_kernel();
    shared = prefill_shared_bytes(key_tile, rows, D);
  }
  TORCH_CHECK(shared <= ex.max_shared_bytes(), "pagedkv::cuda::attention: head_dim ", D, " needs ", shared,
              " bytes of shared memory, the device has ", ex.max_shared_bytes());
  at::Tensor partials;
  if (p.n_splits > 1) {
    partials = at::empty({batch * n_queries * n_heads * p.n_splits * (2 + D)}, q.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  const int64_t blocks_x = p.n_splits * p.n_query_tiles * batch;
  TORCH_CHECK(blocks_x < (int64_t{1} << 31) && g.n_heads * p.n_head_tiles < 65536,
              "pagedkv::cuda::attention: a grid of ", blocks_x, " x ", g.n_heads * p.n_head_tiles, " blocks");
  grid.x = static_cast<uint32_t>(blocks_x);
  grid.y = static_cast<uint32_t>(g.n_heads * p.n_head_tiles);
  ex.launch(make_launch(key, grid, p, static_cast<uint32_t>(shared)));
  if (p.n_splits > 1) {
    Dim3 merge_grid;
    merge_grid.x = blocks_for(batch * n_queries * n_heads, 1);
    ex.launch(make_launch(attention_merge_kernel(), merge_grid, p));
  }
  return out;
}

}  // namespace cuda
}  // namespace pagedkv
