// Paged attention: decode and chunked prefill (causal, GQA/MQA) that read
// keys and values straight from the pages through the page table.
//
// CPU: a hand-written kernel. Keys and values are read block by block
// (kKeyBlock tokens, converted to float32 once per block and shared by every
// query row of the kv head), with an online softmax (running max and sum) in
// float32. Work items are (sequence, query tile, key split, kv head); long
// contexts are split across threads (flash-decoding) and the partial results
// merged afterwards, so a batch of one still uses every core.
// Other devices: a device-agnostic ATen path (gather, then a masked softmax).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "pagedkv/cache_view.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/kernels.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/paged_cache.hpp"

namespace pagedkv {
namespace attention_kernels {

/// Keys (and values) read and converted at once: one block is shared by
/// every query row of a work item.
constexpr int64_t kKeyBlock = 32;
/// Query rows (queries x heads of one kv-head group) a work item handles.
constexpr int64_t kRowsPerTile = 32;
/// A context is split across threads only into pieces of at least this many tokens.
constexpr int64_t kMinSplitTokens = 256;

// ---- conversions to float32 (loops over these auto-vectorise) ----

inline float float_from_bits(uint32_t bits) noexcept {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint32_t bits_from_float(float f) noexcept {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

/// IEEE half -> float, bit-identical to c10::Half's conversion but written
/// without a branch, so the compiler vectorises loops over it (c10's select
/// is not if-converted by g++ 12 at -O3).
inline float half_to_float(uint16_t h) noexcept {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  // Normal numbers: re-bias the exponent (Inf/NaN stay Inf/NaN).
  const uint32_t normalized =
      bits_from_float(float_from_bits((two_w >> 4) + (UINT32_C(0xE0) << 23)) * float_from_bits(UINT32_C(15) << 23));
  // Zeros and subnormals: mantissa * 2^-24 via a magic bias.
  const uint32_t denormalized = bits_from_float(float_from_bits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f);
  const uint32_t is_denormal = UINT32_C(0) - static_cast<uint32_t>(two_w < (UINT32_C(1) << 27));
  return float_from_bits(sign | (denormalized & is_denormal) | (normalized & ~is_denormal));
}

inline void to_float(const c10::Half* src,  // [n]
                     float* __restrict dst,  // [n]
                     int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i].x);
}
inline void to_float(const c10::BFloat16* src,  // [n]
                     float* __restrict dst,      // [n]
                     int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_from_bits(static_cast<uint32_t>(src[i].x) << 16);
}

// ---- the arithmetic over head_dim ----

/// sum_d a[d] * b[d], with 16 partial sums so that it vectorises without
/// -ffast-math (the order of the additions is fixed, hence deterministic).
inline float dot(const float* __restrict a,  // [n]
                 const float* __restrict b,  // [n]
                 int64_t n) noexcept {
  constexpr int64_t kLanes = 16;
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t i = 0; i < kLanes; ++i) part[i] += a[d + i] * b[d + i];
  for (int64_t i = 0; d + i < n; ++i) part[i] += a[d + i] * b[d + i];
  float sum = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) sum += part[i];
  return sum;
}

/// acc += sum_j p[j] * v[j] over n keys, four keys per pass over acc.
inline void accumulate(float* __restrict acc,     // [D]
                       const float* const* v,     // n x [D]
                       const float* p,            // [n]
                       int64_t n, int64_t head_dim) noexcept {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
    const float* __restrict v0 = v[j];
    const float* __restrict v1 = v[j + 1];
    const float* __restrict v2 = v[j + 2];
    const float* __restrict v3 = v[j + 3];
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
  }
  for (; j < n; ++j) {
    const float pj = p[j];
    const float* __restrict vj = v[j];
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * vj[d];
  }
}

inline void scale_row(float* __restrict row, float factor, int64_t n) noexcept {
  for (int64_t d = 0; d < n; ++d) row[d] *= factor;
}

// ---- work decomposition ----

/// Queries [s0, s1) of sequence b against keys [t0, t1), for every kv head.
struct Work {
  int64_t b;
  int64_t s0, s1;
  int64_t t0, t1;
  int64_t split;     ///< index of [t0, t1) among the tile's splits
  int64_t n_splits;  ///< splits of the tile's keys; 1: the item writes the output itself
  int64_t partial;   ///< first scratch row of the tile (when n_splits > 1)
};

