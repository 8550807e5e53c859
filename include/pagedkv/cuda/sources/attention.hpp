// Kernel source of paged attention, read straight from the pages (native or
// quantized) through the page table:
//
// attention_decode<T, F, D, G>: one query per sequence (decode), K and V
//   of one format F. A block takes one sequence, one kv head, kG of its
//   query heads (a GQA group shares every K and V load) and one split of
//   the context (flash-decoding: splits come from the table's capacity,
//   never from the lengths, so a CUDA graph replays with any lengths). Pass
//   1 scores the split's keys (a thread group per token, 16-byte loads,
//   codes decoded in registers) into shared memory; then a softmax over
//   them; pass 2 accumulates the values. One split writes the output;
//   several write partial results (max, sum, accumulator) that
//   attention_merge combines. Templated on everything its inner loops
//   touch; each instantiation is one more NVRTC compile (bench/NOTES.md,
//   "CUDA"): one per (dtype, format, head_dim, head tile) and no more.
// attention_prefill: any number of queries per sequence (chunked prefill;
//   also decode when K and V have different formats), causal. A block takes
//   a tile of query rows (queries x query heads of one kv head) and one
//   split of the keys; key tiles are staged in shared memory as float32;
//   each warp runs an online softmax for its rows (accumulators in shared
//   memory). Dtype, formats and head_dim are run-time values: one kernel
//   for every cache.
//   Correct and general; not tuned (no tensor cores).
// attention_merge: combines the splits of each output row.
//
// Quantized sides: a key's scale multiplies its score, a value's scale its
// softmax weight (fp8 codes are decoded as e4m3 / 256 through fp16, and the
// scale carries the 256, as on the CPU).
//
// The options (AttentionOptions) are run-time parameters of every kernel,
// not template arguments, so that they add no NVRTC compile. A block's keys
// start at its earliest query's window start: splits cover the window, not
// the context, and the pages before it (which may be -1) are never read.
// The soft-cap applies to the scaled logit before any max is taken; a
// tree mask decides per key among the new tokens; the sinks join the
// denominator only where a row is finished (store_output), after splits
// are merged. Untested on a GPU: only the CPU emulator has run this text.
#pragma once

#include "pagedkv/cuda/source_text.hpp"

