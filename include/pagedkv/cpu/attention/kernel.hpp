// The CPU paged-attention kernel, for native and quantized pages alike. Keys
// and values are read block by block (kKeyBlock tokens, shared by every
// query row of a work item), with an online softmax (running max and sum) in
// float32: every head's scores of a block, then its softmax, then every
// head's values. The query heads of one kv head are scored and accumulated
// kRowsAtOnce at a time, so that each key and value vector loaded serves all
// of them. Where a token's heads are adjacent (NHD) the block is read chunk
// by chunk, every head of a chunk in a row, so that memory is read a few KiB
// at a time in order (PieceOrder, cpu/attention/prefetch.hpp). Work items come from
// cpu/attention/plan.hpp; the arithmetic from the instruction set
// simd/isa.hpp selects. Decode on native pages with AVX2 takes its own item
// loop instead (cpu/attention/decode.hpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "pagedkv/cpu/attention/decode.hpp"
#include "pagedkv/cpu/attention/plan.hpp"
#include "pagedkv/cpu/attention/prefetch.hpp"
#include "pagedkv/attention_options.hpp"
#include "pagedkv/cpu/write_gather.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/simd/constants.hpp"
#include "pagedkv/simd/convert.hpp"
#include "pagedkv/simd/isa.hpp"

namespace pagedkv {
namespace cpu {
namespace attention {

/// One side (K or V) of one layer as the kernel reads it.
struct KVSide {
  const char* pages;    // [n_pages, <page>]: elements of the cache's dtype (native) or codes
  int64_t elem_size;    // bytes per element
  KVFormat format;      // native, fp8_e4m3 or int8
  const float* scales;  // [n_pages, page_size * n_heads] in layout order; null on a native side

  bool quantized() const noexcept { return scales != nullptr; }
};

/// Layer `layer` of a cache side: its pages [L, N, <page>] and, quantized,
/// its scales [L, N, P * H] (undefined for a native side).
inline KVSide layer_side(const at::Tensor& pages, const at::Tensor& scales, KVFormat format, int64_t layer) {
  return KVSide{cpu::layer_bytes(pages, layer), static_cast<int64_t>(pages.element_size()), format,
                is_quantized(format) ? cpu::layer_floats(scales, layer) : nullptr};
}

/// What a code's scale is multiplied by so that scale * (decoded code) is
/// the stored value: fp8 codes decode to e4m3(c) / 2^8 (simd/convert.hpp).
inline float code_unit(KVFormat format) noexcept {
  return format == KVFormat::fp8_e4m3 ? simd::kE4m3ViaHalfFactor : 1.0f;
}

/// AttentionOptions beyond the scale, on raw pointers.
struct RawOptions {
  int64_t window = 0;              // 0: none
  float softcap = 0.0f;            // 0: none
  const float* sinks = nullptr;    // [n_heads], or null
  const bool* tree_mask = nullptr; // [B, Sq, Sq], contiguous, or null
};

/// Raw operands of one call.
template <class T>
struct Problem {
  AnyPageTableRef table;      // [B, max_pages]
  const int64_t* lengths;     // [B]
  const float* q;             // [B, Sq, n_heads, D], contiguous, pre-scaled
  // Read by the decode path (decode.hpp), which cppcheck, checking this
  // header alone, does not see.
  // cppcheck-suppress unusedStructMember
  const T* q_given;           // [B, Sq, n_heads, D], contiguous, as given: not scaled (bf16 dot products)
  // cppcheck-suppress unusedStructMember
  float scale;                // what q was scaled by
  T* out;                     // [B, Sq, n_heads, D], contiguous
  KVSide k;                   // one layer's keys
  KVSide v;                   // one layer's values
  float* partials;            // [partial_rows, 2 + D]: (max, sum, acc)
  PageGeometry g;
  int64_t n_queries;  // Sq
  int64_t n_heads;    // query heads
  int64_t group;      // n_heads / n_kv_heads
  // cppcheck-suppress unusedStructMember
  bool wide_decode_step;  // the AVX-512 path's decode step is the 512-bit one (decode.hpp)
  int64_t window;         // 0, or the keys [p - window + 1, p] the query at p sees
  float softcap;          // 0, or the cap of the scaled logits
  // Read through sink_of (a template over the problem type), which cppcheck does not follow.
  // cppcheck-suppress unusedStructMember
  const float* sinks;     // [n_heads], or null: each query head's sink logit
  const bool* tree_mask;  // [B, Sq, Sq], contiguous, or null: which new tokens each query sees
};

/// Which keys of a block [t0, t0 + n) the query at `s` (position
/// first_pos + s) sees: slots [skip, visible), those of them that are new
/// tokens further filtered by the tree mask (tree_mask_row, else null).
struct BlockVisibility {
  int64_t skip;               // slots before the query's window
  int64_t visible;            // slots through the last key the query may see
  const bool* tree_mask_row;  // [Sq]: mask row of the query, or null
};

template <class T>
BlockVisibility block_visibility(const Problem<T>& pr, int64_t b, int64_t s, int64_t first_pos, int64_t t0,
                                 int64_t n) {
  const int64_t pos = first_pos + s;
  const int64_t end = pr.tree_mask != nullptr ? first_pos + pr.n_queries : pos + 1;
  const int64_t first = pr.window > 0 ? pos - pr.window + 1 : t0;
  const int64_t visible = std::max<int64_t>(0, std::min(n, end - t0));
  const int64_t skip = std::min(visible, std::max<int64_t>(0, first - t0));
  const bool* row = pr.tree_mask != nullptr ? pr.tree_mask + (b * pr.n_queries + s) * pr.n_queries : nullptr;
  return {skip, visible, row};
}

/// x[j] = cap * tanh(x[j] / cap) for j < n: Gemma 2's logit soft-cap.
inline void soft_cap(float* x,  // [n]
                     int64_t n, float cap) noexcept {
  const float inverse = 1.0f / cap;
  for (int64_t j = 0; j < n; ++j) x[j] = cap * std::tanh(x[j] * inverse);
}

/// Per-thread buffers, kept between calls (at::parallel_for's threads
/// persist), so that a decode step allocates nothing per thread.
struct Scratch {
  std::vector<float> k;              // [heads * kKeyBlock, D] float32 copies of keys (copying paths only)
  std::vector<float> v;              // [heads * kKeyBlock, D] float32 copies of values
  std::vector<const void*> k_rows;   // [2, heads, kKeyBlock]: the key of (head, token), in the pages or a copy
  std::vector<const void*> v_rows;   // [2, heads, kKeyBlock]
  std::vector<float> k_scales;       // [2, heads, kKeyBlock]: a quantized key's scale x code_unit
  std::vector<float> v_scales;       // [2, heads, kKeyBlock]
  std::vector<float> acc;            // [rows, D]
  std::vector<float> max;            // [rows]
  std::vector<float> sum;            // [rows]
  std::vector<float> scores;         // [heads, kRowsAtOnce, kKeyBlock]