/// A tile whose keys were split: its partial results are merged afterwards.
struct SplitTile {
  int64_t b;
  int64_t s0, s1;
  int64_t n_splits;
  int64_t partial;  ///< first scratch row: [n_kv_heads, n_splits, rows]
};

struct Plan {
  std::vector<Work> work;            ///< each runs once per kv head
  std::vector<SplitTile> split;      ///< tiles to merge
  int64_t partial_rows = 0;          ///< scratch rows of (max, sum, acc[D])
  int64_t max_rows = 0;              ///< query rows of the largest tile
};

/// Tiles the queries and splits each tile's keys so that the work items
/// (x n_kv_heads) keep `n_threads` threads busy.
inline Plan plan(const std::vector<int64_t>& lengths,  // [B], each >= n_queries >= 1
                 int64_t n_queries, int64_t group, int64_t n_kv_heads, int64_t n_threads) {
  const int64_t tile = std::min(n_queries, std::max<int64_t>(1, kRowsPerTile / group));
  int64_t total = 0;  // keys read, summed over tiles and kv heads
  for (const int64_t length : lengths)
    for (int64_t s0 = 0; s0 < n_queries; s0 += tile) total += (length - n_queries + std::min(s0 + tile, n_queries));
  total *= n_kv_heads;
  const int64_t target_items = n_threads <= 1 ? 1 : 4 * n_threads;
  int64_t chunk = std::max(kMinSplitTokens, (total + target_items - 1) / target_items);
  chunk = (chunk + kKeyBlock - 1) / kKeyBlock * kKeyBlock;

  Plan p;
  p.max_rows = tile * group;
  for (int64_t b = 0; b < static_cast<int64_t>(lengths.size()); ++b) {
    const int64_t first_pos = lengths[static_cast<size_t>(b)] - n_queries;  // position of query 0
    for (int64_t s0 = 0; s0 < n_queries; s0 += tile) {
      const int64_t s1 = std::min(s0 + tile, n_queries);
      const int64_t keys = first_pos + s1;  // the last query sees [0, keys)
      const int64_t n_splits = (keys + chunk - 1) / chunk;
      const int64_t partial = n_splits > 1 ? p.partial_rows : -1;
      if (n_splits > 1) {
        p.split.push_back({b, s0, s1, n_splits, partial});
        p.partial_rows += n_kv_heads * n_splits * (s1 - s0) * group;
      }
      for (int64_t i = 0; i < n_splits; ++i) {
        p.work.push_back({b, s0, s1, i * chunk, std::min((i + 1) * chunk, keys), i, n_splits, partial});
      }
    }
  }
  return p;
}

/// Raw operands of one call.
template <class T, class Index>
struct Problem {
  PageTableRef<Index> table;      // [B, max_pages]
  const int64_t* lengths;         // [B]
  const float* q;                 // [B, Sq, n_heads, D], contiguous, pre-scaled
  T* out;                         // [B, Sq, n_heads, D], contiguous
  const T* k_pages;               // [n_pages, <page>], one layer
  const T* v_pages;               // [n_pages, <page>], one layer
  float* partials;                // [partial_rows, 2 + D]: (max, sum, acc)
  PageGeometry g;
  int64_t n_queries;              // Sq
  int64_t n_heads;                // query heads
  int64_t group;                  // n_heads / n_kv_heads
};

/// Per-thread buffers of one work item.
struct Scratch {
  Scratch(int64_t max_rows, int64_t head_dim)
      : k(static_cast<size_t>(kKeyBlock * head_dim)),
        v(static_cast<size_t>(kKeyBlock * head_dim)),
        acc(static_cast<size_t>(max_rows * head_dim)),
        max(static_cast<size_t>(max_rows)),
        sum(static_cast<size_t>(max_rows)) {}
  std::vector<float> k;    // [kKeyBlock, D] converted keys (unused for float caches)
  std::vector<float> v;    // [kKeyBlock, D] converted values
  std::vector<float> acc;  // [rows, D]
  std::vector<float> max;  // [rows]
  std::vector<float> sum;  // [rows]
  const float* k_rows[kKeyBlock];
  const float* v_rows[kKeyBlock];
  float scores[kKeyBlock];
};