namespace pagedkv {
namespace cuda {
namespace sources {

// clang-format off
inline constexpr SourceText kAttention{"pagedkv/cuda/sources/attention.hpp", __LINE__, R"PAGEDKV(
namespace pkv {

constexpr int kAttentionThreads = 128;
constexpr int kAttentionWarps = kAttentionThreads / 32;

/// Bytes of one stored element of a side: the logical dtype's, or a code's.
template <int kT, int kF>
PKV_DEVICE constexpr int stored_bytes() { return kF == kNative ? Dtype<kT>::kBytes : 1; }

/// What a code's scale is multiplied by (fp8 codes decode to e4m3 / 256).
PKV_DEVICE float code_unit(int format) { return format == kFp8 ? 256.0f : 1.0f; }

PKV_DEVICE constexpr int pow2_floor(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

/// How a row of kD elements of kBytes each is read: in chunks of
/// kChunkBytes (16 for 2- and 4-byte elements, 8 for codes: 8 or fewer
/// elements a chunk, the most a chunk's address and the row allow), by
/// kLanes lanes (a power of two), kPerLane chunks each.
template <int kD, int kBytes>
struct Chunking {
  static constexpr int kRowBytes = kD * kBytes;
  static constexpr int kMaxChunk = kBytes == 1 ? 8 : 16;
  static constexpr int kChunkBytes = kRowBytes % kMaxChunk == 0 ? kMaxChunk
                                     : kRowBytes % 8 == 0 ? 8
                                     : kRowBytes % 4 == 0 ? 4
                                     : kRowBytes % 2 == 0 ? 2 : 1;
  static constexpr int kElems = kChunkBytes / kBytes;
  static constexpr int kChunks = kD / kElems;
  static constexpr int kLanes = pow2_floor(kChunks < 32 ? kChunks : 32);
  static constexpr int kPerLane = (kChunks + kLanes - 1) / kLanes;
};

/// Element at bit `shift` of a 32-bit word of stored elements, as float32
/// (codes unscaled; fp8 as e4m3 / 256).
template <int kT, int kF>
PKV_DEVICE float stored_element(pkv_u32 word, int shift) {
  if constexpr (kF == kFp8) {
    const pkv_u32 c = (word >> shift) & 0xFFu;
    return pkv_half_to_float_fast(static_cast<pkv_u16>(((c & 0x80u) << 8) | ((c & 0x7Fu) << 7)));
  } else if constexpr (kF == kInt8) {
    return static_cast<float>(static_cast<pkv_i32>(static_cast<pkv_i8>((word >> shift) & 0xFFu)));
  } else if constexpr (kT == kFloat32) {
    return pkv_bits_float(word);
  } else if constexpr (kT == kFloat16) {
    return pkv_half_to_float_fast(static_cast<pkv_u16>(word >> shift));
  } else {
    return pkv_bits_float(((word >> shift) & 0xFFFFu) << 16);
  }
}

/// The kChunkBytes at p (aligned) as float32 elements.
template <int kT, int kF, int kChunkBytes>
PKV_DEVICE void load_chunk(const unsigned char* p, float* out) {
  constexpr int kBytes = stored_bytes<kT, kF>();
  constexpr int kN = kChunkBytes / kBytes;
  pkv_u32 words[kChunkBytes >= 4 ? kChunkBytes / 4 : 1];
  if constexpr (kChunkBytes == 16) {
    const pkv_v16 v = pkv_load_v16(p);
    words[0] = v.x;
    words[1] = v.y;
    words[2] = v.z;
    words[3] = v.w;
  } else if constexpr (kChunkBytes == 8) {
    const pkv_v8 v = pkv_load_v8(p);
    words[0] = v.x;
    words[1] = v.y;
  } else if constexpr (kChunkBytes == 4) {
    words[0] = pkv_load_u32(p);
  } else if constexpr (kChunkBytes == 2) {
    words[0] = pkv_load_u16(p);
  } else {
    words[0] = pkv_load_u8(p);
  }
  PKV_UNROLL
  for (int e = 0; e < kN; ++e) out[e] = stored_element<kT, kF>(words[e * kBytes / 4], 8 * (e * kBytes % 4));
}

/// Element d of a stored row of a side, dtype and format known at run time,
/// as float32 (codes unscaled).
PKV_DEVICE float load_stored(const unsigned char* row, pkv_i64 d, pkv_i64 dtype, pkv_i64 format) {
  if (format == kFp8) return stored_element<kFloat32, kFp8>(pkv_load_u8(row + d), 0);
  if (format == kInt8) return stored_element<kFloat32, kInt8>(pkv_load_u8(row + d), 0);
  if (dtype == kFloat32) return pkv_bits_float(pkv_load_u32(row + d * 4));
  if (dtype == kFloat16) return pkv_half_to_float_fast(pkv_load_u16(row + d * 2));
  return bf16_to_float(pkv_load_u16(row + d * 2));
}

/// The row of (page, slot, head) of a side, and its scale x code_unit (1 when native).
struct SideRow {
  const unsigned char* row;
  float scale;
};
PKV_DEVICE SideRow side_row(const PagesRef& side, pkv_i64 format, pkv_i64 page, pkv_i64 slot, pkv_i64 head) {
  SideRow r;
  r.row = static_cast<const unsigned char*>(side.data) + page * side.page_bytes + slot * side.token_bytes +
          head * side.head_bytes;
  r.scale = 1.0f;
  if (format != kNative) {
    r.scale = side.scales[page * side.scale_page + slot * side.scale_token + head * side.scale_head] *
              code_unit(static_cast<int>(format));
  }
  return r;
}

/// Sequence b's length, clamped to what its table row can map. Query s
/// sits at position length - n_queries + s and sees the keys `sees` says.
PKV_DEVICE pkv_i64 sequence_length(const AttentionParams& p, pkv_i64 b) {
  pkv_i64 length = p.lengths[b];
  const pkv_i64 capacity = p.table.cols * p.page_size;
  length = length < 0 ? 0 : length;
  return length > capacity ? capacity : length;
}

/// The first position a query at `position` sees: its window's start.
PKV_DEVICE pkv_i64 window_start(const AttentionParams& p, pkv_i64 position) {
  if (p.window <= 0) return 0;
  const pkv_i64 start = position - p.window + 1;
  return start > 0 ? start : 0;
}

/// Whether the tree mask lets new token i of sequence b see new token j.
PKV_DEVICE bool tree_mask_at(const AttentionParams& p, pkv_i64 b, pkv_i64 i, pkv_i64 j) {
  return pkv_load_u8(static_cast<const unsigned char*>(p.tree_mask) + b * p.mask_batch + i * p.mask_query +
                     j * p.mask_key) != 0;
}

/// Whether query s of sequence b, at `position`, sees the key at position
/// t (the new tokens start at new_start): inside its window, and older
/// than the new tokens or, among them, as the tree mask says (causal
/// without one). The window bounds a key from below only, so a tree mask
/// may show a query a later new token.
PKV_DEVICE bool sees(const AttentionParams& p, pkv_i64 b, pkv_i64 s, pkv_i64 position, pkv_i64 new_start, pkv_i64 t) {
  if (t < window_start(p, position)) return false;
  if (t < new_start) return true;
  if (p.tree_mask == nullptr) return t <= position;
  return tree_mask_at(p, b, s, t - new_start);
}

/// A scaled logit, soft-capped when the options say so.
PKV_DEVICE float cap_logit(const AttentionParams& p, float x) {
  if (p.softcap <= 0.0) return x;
  const float cap = static_cast<float>(p.softcap);
  return cap * pkv_tanh(x / cap);
}

/// Element d of query s, head h of sequence b, times the softmax scale.
PKV_DEVICE float load_query(const AttentionParams& p, pkv_i64 b, pkv_i64 s, pkv_i64 h, pkv_i64 d) {
  const unsigned char* q = static_cast<const unsigned char*>(p.q.data) + b * p.q.batch + s * p.q.token + h * p.q.head +
                           d * p.q.elem;
  float x;
  if (p.dtype == kFloat32) {
    x = pkv_bits_float(pkv_load_u32(q));
  } else if (p.dtype == kFloat16) {
    x = pkv_half_to_float_fast(pkv_load_u16(q));
  } else {
    x = bf16_to_float(pkv_load_u16(q));
  }
  return x * static_cast<float>(p.scale);
}

/// Element d of output row `row` ((b * n_queries + s) * n_heads + h) <- acc
/// / sum, acc and sum relative to exp(max); with a sink, acc / (sum +
/// exp(sink - max)). A row that saw no key (sum 0) is zeros, sink or not.
PKV_DEVICE void store_output(const AttentionParams& p, pkv_i64 row, pkv_i64 d, float acc, float max, float sum) {
  float value = 0.0f;
  if (sum > 0.0f) {
    float denominator = sum;
    if (p.sinks != nullptr) {
      const float sink = p.sinks[(row % p.n_heads) * p.sinks_stride];
      // exp(sink - max) overflows for a sink far above every logit: then
      // both terms are taken relative to the sink instead.
      if (sink > max) {
        const float r = pkv_exp(max - sink);
        acc *= r;
        denominator = sum * r + 1.0f;
      } else {
        denominator = sum + pkv_exp(sink - max);
      }
    }
    value = acc * (1.0f / denominator);
  }
  unsigned char* out = static_cast<unsigned char*>(p.out);
  if (p.dtype == kFloat32) {
    Dtype<kFloat32>::store(out + (row * p.head_dim + d) * 4, value);
  } else if (p.dtype == kFloat16) {
    Dtype<kFloat16>::store(out + (row * p.head_dim + d) * 2, value);
  } else {
    Dtype<kBFloat16>::store(out + (row * p.head_dim + d) * 2, value);
  }
}

/// Writes output element d of row (b, s, h): acc / sum, or (several
/// splits) the split's partial result (max, sum, acc; d == 0 writes max
/// and sum).
PKV_DEVICE void finish_row(const AttentionParams& p, pkv_i64 b, pkv_i64 s, pkv_i64 h, pkv_i64 split, pkv_i64 d,
                           float acc, float max, float sum) {
  const pkv_i64 row = (b * p.n_queries + s) * p.n_heads + h;
  if (p.n_splits == 1) {
    store_output(p, row, d, acc, max, sum);
    return;
  }
  float* part = p.partials + (row * p.n_splits + split) * (2 + p.head_dim);
  if (d == 0) {
    part[0] = max;
    part[1] = sum;
  }
  part[2 + d] = acc;
}

template <int kT, int kF, int kD, int kG>
PKV_DEVICE void attention_decode(const AttentionParams& p) {
  using C = Chunking<kD, stored_bytes<kT, kF>()>;
  constexpr int kLanes = C::kLanes;
  constexpr int kGroups = kAttentionThreads / kLanes;
  constexpr int kRowFloats = C::kPerLane * C::kElems;  // a lane's elements of a row
  // Dynamic shared memory, as the host sizes it (cuda/attention.hpp):
  PKV_DYNAMIC_SHARED(float, shared);
  const pkv_i64 chunk = p.split_tokens;
  float* const queries = shared;                      // [kG, kD], scaled
  float* const stats = queries + kG * kD;             // [2, kG]: max, sum
  float* const partial = stats + 2 * kG;              // [warps, kG, kD]: the warps' accumulators
  float* const logits = partial + kAttentionWarps * kG * kD;  // [kG, chunk]: scores, then softmax weights

  const pkv_i64 split = static_cast<pkv_i64>(pkv_bid_x()) % p.n_splits;
  const pkv_i64 b = static_cast<pkv_i64>(pkv_bid_x()) / p.n_splits;
  const pkv_i64 kv_head = static_cast<pkv_i64>(pkv_bid_y()) / p.n_head_tiles;
  const pkv_i64 tile_first = (static_cast<pkv_i64>(pkv_bid_y()) % p.n_head_tiles) * kG;  // in the kv head's group
  const pkv_i64 first_head = kv_head * p.group + tile_first;
  const pkv_i64 rows = p.group - tile_first < kG ? p.group - tile_first : kG;
  const pkv_i64 length = sequence_length(p, b);
  // The query sees [first, end): from its window's start, and itself unless
  // the tree mask hides it. Splits cover that range only.
  const pkv_i64 first = window_start(p, length - 1);
  const pkv_i64 end = p.tree_mask != nullptr && length > 0 && !tree_mask_at(p, b, 0, 0) ? length - 1 : length;
  const pkv_i64 t0 = first + split * chunk;
  const pkv_i64 t1 = t0 + chunk < end ? t0 + chunk : end;
  const int tid = static_cast<int>(pkv_tid());
  const int lane = tid % kLanes;   // in its token's thread group
  const int group = tid / kLanes;  // the thread group

  for (int i = tid; i < kG * kD; i += kAttentionThreads) {
    queries[i] = i / kD < rows ? load_query(p, b, 0, first_head + i / kD, i % kD) : 0.0f;
  }
  pkv_sync();

  // ---- pass 1: scores of keys [t0, t1), a thread group per key ----
  {
    float q[kG][kRowFloats];
    PKV_UNROLL
    for (int g = 0; g < kG; ++g) {
      PKV_UNROLL
      for (int j = 0; j < C::kPerLane; ++j) {
        const int c = lane + j * kLanes;
        PKV_UNROLL
        for (int e = 0; e < C::kElems; ++e) {
          q[g][j * C::kElems + e] = c < C::kChunks ? queries[g * kD + c * C::kElems + e] : 0.0f;
        }
      }
    }
    // `base` is the same on every thread: each lane reaches group_sum as often.
    for (pkv_i64 base = t0; base < t1; base += kGroups) {
      const pkv_i64 t = base + group;
      float dot[kG];
      PKV_UNROLL
      for (int g = 0; g < kG; ++g) dot[g] = 0.0f;
      pkv_i64 slot = 0;
      const pkv_i64 page = t < t1 ? page_of(p.table, b, t, p.page_size, p.page_shift, p.n_pages, &slot) : -1;
      float key_scale = 1.0f;
      if (page >= 0) {
        const SideRow key = side_row(p.k, kF, page, slot, kv_head);
        key_scale = key.scale;
        PKV_UNROLL
        for (int j = 0; j < C::kPerLane; ++j) {
          const int c = lane + j * kLanes;
          if (c < C::kChunks) {
            float k[C::kElems];
            load_chunk<kT, kF, C::kChunkBytes>(key.row + c * C::kChunkBytes, k);
            PKV_UNROLL
            for (int g = 0; g < kG; ++g) {
              PKV_UNROLL
              for (int e = 0; e < C::kElems; ++e) dot[g] += q[g][j * C::kElems + e] * k[e];
            }
          }
        }
      }
      PKV_UNROLL
      for (int g = 0; g < kG; ++g) dot[g] = group_sum(dot[g], kLanes);
      if (t < t1 && lane == 0) {
        PKV_UNROLL
        for (int g = 0; g < kG; ++g) {
          logits[g * chunk + (t - t0)] = page >= 0 ? cap_logit(p, dot[g] * key_scale) : negative_infinity();
        }
      }
    }
  }
  pkv_sync();

  // ---- softmax over the split: a warp per query head ----
  for (int g = tid / 32; g < kG; g += kAttentionWarps) {
    float* const row = logits + g * chunk;
    float max = negative_infinity();
    for (pkv_i64 j = tid % 32; j < t1 - t0; j += 32) max = row[j] > max ? row[j] : max;
    max = group_max(max, 32);
    float sum = 0.0f;
    for (pkv_i64 j = tid % 32; j < t1 - t0; j += 32) {
      const float w = row[j] == negative_infinity() ? 0.0f : pkv_exp(row[j] - max);
      row[j] = w;
      sum += w;
    }
    sum = group_sum(sum, 32);
    if (tid % 32 == 0) {
      stats[g] = max;
      stats[kG + g] = sum;
    }
  }
  pkv_sync();

  // ---- pass 2: values, a thread group per value ----
  {
    float acc[kG][kRowFloats];
    PKV_UNROLL
    for (int g = 0; g < kG; ++g) {
      PKV_UNROLL
      for (int i = 0; i < kRowFloats; ++i) acc[g][i] = 0.0f;
    }
    for (pkv_i64 t = t0 + group; t < t1; t += kGroups) {
      pkv_i64 slot = 0;
      const pkv_i64 page = page_of(p.table, b, t, p.page_size, p.page_shift, p.n_pages, &slot);
      if (page < 0) continue;
      const SideRow value = side_row(p.v, kF, page, slot, kv_head);
      float w[kG];
      PKV_UNROLL
      for (int g = 0; g < kG; ++g) w[g] = logits[g * chunk + (t - t0)] * value.scale;
      PKV_UNROLL
      for (int j = 0; j < C::kPerLane; ++j) {
        const int c = lane + j * kLanes;
        if (c < C::kChunks) {
          float v[C::kElems];
          load_chunk<kT, kF, C::kChunkBytes>(value.row + c * C::kChunkBytes, v);
          PKV_UNROLL
          for (int g = 0; g < kG; ++g) {
            PKV_UNROLL
            for (int e = 0; e < C::kElems; ++e) acc[g][j * C::kElems + e] += w[g] * v[e];
          }
        }
      }
    }
    // The groups of a warp hold the same elements: sum them over the lane's group bits.
    for (int offset = kLanes; offset < 32; offset *= 2) {
      PKV_UNROLL
      for (int g = 0; g < kG; ++g) {
        PKV_UNROLL
        for (int i = 0; i < kRowFloats; ++i) acc[g][i] += pkv_shfl_xor(acc[g][i], offset);
      }
    }
    if (tid % 32 < kLanes) {
      const int warp = tid / 32;
      PKV_UNROLL
      for (int g = 0; g < kG; ++g) {
        PKV_UNROLL
        for (int j = 0; j < C::kPerLane; ++j) {
          const int c = lane + j * kLanes;
          if (c < C::kChunks) {
            PKV_UNROLL
            for (int e = 0; e < C::kElems; ++e) partial[(warp * kG + g) * kD + c * C::kElems + e] = acc[g][j * C::kElems + e];
          }
        }
      }
    }
  }
  pkv_sync();
  for (int i = tid; i < rows * kD; i += kAttentionThreads) {
    const int g = i / kD;
    const int d = i % kD;
    float sum = 0.0f;
    PKV_UNROLL
    for (int w = 0; w < kAttentionWarps; ++w) sum += partial[(w * kG + g) * kD + d];
    finish_row(p, b, 0, first_head + g, split, d, sum, stats[g], stats[kG + g]);
  }
}

PKV_DEVICE void attention_prefill(const AttentionParams& p) {
  const pkv_i64 D = p.head_dim;
  // Dynamic shared memory, as the host sizes it (cuda/attention.hpp):
  PKV_DYNAMIC_SHARED(pkv_i64, shared);
  const pkv_i64 key_tile = p.key_tile;
  const pkv_i64 n_rows = p.query_tile * p.head_tile;
  pkv_i64* const tile_pages = shared;                                   // [key_tile]
  pkv_i64* const tile_slots = tile_pages + key_tile;                    // [key_tile]
  float* const keys = reinterpret_cast<float*>(tile_slots + key_tile);  // [key_tile, D + 1]
  float* const values = keys + key_tile * (D + 1);                      // [key_tile, D]
  float* const queries = values + key_tile * D;                         // [rows, D], scaled
  float* const accs = queries + n_rows * D;                             // [rows, D]
  float* const weights = accs + n_rows * D;                             // [rows, 32]
  float* const stats = weights + n_rows * 32;                           // [rows, 2]: max, sum

  const pkv_i64 split = static_cast<pkv_i64>(pkv_bid_x()) % p.n_splits;
  const pkv_i64 query_tile = (static_cast<pkv_i64>(pkv_bid_x()) / p.n_splits) % p.n_query_tiles;
  const pkv_i64 b = static_cast<pkv_i64>(pkv_bid_x()) / p.n_splits / p.n_query_tiles;
  const pkv_i64 kv_head = static_cast<pkv_i64>(pkv_bid_y()) / p.n_head_tiles;
  const pkv_i64 head_tile = static_cast<pkv_i64>(pkv_bid_y()) % p.n_head_tiles;
  const pkv_i64 length = sequence_length(p, b);
  const int tid = static_cast<int>(pkv_tid());
  const int lane = tid % 32;
  const int warp = tid / 32;

  // Row r: query query_tile * query_tile_size + r / head_tile_size, query
  // head kv_head * group + head_tile * head_tile_size + r % head_tile_size.
  const auto row_query = [&](pkv_i64 r) { return query_tile * p.query_tile + r / p.head_tile; };
  const auto row_head = [&](pkv_i64 r) { return head_tile * p.head_tile + r % p.head_tile; };
  const auto row_valid = [&](pkv_i64 r) { return row_query(r) < p.n_queries && row_head(r) < p.group; };
  // The tile's queries see keys in [first_visible, last_visible): from its
  // first query's window start to its last query (every new token under a
  // tree mask); this split covers [t0, t_end).
  const pkv_i64 new_start = length - p.n_queries;
  pkv_i64 tile_last_query = query_tile * p.query_tile + p.query_tile - 1;
  tile_last_query = tile_last_query < p.n_queries - 1 ? tile_last_query : p.n_queries - 1;
  const pkv_i64 first_visible = window_start(p, new_start + query_tile * p.query_tile);
  const pkv_i64 last_visible = p.tree_mask != nullptr ? length : new_start + tile_last_query + 1;
  const pkv_i64 t0 = first_visible + split * p.split_tokens;
  pkv_i64 t_end = t0 + p.split_tokens;
  t_end = t_end < last_visible ? t_end : last_visible;

  for (pkv_i64 i = tid; i < n_rows * D; i += kAttentionThreads) {
    const pkv_i64 r = i / D;
    queries[i] = row_valid(r) ? load_query(p, b, row_query(r), kv_head * p.group + row_head(r), i % D) : 0.0f;
    accs[i] = 0.0f;
  }
  for (pkv_i64 r = tid; r < n_rows; r += kAttentionThreads) {
    stats[2 * r] = negative_infinity();
    stats[2 * r + 1] = 0.0f;
  }

  for (pkv_i64 k0 = t0; k0 < t_end; k0 += key_tile) {
    pkv_sync();  // the previous tile is done with (and, first, the rows are set up)
    for (pkv_i64 j = tid; j < key_tile; j += kAttentionThreads) {
      pkv_i64 slot = 0;
      tile_pages[j] = k0 + j < t_end ? page_of(p.table, b, k0 + j, p.page_size, p.page_shift, p.n_pages, &slot) : -1;
      tile_slots[j] = slot;
    }
    pkv_sync();
    for (pkv_i64 i = tid; i < key_tile * D; i += kAttentionThreads) {
      const pkv_i64 j = i / D;
      const pkv_i64 d = i % D;
      float k = 0.0f, v = 0.0f;
      if (tile_pages[j] >= 0) {
        const SideRow kr = side_row(p.k, p.k_format, tile_pages[j], tile_slots[j], kv_head);
        const SideRow vr = side_row(p.v, p.v_format, tile_pages[j], tile_slots[j], kv_head);
        k = load_stored(kr.row, d, p.dtype, p.k_format) * kr.scale;
        v = load_stored(vr.row, d, p.dtype, p.v_format) * vr.scale;
      }
      keys[j * (D + 1) + d] = k;
      values[j * D + d] = v;
    }
    pkv_sync();
    const pkv_i64 n = t_end - k0 < key_tile ? t_end - k0 : key_tile;
    // A warp per row; `r` is the same on every lane of a warp.
    for (pkv_i64 r = warp; r < n_rows; r += kAttentionWarps) {
      const pkv_i64 position = new_start + row_query(r);
      float score = negative_infinity();
      if (row_valid(r) && lane < n && tile_pages[lane] >= 0 &&
          sees(p, b, row_query(r), position, new_start, k0 + lane)) {
        score = 0.0f;
        for (pkv_i64 d = 0; d < D; ++d) score += queries[r * D + d] * keys[lane * (D + 1) + d];
        score = cap_logit(p, score);
      }
      const float old_max = stats[2 * r];
      const float tile_max = group_max(score, 32);
      const float new_max = tile_max > old_max ? tile_max : old_max;
      float w = 0.0f;
      float correction = 1.0f;
      if (new_max != negative_infinity()) {
        correction = old_max == negative_infinity() ? 0.0f : pkv_exp(old_max - new_max);
        w = score == negative_infinity() ? 0.0f : pkv_exp(score - new_max);
      }
      const float tile_sum = group_sum(w, 32);
      weights[r * 32 + lane] = w;
      pkv_sync_warp();
      if (lane == 0) {
        stats[2 * r] = new_max;
        stats[2 * r + 1] = stats[2 * r + 1] * correction + tile_sum;
      }
      for (pkv_i64 d = lane; d < D; d += 32) {
        float acc = accs[r * D + d] * correction;
        for (pkv_i64 j = 0; j < n; ++j) acc += weights[r * 32 + j] * values[j * D + d];
        accs[r * D + d] = acc;
      }
      pkv_sync_warp();
    }
  }
  pkv_sync();
  for (pkv_i64 i = tid; i < n_rows * D; i += kAttentionThreads) {
    const pkv_i64 r = i / D;
    if (row_valid(r)) {
      finish_row(p, b, row_query(r), kv_head * p.group + row_head(r), split, i % D, accs[i], stats[2 * r],
                 stats[2 * r + 1]);
    }
  }
}

/// Combines the n_splits partial results of each output row: a block per
/// row (grid-stride), its threads over the row's elements.
PKV_DEVICE void attention_merge(const AttentionParams& p) {
  const pkv_i64 rows = p.batch * p.n_queries * p.n_heads;
  const pkv_i64 stride = 2 + p.head_dim;
  for (pkv_i64 row = pkv_bid_x(); row < rows; row += pkv_nbid_x()) {
    const float* parts = p.partials + row * p.n_splits * stride;
    float max = negative_infinity();
    for (pkv_i64 k = 0; k < p.n_splits; ++k) {
      if (parts[k * stride + 1] > 0.0f && parts[k * stride] > max) max = parts[k * stride];
    }
    float sum = 0.0f;
    for (pkv_i64 k = 0; k < p.n_splits; ++k) {
      if (parts[k * stride + 1] > 0.0f) sum += parts[k * stride + 1] * pkv_exp(parts[k * stride] - max);
    }
    for (pkv_i64 d = pkv_tid(); d < p.head_dim; d += pkv_ntid()) {
      float acc = 0.0f;
      for (pkv_i64 k = 0; k < p.n_splits; ++k) {
        if (parts[k * stride + 1] > 0.0f) acc += pkv_exp(parts[k * stride] - max) * parts[k * stride + 2 + d];
      }
      store_output(p, row, d, acc, max, sum);
    }
  }
}

}  // namespace pkv
)PAGEDKV"};
// clang-format on

}  // namespace sources
}  // namespace cuda
}  // namespace pagedkv