  /// The calling thread's buffers, large enough for the plan.
  static Scratch& local(int64_t max_rows, int64_t heads, int64_t head_dim, bool copies) {
    thread_local Scratch scratch;
    const auto grow = [](auto& buffer, int64_t size) {
      if (buffer.size() < static_cast<size_t>(size)) buffer.resize(static_cast<size_t>(size));
    };
    if (copies) {
      grow(scratch.k, heads * simd::kKeyBlock * head_dim);
      grow(scratch.v, heads * simd::kKeyBlock * head_dim);
    }
    grow(scratch.k_rows, 2 * heads * simd::kKeyBlock);
    grow(scratch.v_rows, 2 * heads * simd::kKeyBlock);
    grow(scratch.k_scales, 2 * heads * simd::kKeyBlock);
    grow(scratch.v_scales, 2 * heads * simd::kKeyBlock);
    grow(scratch.acc, max_rows * head_dim);
    grow(scratch.max, max_rows);
    grow(scratch.sum, max_rows);
    grow(scratch.scores, heads * simd::kRowsAtOnce * simd::kKeyBlock);
    return scratch;
  }
};

/// Whether the kernel reads this call's pages in place rather than float32
/// copies of each block: always on the vector paths, which convert as they
/// load (codes included); on the portable path only for a float32 cache
/// whose head's tokens are contiguous (HND) and whose sides are native.
/// In place saves the block's conversion pass and its round trip through
/// L2 (the copies of 8 heads x 32 tokens x 128 floats, K and V, are
/// 256 KiB): bench/NOTES.md, "The general loop (`cpu/attention/kernel.hpp`)".
template <class Ops, class T>
bool reads_in_place(const PageGeometry& g, const KVSide& k, const KVSide& v) {
  const bool head_major = g.token_stride == g.head_dim;
  const bool native = !k.quantized() && !v.quantized();
  return Ops::kReadsPagesDirectly || (head_major && native && std::is_same<T, float>::value);
}

/// What a block's rows point at on a path that converts as it loads
/// nothing: float32 copies (kCopies), or a float32 cache's own pages.
template <bool kCopies, class T>
using RowElement = typename std::conditional<kCopies, float, T>::type;

/// The stored vector at `src` (a side's element: T, or a code) into float32.
template <class Ops, class T>
void side_to_float(KVFormat format, const char* src, float* dst, int64_t n) {
  switch (format) {
    case KVFormat::fp8_e4m3: return Ops::to_float(reinterpret_cast<const simd::E4m3Code*>(src), dst, n);
    case KVFormat::int8: return Ops::to_float(reinterpret_cast<const int8_t*>(src), dst, n);
    default: return Ops::to_float(reinterpret_cast<const T*>(src), dst, n);
  }
}

/// Calls f(column, in_page, j0, run) for each page's share of tokens
/// [t0, t0 + n): `run` tokens from slot `in_page` of page column `column`,
/// which are tokens [j0, j0 + run) of the range.
template <class F>
void for_each_page_run(int64_t page_size, int64_t t0, int64_t n, F&& f) {
  for (int64_t t = t0; t < t0 + n;) {
    const int64_t in_page = t % page_size;
    const int64_t run = std::min(t0 + n - t, page_size - in_page);
    f(t / page_size, in_page, t - t0, run);
    t += run;
  }
}

/// The index of a quantized side's scale of (page, token slot, head): one
/// scale per (token, head) vector in the pages' layout order, so the index
/// is the vector's element offset / D. The steps are divided once, not per
/// vector (64-bit divisions are slow: bench/NOTES.md, "Fixed costs of small writes").
struct ScaleIndex {
  int64_t page_vectors;   ///< scales per page
  int64_t token_vectors;  ///< between consecutive tokens of one head
  int64_t head_vectors;   ///< between consecutive heads of one token