/// Points rows[j] at the float32 head vector of token t0 + j (converting
/// into `buffer` unless the cache already stores float32).
template <class T, class Index>
void load_block(const Problem<T, Index>& pr, const T* pages, int64_t b, int64_t kv_head, int64_t t0, int64_t n,
                float* buffer,  // [kKeyBlock, D]
                const float** rows) {
  const PageGeometry& g = pr.g;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = t0 + j;
    const int64_t page = pr.table(b, t / g.page_size);
    const T* src = pages + page * g.page_elems + g.offset(t % g.page_size, kv_head);
    if constexpr (std::is_same<T, float>::value) {
      rows[j] = src;
    } else {
      to_float(src, buffer + j * g.head_dim, g.head_dim);
      rows[j] = buffer + j * g.head_dim;
    }
  }
}

/// Writes one finished row: out = acc / sum.
template <class T>
void store_row(T* out,             // [D]
               const float* acc,   // [D]
               float sum, int64_t head_dim) {
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

/// One work item for one kv head: online softmax over keys [t0, t1).
template <class T, class Index>
void run_item(const Problem<T, Index>& pr, const Work& w, int64_t kv_head, Scratch& sc) {
  const int64_t D = pr.g.head_dim;
  const int64_t G = pr.group;
  const int64_t rows = (w.s1 - w.s0) * G;
  const int64_t first_pos = pr.lengths[w.b] - pr.n_queries;
  std::fill(sc.max.begin(), sc.max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(sc.sum.begin(), sc.sum.begin() + rows, 0.0f);
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);

  for (int64_t t0 = w.t0; t0 < w.t1; t0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, w.t1 - t0);
    load_block(pr, pr.k_pages, w.b, kv_head, t0, n, sc.k.data(), sc.k_rows);
    load_block(pr, pr.v_pages, w.b, kv_head, t0, n, sc.v.data(), sc.v_rows);
    for (int64_t s = w.s0; s < w.s1; ++s) {
      // Causal: query s (at position first_pos + s) sees keys <= its position.
      const int64_t visible = std::min(n, first_pos + s + 1 - t0);
      if (visible <= 0) continue;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t r = (s - w.s0) * G + h;
        const float* q = pr.q + ((w.b * pr.n_queries + s) * pr.n_heads + kv_head * G + h) * D;
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          sc.scores[j] = dot(q, sc.k_rows[j], D);
          block_max = std::max(block_max, sc.scores[j]);
        }
        float* acc = sc.acc.data() + r * D;
        const float new_max = std::max(sc.max[static_cast<size_t>(r)], block_max);
        if (new_max > sc.max[static_cast<size_t>(r)]) {
          const float correction = std::exp(sc.max[static_cast<size_t>(r)] - new_max);  // 0 on the first block
          sc.sum[static_cast<size_t>(r)] *= correction;
          scale_row(acc, correction, D);
          sc.max[static_cast<size_t>(r)] = new_max;
        }
        float block_sum = 0.0f;
        for (int64_t j = 0; j < visible; ++j) {
          sc.scores[j] = std::exp(sc.scores[j] - new_max);
          block_sum += sc.scores[j];
        }
        sc.sum[static_cast<size_t>(r)] += block_sum;
        accumulate(acc, sc.v_rows, sc.scores, visible, D);
      }
    }
  }

  for (int64_t s = w.s0; s < w.s1; ++s) {
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = (s - w.s0) * G + h;
      const float* acc = sc.acc.data() + r * D;
      if (w.n_splits == 1) {
        store_row(pr.out + ((w.b * pr.n_queries + s) * pr.n_heads + kv_head * G + h) * D, acc,
                  sc.sum[static_cast<size_t>(r)], D);
      } else {
        float* dst = pr.partials + (w.partial + (kv_head * w.n_splits + w.split) * rows + r) * (D + 2);
        dst[0] = sc.max[static_cast<size_t>(r)];
        dst[1] = sc.sum[static_cast<size_t>(r)];
        std::copy(acc, acc + D, dst + 2);
      }
    }
  }
}

/// Merges the splits of one tile for one kv head into the output.
template <class T, class Index>
void merge_tile(const Problem<T, Index>& pr, const SplitTile& t, int64_t kv_head, float* acc /* [D] */) {
  const int64_t D = pr.g.head_dim;
  const int64_t G = pr.group;
  const int64_t rows = (t.s1 - t.s0) * G;
  const int64_t row_floats = D + 2;
  for (int64_t s = t.s0; s < t.s1; ++s) {
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = (s - t.s0) * G + h;
      const float* first = pr.partials + (t.partial + kv_head * t.n_splits * rows + r) * row_floats;
      const int64_t split_stride = rows * row_floats;
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < t.n_splits; ++i) max = std::max(max, first[i * split_stride]);
      float sum = 0.0f;
      std::fill(acc, acc + D, 0.0f);
      for (int64_t i = 0; i < t.n_splits; ++i) {
        const float* part = first + i * split_stride;
        if (part[1] == 0.0f) continue;  // a split past this query's position
        const float weight = std::exp(part[0] - max);
        sum += part[1] * weight;
        const float* __restrict src = part + 2;
        for (int64_t d = 0; d < D; ++d) acc[d] += weight * src[d];
      }
      store_row(pr.out + ((t.b * pr.n_queries + s) * pr.n_heads + kv_head * G + h) * D, acc, sum, D);
    }
  }
}

/// The CPU kernel. Inputs are validated: lengths[b] >= Sq >= 1 and every
/// page holding [0, lengths[b]) is mapped.
template <class T, class Index>
void paged_attention_cpu_impl(const PageTableRef<Index>& table,     // [B, max_pages]
                              const std::vector<int64_t>& lengths,  // [B]
                              const float* q,                       // [B, Sq, n_heads, D], contiguous, pre-scaled
                              T* out,                               // [B, Sq, n_heads, D], contiguous
                              const T* k_pages,                     // [n_pages, <page>], one layer
                              const T* v_pages,                     // [n_pages, <page>], one layer
                              const PageGeometry& g, int64_t n_queries, int64_t n_heads) {
  const int64_t group = n_heads / g.n_heads;
  const Plan p = plan(lengths, n_queries, group, g.n_heads, at::get_num_threads());
  std::vector<float> partials(static_cast<size_t>(p.partial_rows * (g.head_dim + 2)));
  const Problem<T, Index> pr{table, lengths.data(), q,         out,     k_pages, v_pages, partials.data(),
                             g,     n_queries,      n_heads,   group};
  const int64_t n_items = static_cast<int64_t>(p.work.size()) * g.n_heads;
  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(p.max_rows, g.head_dim);
    for (int64_t i = begin; i < end; ++i) run_item(pr, p.work[static_cast<size_t>(i / g.n_heads)], i % g.n_heads, sc);
  });
  if (p.split.empty()) return;
  const int64_t n_merges = static_cast<int64_t>(p.split.size()) * g.n_heads;
  at::parallel_for(0, n_merges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(g.head_dim));
    for (int64_t i = begin; i < end; ++i)
      merge_tile(pr, p.split[static_cast<size_t>(i / g.n_heads)], i % g.n_heads, acc.data());
  });
}

/// Device-agnostic path: gather [B, T, H, D], then a causal masked softmax
/// in float32 with ATen ops. Same results as the CPU kernel.
template <class Index>
at::Tensor paged_attention_generic(const PageTableRef<Index>& table,     // [B, max_pages]
                                   const std::vector<int64_t>& lengths,  // [B]
                                   const at::Tensor& q,                  // [B, Sq, n_heads, D]
                                   const at::Tensor& k_layer,            // [n_pages, <page>]
                                   const at::Tensor& v_layer,            // [n_pages, <page>]
                                   const PageGeometry& g, double scale) {
  const int64_t batch = q.size(0), n_queries = q.size(1), n_heads = q.size(2), D = q.size(3);
  const int64_t group = n_heads / g.n_heads;
  const int64_t n_tokens = *std::max_element(lengths.begin(), lengths.end());
  const auto kv = kernels::gather_generic(table, lengths, n_tokens, k_layer, v_layer, g);  // [B, T, H, D]
  const at::Tensor k = kv.first.to(at::kFloat).permute({0, 2, 3, 1});                     // [B, H, D, T]
  const at::Tensor v = kv.second.to(at::kFloat).permute({0, 2, 1, 3});                    // [B, H, T, D]
  // Query rows (s, g) of each kv head h: [B, H, Sq * G, D].
  const at::Tensor qf = q.to(at::kFloat).reshape({batch, n_queries, g.n_heads, group, D}).permute({0, 2, 1, 3, 4})
                            .reshape({batch, g.n_heads, n_queries * group, D});
  at::Tensor scores = at::matmul(qf, k).mul_(scale).view({batch, g.n_heads, n_queries, group, n_tokens});
  // Query s of sequence b sits at lengths[b] - Sq + s and sees positions <= it.
  const at::Tensor positions = at::arange(n_tokens, q.options().dtype(at::kLong));               // [T]
  const at::Tensor last = kernels::host_index(lengths, q.device()).view({batch, 1}) - n_queries +
                          at::arange(n_queries, q.options().dtype(at::kLong)).view({1, n_queries});  // [B, Sq]
  const at::Tensor hidden = positions.view({1, 1, n_tokens}).gt(last.unsqueeze(2));              // [B, Sq, T]
  scores.masked_fill_(hidden.view({batch, 1, n_queries, 1, n_tokens}), -std::numeric_limits<double>::infinity());
  const at::Tensor probs = at::softmax(scores, -1).view({batch, g.n_heads, n_queries * group, n_tokens});
  const at::Tensor out = at::matmul(probs, v);  // [B, H, Sq * G, D]
  return out.view({batch, g.n_heads, n_queries, group, D})
      .permute({0, 2, 1, 3, 4})
      .reshape({batch, n_queries, n_heads, D})
      .to(q.scalar_type())
      .contiguous();
}

}  // namespace attention_kernels