  explicit ScaleIndex(const PageGeometry& g)
      : page_vectors(g.page_elems / g.head_dim),
        token_vectors(g.token_stride / g.head_dim),
        head_vectors(g.head_stride / g.head_dim) {}

  int64_t operator()(int64_t page_id, int64_t in_page, int64_t head) const noexcept {
    return page_id * page_vectors + in_page * token_vectors + head * head_vectors;
  }
};

/// Points rows[h * kKeyBlock + j] at the vector of kv head h0 + h, token
/// t0 + j: into the pages, or (kCopies) at float32 copies in `buffer`, laid
/// out [head, token, D] so that one head's keys are adjacent (NHD rows a
/// token apart would alias in the L1 cache: a 4 KiB stride for 8 heads x
/// 128 x fp32). A quantized side's scales go to scales[h * kKeyBlock + j],
/// times code_unit.
template <class Ops, bool kCopies, class T>
void load_block(const Problem<T>& pr, const KVSide& side, int64_t b, int64_t h0, int64_t nh, int64_t t0,
                int64_t n,
                float* buffer,        // [nh, kKeyBlock, D], for copies
                const void** rows,    // [nh, kKeyBlock]
                float* scales) {      // [nh, kKeyBlock], for a quantized side
  const PageGeometry& g = pr.g;
  const int64_t D = g.head_dim;
  const int64_t page_bytes = g.page_elems * side.elem_size;
  const ScaleIndex scale_index(g);
  const float unit = code_unit(side.format);
  for_each_page_run(g.page_size, t0, n, [&](int64_t column, int64_t in_page, int64_t j0, int64_t run) {
    const int64_t page_id = pr.table(b, column);
    const char* page = side.pages + page_id * page_bytes;
    for (int64_t j = 0; j < run; ++j) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t offset = g.offset(in_page + j, h0 + h);  // elements into the page
        const char* src = page + offset * side.elem_size;
        const int64_t slot = h * simd::kKeyBlock + j0 + j;
        if (side.quantized()) scales[slot] = side.scales[scale_index(page_id, in_page + j, h0 + h)] * unit;
        if constexpr (kCopies) {
          float* dst = buffer + slot * D;
          side_to_float<Ops, T>(side.format, src, dst, D);
          rows[slot] = dst;
        } else {
          rows[slot] = src;
        }
      }
    }
  });
}

/// Prefetches the scales load_block will copy for kv heads [h0, h0 + nh)
/// and tokens [t0, t0 + n) of sequence b, on a quantized side. load_block
/// copies a block's scales as soon as it locates the block, so without this
/// each page's first scale load waited for memory (bench/NOTES.md, "Scales
/// read ahead").
template <class T>
void prefetch_scales(const Problem<T>& pr, const KVSide& side, int64_t b, int64_t h0, int64_t nh, int64_t t0,
                     int64_t n) {
  if (!side.quantized() || n <= 0) return;
  const ScaleIndex scale_index(pr.g);
  constexpr auto kScaleBytes = static_cast<int64_t>(sizeof(float));
  for_each_page_run(pr.g.page_size, t0, n, [&](int64_t column, int64_t in_page, int64_t /*j0*/, int64_t run) {
    const int64_t page_id = pr.table(b, column);
    if (scale_index.head_vectors < scale_index.token_vectors) {  // a token's heads adjacent (NHD): one span
      const int64_t span = (run - 1) * scale_index.token_vectors + nh * scale_index.head_vectors;
      prefetch_bytes(side.scales + scale_index(page_id, in_page, h0), span * kScaleBytes);
    } else {  // a head's tokens adjacent (HND): a run per head
      for (int64_t h = h0; h < h0 + nh; ++h) {
        prefetch_bytes(side.scales + scale_index(page_id, in_page, h), run * kScaleBytes);
      }
    }
  });
}

/// Ops::scores on one block's keys, as the element type they are stored in.
template <class Ops, bool kCopies, class T>
void score_block(KVFormat format, const float* const* q, int rows,
                 const void* const* keys,  // n x [D]
                 int64_t n, int64_t head_dim,
                 float* out) {  // [rows, kKeyBlock]
  if constexpr (kCopies || !Ops::kReadsPagesDirectly) {
    Ops::template scores<RowElement<kCopies, T>>(q, rows, keys, n, head_dim, out);
  } else {
    switch (format) {
      case KVFormat::fp8_e4m3: return Ops::template scores<simd::E4m3Code>(q, rows, keys, n, head_dim, out);
      case KVFormat::int8: return Ops::template scores<int8_t>(q, rows, keys, n, head_dim, out);
      default: return Ops::template scores<T>(q, rows, keys, n, head_dim, out);
    }
  }
}

/// Ops::accumulate on one block's values, as the element type they are stored in.
template <class Ops, bool kCopies, class T>
void accumulate_block(KVFormat format, float* const* acc, int rows,
                      const void* const* values,  // n x [D]
                      const float* p,             // [rows, kKeyBlock]
                      int64_t n, int64_t head_dim) {
  if constexpr (kCopies || !Ops::kReadsPagesDirectly) {
    Ops::template accumulate<RowElement<kCopies, T>>(acc, rows, values, p, n, head_dim);
  } else {
    switch (format) {
      case KVFormat::fp8_e4m3: return Ops::template accumulate<simd::E4m3Code>(acc, rows, values, p, n, head_dim);
      case KVFormat::int8: return Ops::template accumulate<int8_t>(acc, rows, values, p, n, head_dim);
      default: return Ops::template accumulate<T>(acc, rows, values, p, n, head_dim);
    }
  }
}

/// Where one block's vectors are, for every kv head of a work item.
struct BlockRows {
  const void** k;   // [nh, kKeyBlock]: keys, in the pages or float32 copies
  const void** v;   // [nh, kKeyBlock]: values
  float* k_scales;  // [nh, kKeyBlock]: quantized keys' scales x code_unit
  float* v_scales;  // [nh, kKeyBlock]
};

/// Writes one finished row: out = acc / sum, with the head's sink logit
/// (sinks: its address, else null) joining the denominator: acc and sum
/// are relative to exp(max), so the sink adds exp(sink - max), computed
/// against the larger of the two so that neither overflows. A row that saw
/// no key (sum 0) is zeros.
template <class T>
void store_row(T* out,            // [D]
               const float* acc,  // [D]
               float max, float sum, const float* sink, int64_t head_dim) {
  float inv = 0.0f;
  if (sink != nullptr) {
    const float top = std::max(max, *sink);
    const float kept = sum > 0.0f ? std::exp(max - top) : 0.0f;  // acc and sum's factor
    inv = kept / (sum * kept + std::exp(*sink - top));
  } else if (sum > 0.0f) {
    inv = 1.0f / sum;
  }
  for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

/// The sink logit of query head `head`, or null.
template <class Pr>
const float* sink_of(const Pr& pr, int64_t head) noexcept {
  return pr.sinks != nullptr ? pr.sinks + head : nullptr;
}

/// x[j] *= factor[j] for j < n.
inline void multiply_by(float* __restrict x,             // [n]
                        const float* __restrict factor,  // [n]
                        int64_t n) noexcept {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor[j];
}

/// A finished work item's rows: the output (acc / sum), or its split's
/// partial result (max, sum, acc). Row r = ((s - s0) * nh + h) * G + i is
/// query head (h0 + h) * G + i of query s.
template <class T>
void write_rows(const Problem<T>& pr, const Work& w,
                const float* acc_all,  // [rows, D]
                const float* max,      // [rows]
                const float* sum) {    // [rows]
  const int64_t D = pr.g.head_dim;
  const int64_t G = pr.group;
  for (int64_t s = w.s0; s < w.s1; ++s) {
    for (int64_t h = 0; h < w.nh; ++h) {
      for (int64_t i = 0; i < G; ++i) {
        const int64_t r = ((s - w.s0) * w.nh + h) * G + i;
        const float* acc = acc_all + r * D;
        if (w.partial < 0) {
          const int64_t head = (w.h0 + h) * G + i;
          store_row(pr.out + ((w.b * pr.n_queries + s) * pr.n_heads + head) * D, acc, max[r], sum[r],
                    sink_of(pr, head), D);
        } else {
          float* dst = pr.partials + (w.partial + r) * (D + 2);
          dst[0] = max[r];
          dst[1] = sum[r];
          std::copy(acc, acc + D, dst + 2);
        }
      }
    }
  }
}

/// One work item: online softmax over keys [t0, t1), float32 state per row.
/// Row r = ((s - s0) * nh + h) * G + i is query head (h0 + h) * G + i of query s.
/// On a quantized side the rows hold codes: the K scale multiplies the
/// score (q . k = scale * (q . codes)) and the V scale the softmax weight,
/// so no scaled copy of K or V is ever made.
template <class Ops, bool kCopies, class T>
void run_item(const Problem<T>& pr, const Work& w, Scratch& sc) {
  const int64_t D = pr.g.head_dim;
  const int64_t G = pr.group;
  const int64_t rows = (w.s1 - w.s0) * w.nh * G;
  const int64_t first_pos = pr.lengths[w.b] - pr.n_queries;
  float* acc_all = sc.acc.data();
  float* max = sc.max.data();
  float* sum = sc.sum.data();
  std::fill(max, max + rows, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rows, 0.0f);
  std::fill(acc_all, acc_all + rows * D, 0.0f);

  // Two sets of block rows: the block being computed and the next one,
  // located one block ahead so that its vectors can be prefetched (in place
  // only: a copying path's loads are its conversion pass).
  const int64_t half = w.nh * simd::kKeyBlock;
  BlockRows block{sc.k_rows.data(), sc.v_rows.data(), sc.k_scales.data(), sc.v_scales.data()};
  BlockRows next{block.k + half, block.v + half, block.k_scales + half, block.v_scales + half};
  const auto load = [&](const BlockRows& rows, int64_t t0, int64_t n) {
    load_block<Ops, kCopies>(pr, pr.k, w.b, w.h0, w.nh, t0, n, sc.k.data(), rows.k, rows.k_scales);
    load_block<Ops, kCopies>(pr, pr.v, w.b, w.h0, w.nh, t0, n, sc.v.data(), rows.v, rows.v_scales);
  };
  const int64_t k_bytes = D * pr.k.elem_size;
  const int64_t v_bytes = D * pr.v.elem_size;
  // A side read ahead is scored / accumulated a chunk at a time, each
  // chunk after the prefetch of the chunk read after it (cpu/attention/prefetch.hpp);
  // otherwise a whole block at once.
  const bool prefetch_k = !kCopies && prefetches_side(pr.g, pr.k.elem_size);
  const bool prefetch_v = !kCopies && prefetches_side(pr.g, pr.v.elem_size);
  const int64_t k_chunk = prefetch_k ? read_ahead_chunk(D, pr.k.elem_size) : simd::kKeyBlock;
  const int64_t v_chunk = prefetch_v ? read_ahead_chunk(D, pr.v.elem_size) : simd::kKeyBlock;
  if (!kCopies) load(block, w.t0, std::min(simd::kKeyBlock, w.t1 - w.t0));

  // The order of a block's pieces (one head's chunk of tokens): where a
  // token's heads are adjacent (NHD), every head of a chunk before the next
  // chunk, so that the block is read a few KiB of memory at a time, in
  // order; otherwise (HND) one head's chunks in a row, which is already so.
  const bool token_major = pr.g.heads_adjacent();
  const PieceOrder k_order{token_major, w.nh, k_chunk};
  const PieceOrder v_order{token_major, w.nh, v_chunk};
  float* const scores_all = sc.scores.data();  // [nh, kRowsAtOnce, kKeyBlock]
  constexpr int64_t kHeadScores = simd::kRowsAtOnce * simd::kKeyBlock;

  for (int64_t t0 = w.t0; t0 < w.t1; t0 += simd::kKeyBlock) {
    const int64_t n = std::min(simd::kKeyBlock, w.t1 - t0);
    const int64_t n_next = kCopies ? 0 : std::max<int64_t>(0, std::min(simd::kKeyBlock, w.t1 - t0 - simd::kKeyBlock));
    if (kCopies) load(block, t0, n);
    if (n_next > 0) load(next, t0 + simd::kKeyBlock, n_next);
    // The scales of the block loaded after this one (the next, or, reading
    // in place, the one after it).
    const int64_t t_scales = t0 + (kCopies ? 1 : 2) * simd::kKeyBlock;
    prefetch_scales(pr, pr.k, w.b, w.h0, w.nh, t_scales, std::min(simd::kKeyBlock, w.t1 - t_scales));
    prefetch_scales(pr, pr.v, w.b, w.h0, w.nh, t_scales, std::min(simd::kKeyBlock, w.t1 - t_scales));
    for (int64_t s = w.s0; s < w.s1; ++s) {
      // Causal: query s (at position first_pos + s) sees keys <= its position
      // (from its window's start; the new ones as the tree mask says).
      const BlockVisibility seen = block_visibility(pr, w.b, s, first_pos, t0, n);
      const int64_t visible = seen.visible;
      const int64_t skip = seen.skip;
      // The new tokens of the block the tree mask hides from the query: slots
      // [mask_from, visible) are filtered by the mask row.
      const int64_t mask_from = std::max(skip, first_pos - t0);
      if (seen.tree_mask_row != nullptr) {
        bool any = skip < std::min(visible, mask_from);
        for (int64_t j = std::max<int64_t>(mask_from, 0); j < visible && !any; ++j) {
          any = seen.tree_mask_row[t0 + j - first_pos];
        }
        if (!any) continue;
      } else if (visible <= skip) {
        continue;
      }
      // The G query heads of each kv head, up to kRowsAtOnce at a time: each
      // key and value vector is loaded once for all of them.
      for (int64_t i0 = 0; i0 < G; i0 += simd::kRowsAtOnce) {
        // Later queries and query heads of a tile reuse the block from the cache.
        const bool first_pass = s == w.s0 && i0 == 0;
        const int group_rows = static_cast<int>(std::min<int64_t>(simd::kRowsAtOnce, G - i0));
        // Row r0(h) + i is query head (h0 + h) * G + i0 + i of query s.
        const auto r0 = [&](int64_t h) { return ((s - w.s0) * w.nh + h) * G + i0; };
        const auto q_row = [&](int64_t h, int i) {
          return pr.q + ((w.b * pr.n_queries + s) * pr.n_heads + (w.h0 + h) * G + i0 + i) * D;
        };

        k_order.for_each(visible, [&](int64_t h, int64_t j0, int64_t c) {
          const float* q[simd::kRowsAtOnce];
          for (int i = 0; i < group_rows; ++i) q[i] = q_row(h, i);
          const void* const* keys = block.k + h * simd::kKeyBlock;
          if (prefetch_k && first_pass) {
            prefetch_piece_after(k_order, block.k, n, next.k, n_next, h, j0, k_bytes);
          }
          score_block<Ops, kCopies, T>(pr.k.format, q, group_rows, keys + j0, c, D,
                                       scores_all + h * kHeadScores + j0);
        });
        for (int64_t h = 0; h < w.nh; ++h) {
          const float* k_scales = pr.k.quantized() ? block.k_scales + h * simd::kKeyBlock : nullptr;
          const float* v_scales = pr.v.quantized() ? block.v_scales + h * simd::kKeyBlock : nullptr;
          for (int i = 0; i < group_rows; ++i) {
            float* scores = scores_all + h * kHeadScores + i * simd::kKeyBlock;
            if (k_scales != nullptr) multiply_by(scores, k_scales, visible);
            if (pr.softcap > 0.0f) soft_cap(scores + skip, visible - skip, pr.softcap);
            // Keys the tree mask hides: -inf before the maximum, 0 after the
            // exponent (whose vector form gives ~1e-38 for -inf).
            const auto hidden = [&](int64_t j) {
              return seen.tree_mask_row != nullptr && j >= mask_from && !seen.tree_mask_row[t0 + j - first_pos];
            };
            if (seen.tree_mask_row != nullptr) {
              for (int64_t j = std::max<int64_t>(mask_from, 0); j < visible; ++j) {
                if (hidden(j)) scores[j] = -std::numeric_limits<float>::infinity();
              }
            }
            const int64_t r = r0(h) + i;
            float* acc = acc_all + r * D;
            const float block_max = Ops::max(scores + skip, visible - skip);
            if (block_max > max[r]) {
              const float correction = std::exp(max[r] - block_max);  // 0 on the first block
              sum[r] *= correction;
              Ops::scale(acc, correction, D);
              max[r] = block_max;
            }
            sum[r] += Ops::exp_sum(scores + skip, visible - skip, max[r]);
            std::fill(scores, scores + skip, 0.0f);  // before the window: no weight
            if (seen.tree_mask_row != nullptr) {
              for (int64_t j = std::max<int64_t>(mask_from, 0); j < visible; ++j) {
                if (hidden(j)) scores[j] = 0.0f;
              }
            }
            if (v_scales != nullptr) multiply_by(scores, v_scales, visible);  // the weight the codes need
          }
        }
        v_order.for_each(visible, [&](int64_t h, int64_t j0, int64_t c) {
          float* acc[simd::kRowsAtOnce];
          for (int i = 0; i < group_rows; ++i) acc[i] = acc_all + (r0(h) + i) * D;
          const void* const* values = block.v + h * simd::kKeyBlock;
          if (prefetch_v && first_pass) {
            prefetch_piece_after(v_order, block.v, n, next.v, n_next, h, j0, v_bytes);
          }
          accumulate_block<Ops, kCopies, T>(pr.v.format, acc, group_rows, values + j0,
                                            scores_all + h * kHeadScores + j0, c, D);
        });
      }
    }
    std::swap(block, next);
  }

  write_rows(pr, w, acc_all, max, sum);
}

/// Work items [begin, end) on the calling thread, with its scratch.
template <class Ops, bool kCopies, class T>
void run_items_reading(const Problem<T>& pr, const Plan& p, int64_t begin, int64_t end) {
  auto& sc = Scratch::local(p.max_rows, p.heads, pr.g.head_dim, kCopies);
  if constexpr (!kCopies && DecodeStepOf<Ops>::kAvailable) {
    if (takes_decode_path(pr)) {
      for (int64_t i = begin; i < end; ++i) {
        const Work& w = p.work[static_cast<size_t>(i)];
        decode_item<Ops, T>(pr, w, sc.acc.data(), sc.max.data(), sc.sum.data());
        write_rows(pr, w, sc.acc.data(), sc.max.data(), sc.sum.data());
      }
      return;
    }
  }
  for (int64_t i = begin; i < end; ++i) run_item<Ops, kCopies>(pr, p.work[static_cast<size_t>(i)], sc);
}

template <class Ops, class T>
void run_items(const Problem<T>& pr, const Plan& p, int64_t begin, int64_t end) {
  if constexpr (Ops::kReadsPagesDirectly) {
    run_items_reading<Ops, false>(pr, p, begin, end);
  } else if constexpr (std::is_same<T, float>::value) {
    if (reads_in_place<Ops, T>(pr.g, pr.k, pr.v)) return run_items_reading<Ops, false>(pr, p, begin, end);
    run_items_reading<Ops, true>(pr, p, begin, end);
  } else {
    run_items_reading<Ops, true>(pr, p, begin, end);
  }
}

// The vector instantiations, each compiled for its target: `flatten` inlines
// the whole item loop there, so every helper is generated for that target.
#ifdef PAGEDKV_ATTENTION_AVX2
template <class T>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void run_items_avx2(const Problem<T>& pr, const Plan& p,
                                                                   int64_t begin, int64_t end) {
  run_items<simd::Avx2>(pr, p, begin, end);
}
#endif
#ifdef PAGEDKV_ATTENTION_AVX512
template <class T>
PAGEDKV_TARGET_AVX512 __attribute__((flatten)) void run_items_avx512(const Problem<T>& pr, const Plan& p,
                                                                       int64_t begin, int64_t end) {
  run_items<simd::Avx512>(pr, p, begin, end);
}
#endif

/// Runs work items [begin, end) with the instruction set `isa`.
template <class T>
void run_items_with(simd::Isa isa, const Problem<T>& pr, const Plan& p, int64_t begin, int64_t end) {
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case simd::Isa::avx512: return run_items_avx512(pr, p, begin, end);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case simd::Isa::avx2: return run_items_avx2(pr, p, begin, end);
#endif
    default: return run_items<simd::Portable>(pr, p, begin, end);
  }
}

/// Merges the splits of one tile into the output (pr: a Problem, or any
/// problem with the same out / partials / shape fields).
template <class Pr>
void merge_tile(const Pr& pr, const SplitTile& t, float* acc /* [D] */) {
  const int64_t D = pr.g.head_dim;
  const int64_t G = pr.group;
  const int64_t rows = (t.s1 - t.s0) * t.nh * G;
  const int64_t row_floats = D + 2;
  for (int64_t s = t.s0; s < t.s1; ++s) {
    for (int64_t h = 0; h < t.nh; ++h) {
      for (int64_t i = 0; i < G; ++i) {
        const int64_t r = ((s - t.s0) * t.nh + h) * G + i;
        const float* first = pr.partials + (t.partial + r) * row_floats;
        const int64_t split_stride = rows * row_floats;
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < t.n_splits; ++k) max = std::max(max, first[k * split_stride]);
        float sum = 0.0f;
        std::fill(acc, acc + D, 0.0f);
        for (int64_t k = 0; k < t.n_splits; ++k) {
          const float* part = first + k * split_stride;
          if (part[1] == 0.0f) continue;  // a split past this query's position
          const float weight = std::exp(part[0] - max);
          sum += part[1] * weight;
          const float* __restrict src = part + 2;
          for (int64_t d = 0; d < D; ++d) acc[d] += weight * src[d];
        }
        const int64_t head = (t.h0 + h) * G + i;
        store_row(pr.out + ((t.b * pr.n_queries + s) * pr.n_heads + head) * D, acc, max, sum, sink_of(pr, head),
                  D);
      }
    }
  }
}