/// Causal paged attention over a view bound with per-sequence lengths that
/// already count the Sq new tokens (written before the call). Query s of
/// sequence b sits at position lengths[b] - Sq + s and attends to positions
/// <= its own; query head h reads kv head h / (n_heads / n_kv_heads).
/// scale <= 0 means 1/sqrt(D). Returns [B, Sq, n_heads, D] in q's dtype.
template <class Layout>
at::Tensor paged_attention(const CacheView<Layout>& view, int64_t layer,
                           const at::Tensor& q,  // [B, Sq, n_heads, D], the cache's dtype, any strides
                           double scale = 0.0) {
  const checks::Caller caller{"paged_attention", Layout::name, nullptr};
  const PagedCache<Layout>& cache = view.cache();
  const PageGeometry& g = cache.geometry();
  const at::ScalarType dtype = cache.k_cache().scalar_type();
  checks::layer(caller, layer, cache.n_layers());
  checks::attention_dtype(caller, dtype);
  checks::page_table(caller, view.page_table(), cache.device());
  const int64_t batch = view.page_table().size(0);
  checks::attention_query(caller, q, batch, g, dtype, cache.device());
  checks::attention_scale(caller, scale);
  checks::bound_with_lengths(caller, view.lengths());
  const int64_t n_queries = q.size(1);
  const std::vector<int64_t> lengths = checks::per_sequence(caller, "lengths", view.lengths(), batch, cache.device());
  checks::attention_lengths(caller, lengths, n_queries);
  const at::Tensor host_table = view.page_table().device().is_cpu() ? view.page_table() : view.page_table().cpu();
  return visit_page_table(host_table, [&](const auto& table) {
    for (int64_t row = 0; row < table.rows; ++row) {
      checks::mapped_prefix(caller, table, row, lengths[static_cast<size_t>(row)], g.page_size, cache.pool());
    }
    // Validated: from here on nothing throws.
    if (batch == 0 || n_queries == 0) return at::empty(q.sizes(), q.options());
    const double s = scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(g.head_dim));
    const at::Tensor k_layer = cache.k_cache().select(0, layer);
    const at::Tensor v_layer = cache.v_cache().select(0, layer);
    if (!kernels::use_cpu_kernels(cache.device())) {
      return attention_kernels::paged_attention_generic(table, lengths, q, k_layer, v_layer, g, s);
    }
    const at::Tensor qf = q.to(at::kFloat).mul(s).contiguous();  // [B, Sq, n_heads, D]
    at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
    const int64_t n_heads = q.size(2);
    switch (dtype) {
      case at::kHalf:
        attention_kernels::paged_attention_cpu_impl(table, lengths, qf.data_ptr<float>(), out.data_ptr<c10::Half>(),
                                                    k_layer.data_ptr<c10::Half>(), v_layer.data_ptr<c10::Half>(), g,
                                                    n_queries, n_heads);
        break;
      case at::kBFloat16:
        attention_kernels::paged_attention_cpu_impl(
            table, lengths, qf.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), k_layer.data_ptr<c10::BFloat16>(),
            v_layer.data_ptr<c10::BFloat16>(), g, n_queries, n_heads);
        break;
      default:
        attention_kernels::paged_attention_cpu_impl(table, lengths, qf.data_ptr<float>(), out.data_ptr<float>(),
                                                    k_layer.data_ptr<float>(), v_layer.data_ptr<float>(), g,
                                                    n_queries, n_heads);
        break;
    }
    return out;
  });
}

}  // namespace pagedkv