/// The CPU kernel. Inputs are validated: lengths[b] >= Sq >= 1 and every
/// page holding [0, lengths[b]) is mapped and allocated.
template <class T>
void paged_attention_cpu_impl(const AnyPageTableRef& table,         // [B, max_pages]
                              const std::vector<int64_t>& lengths,  // [B]
                              const float* q,                       // [B, Sq, n_heads, D], contiguous, pre-scaled
                              const T* q_given,                     // [B, Sq, n_heads, D], contiguous, not scaled
                              float scale,                          // q = q_given * scale
                              T* out,                               // [B, Sq, n_heads, D], contiguous
                              const KVSide& k,                      // one layer's keys
                              const KVSide& v,                      // one layer's values
                              const PageGeometry& g, int64_t n_queries, int64_t n_heads, const RawOptions& extra) {
  const int64_t group = n_heads / g.n_heads;
  const Plan p = plan(lengths, n_queries, group, g.n_heads, at::get_num_threads(), extra.window,
                      extra.tree_mask != nullptr);
  std::vector<float> partials(static_cast<size_t>(p.partial_rows * (g.head_dim + 2)));
  const simd::Isa isa = simd::selected_isa();  // decided on the calling thread (ScopedIsa is per thread), as is
  const bool wide_decode_step = isa == simd::Isa::avx512 && takes_wide_decode_step();  // (ScopedDecodeStep)
  const Problem<T> pr{table,     lengths.data(), q,         q_given,       scale,         out,
                      k,         v,              partials.data(), g,     n_queries,     n_heads,
                      group,     wide_decode_step, extra.window, extra.softcap, extra.sinks, extra.tree_mask};
  at::parallel_for(0, static_cast<int64_t>(p.work.size()), 1, [&](int64_t begin, int64_t end) {
    run_items_with(isa, pr, p, begin, end);
  });
  if (p.split.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(p.split.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(g.head_dim));
    for (int64_t i = begin; i < end; ++i) merge_tile(pr, p.split[static_cast<size_t>(i)], acc.data());
  });
}

/// The CPU kernel on validated inputs: q ([B, Sq, n_heads, D], float32,
/// float16 or bfloat16, any strides) scaled by `scale`, the output a new
/// contiguous tensor of q's dtype (options.scale resolved). Both paged_attention (on a view) and the
/// Python package's stateless op end here: one dtype switch over the three
/// instances of paged_attention_cpu_impl, which take the table as an
/// AnyPageTableRef so that they are compiled once per dtype, not per index
/// type. A template, so that only a call instantiates those instances.
template <class Table>
at::Tensor paged_attention_cpu(const Table& typed_table,              // [B, max_pages]
                               const std::vector<int64_t>& lengths,  // [B]
                               const at::Tensor& q, const KVSide& k, const KVSide& v, const PageGeometry& g,
                               const AttentionOptions& options) {
  const AnyPageTableRef table(typed_table);
  const double scale = options.scale;
  const at::Tensor qf = q.to(at::kFloat).mul(scale).contiguous();  // [B, Sq, n_heads, D]
  const at::Tensor q_given = q.contiguous();                         // [B, Sq, n_heads, D]
  const auto scale_f = static_cast<float>(scale);
  // The options' tensors as the kernel reads them: contiguous, on the cpu
  // (checked: sinks float32, tree_mask bool).
  const at::Tensor sinks = options.sinks.defined() ? options.sinks.contiguous() : at::Tensor();
  const at::Tensor tree_mask = options.tree_mask.defined() ? options.tree_mask.contiguous() : at::Tensor();
  RawOptions extra;
  extra.window = options.window;
  extra.softcap = static_cast<float>(options.softcap);
  extra.sinks = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  extra.tree_mask = tree_mask.defined() ? tree_mask.data_ptr<bool>() : nullptr;
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n_queries = q.size(1);
  const int64_t n_heads = q.size(2);
  switch (q.scalar_type()) {
    case at::kHalf:
      paged_attention_cpu_impl(table, lengths, qf.data_ptr<float>(), q_given.data_ptr<c10::Half>(), scale_f,
                               out.data_ptr<c10::Half>(), k, v, g, n_queries, n_heads, extra);
      break;
    case at::kBFloat16:
      paged_attention_cpu_impl(table, lengths, qf.data_ptr<float>(), q_given.data_ptr<c10::BFloat16>(), scale_f,
                               out.data_ptr<c10::BFloat16>(), k, v, g, n_queries, n_heads, extra);
      break;
    default:
      paged_attention_cpu_impl(table, lengths, qf.data_ptr<float>(), q_given.data_ptr<float>(), scale_f,
                               out.data_ptr<float>(), k, v, g, n_queries, n_heads, extra);
      break;
  }
  return out;
}

}  // namespace attention
}  // namespace cpu
}  // namespace pagedkv
