// The CPU paged-attention kernel on quantized pages: keys and values are
// read as codes plus one float32 scale per (token, head), straight from the
// pages. Per work item, each head's block of kKeyBlock code rows is decoded
// (unscaled) into an L1 tile of floats that the Isa's scores / accumulate
// kernels share across the query heads of the kv head; the K scale is
// folded into the score (q . k = scale * (q . codes)) and the V scale into
// the softmax weight, so no scaled or whole-context copy of K or V is made. Work items,
// the online softmax and the split merge are the native kernel's
// (plan.hpp, cpu_kernel.hpp); exp and rescaling use the selected Isa's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "pagedkv/attention/constants.hpp"
#include "pagedkv/attention/cpu_kernel.hpp"
#include "pagedkv/attention/isa.hpp"
#include "pagedkv/attention/plan.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/quant_codecs.hpp"

namespace pagedkv {

template <class Layout>
class PagedCache;

namespace attention_kernels {

/// One side (K or V) of one layer.
struct QuantSide {
  KVFormat format;
  const char* pages;     // [n_pages, <page>]: codes, or native elements of the cache's dtype
  int64_t elem_size;     // bytes per stored element
  const float* scales;   // [n_pages, page_size * n_heads]; null for a native side
};

template <class T, class Index>
struct QuantProblem {
  PageTableRef<Index> table;  // [B, max_pages]
  const int64_t* lengths;     // [B]
  const float* q;             // [B, Sq, n_heads, D], contiguous, pre-scaled
  T* out;                     // [B, Sq, n_heads, D], contiguous
  QuantSide k, v;
  float* partials;  // [partial_rows, 2 + D]
  PageGeometry g;
  int64_t n_queries;
  int64_t n_heads;
  int64_t group;
};

/// Per-thread buffers, kept between calls.
struct QuantScratch {
  std::vector<const char*> k_rows, v_rows;  // [heads, kKeyBlock]
  std::vector<float> k_scales, v_scales;    // [heads, kKeyBlock]
  std::vector<float> acc, max, sum;         // [rows, D], [rows], [rows]
  std::vector<float> scores;                // [G, kKeyBlock]
  std::vector<float> k_tile, v_tile;        // [kKeyBlock, D]: one head's block, decoded, unscaled
  std::vector<const float*> tile_rows;      // [kKeyBlock]: rows of a tile

  static QuantScratch& local(int64_t max_rows, int64_t heads, int64_t group, int64_t head_dim) {
    thread_local QuantScratch sc;
    const auto grow = [](auto& buffer, int64_t size) {
      if (buffer.size() < static_cast<size_t>(size)) buffer.resize(static_cast<size_t>(size));
    };
    grow(sc.k_rows, heads * kKeyBlock);
    grow(sc.v_rows, heads * kKeyBlock);
    grow(sc.k_scales, heads * kKeyBlock);
    grow(sc.v_scales, heads * kKeyBlock);
    grow(sc.acc, max_rows * head_dim);
    grow(sc.max, max_rows);
    grow(sc.sum, max_rows);
    grow(sc.scores, group * kKeyBlock);
    grow(sc.k_tile, kKeyBlock * head_dim);
    grow(sc.v_tile, kKeyBlock * head_dim);
    grow(sc.tile_rows, kKeyBlock);
    return sc;
  }
};

/// Decodes one stored row to float32, unscaled (Ops: the instruction set;
/// AVX-512 has the codecs' intrinsics, g++ does not vectorise the scalar ones).
template <class Ops, class T>
inline void decode_unscaled(KVFormat format, const char* src, int64_t n, float* __restrict out) {  // out: [n]
#ifdef PAGEDKV_ATTENTION_AVX512
  if constexpr (std::is_same<Ops, Avx512>::value) {
    if (format == KVFormat::fp8_e4m3) {
      return quant::decode_avx512<KVFormat::fp8_e4m3>(reinterpret_cast<const uint8_t*>(src), n, 1.0f, out);
    }
    if (format == KVFormat::int8) {
      return quant::decode_avx512<KVFormat::int8>(reinterpret_cast<const int8_t*>(src), n, 1.0f, out);
    }
  }
#endif
  switch (format) {
    case KVFormat::fp8_e4m3: {
      const auto* c = reinterpret_cast<const uint8_t*>(src);
      for (int64_t d = 0; d < n; ++d) out[d] = quant::decode_e4m3(c[d]);
      return;
    }
    case KVFormat::int8: {
      const auto* c = reinterpret_cast<const int8_t*>(src);
      for (int64_t d = 0; d < n; ++d) out[d] = static_cast<float>(c[d]);
      return;
    }
    default: {
      const T* x = reinterpret_cast<const T*>(src);
      for (int64_t d = 0; d < n; ++d) out[d] = static_cast<float>(x[d]);
      return;
    }
  }
}

/// Points rows[h * kKeyBlock + j] at the stored vector of kv head h0 + h,
/// token t0 + j, and scales[...] at its scale (1 for a native side).
template <class T, class Index>
void load_quant_block(const QuantProblem<T, Index>& pr, const QuantSide& side, int64_t b, int64_t h0, int64_t nh,
                      int64_t t0, int64_t n, const char** rows, float* scales) {
  const PageGeometry& g = pr.g;
  for (int64_t t = t0; t < t0 + n; ++t) {
    const int64_t page = pr.table(b, t / g.page_size);
    const int64_t in_page = t % g.page_size;
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t offset = page * g.page_elems + g.offset(in_page, h0 + h);
      rows[h * kKeyBlock + (t - t0)] = side.pages + offset * side.elem_size;
      scales[h * kKeyBlock + (t - t0)] = side.scales == nullptr ? 1.0f : side.scales[offset / g.head_dim];
    }
  }
}

/// One work item: online softmax over keys [t0, t1), as run_item.
template <class Ops, class T, class Index>
void run_quant_item(const QuantProblem<T, Index>& pr, const Work& w, QuantScratch& sc) {
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

  for (int64_t t0 = w.t0; t0 < w.t1; t0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, w.t1 - t0);
    load_quant_block(pr, pr.k, w.b, w.h0, w.nh, t0, n, sc.k_rows.data(), sc.k_scales.data());
    load_quant_block(pr, pr.v, w.b, w.h0, w.nh, t0, n, sc.v_rows.data(), sc.v_scales.data());
    for (int64_t s = w.s0; s < w.s1; ++s) {
      const int64_t visible = std::min(n, first_pos + s + 1 - t0);
      if (visible <= 0) continue;
      for (int64_t h = 0; h < w.nh; ++h) {
        const int64_t r0 = ((s - w.s0) * w.nh + h) * G;
        const float* q0 = pr.q + ((w.b * pr.n_queries + s) * pr.n_heads + (w.h0 + h) * G) * D;
        const char* const* keys = sc.k_rows.data() + h * kKeyBlock;
        const char* const* values = sc.v_rows.data() + h * kKeyBlock;
        const float* k_scales = sc.k_scales.data() + h * kKeyBlock;
        const float* v_scales = sc.v_scales.data() + h * kKeyBlock;
        // The block's keys of head h decoded once (unscaled) into an L1 tile
        // of kKeyBlock x D floats, scored by the Isa's kernel for kRowsAtOnce
        // query heads at a time; the K scale multiplies each score.
        for (int64_t j = 0; j < visible; ++j) {
          decode_unscaled<Ops, T>(pr.k.format, keys[j], D, sc.k_tile.data() + j * D);
          sc.tile_rows[static_cast<size_t>(j)] = sc.k_tile.data() + j * D;
        }
        for (int64_t i0 = 0; i0 < G; i0 += kRowsAtOnce) {
          const int n_rows = static_cast<int>(std::min<int64_t>(kRowsAtOnce, G - i0));
          const float* q[kRowsAtOnce];
          for (int i = 0; i < n_rows; ++i) q[i] = q0 + (i0 + i) * D;
          Ops::scores(q, n_rows, sc.tile_rows.data(), visible, D, sc.scores.data() + i0 * kKeyBlock);
        }
        for (int64_t i = 0; i < G; ++i) {
          float* scores = sc.scores.data() + i * kKeyBlock;
          for (int64_t j = 0; j < visible; ++j) scores[j] *= k_scales[j];
          const int64_t r = r0 + i;
          const float block_max = *std::max_element(scores, scores + visible);
          if (block_max > max[r]) {
            const float correction = std::exp(max[r] - block_max);  // 0 on the first block
            sum[r] *= correction;
            Ops::scale(acc_all + r * D, correction, D);
            max[r] = block_max;
          }
          sum[r] += Ops::exp_sum(scores, visible, max[r]);
          // The softmax weight times the V scale: what the unscaled values need.
          for (int64_t j = 0; j < visible; ++j) scores[j] *= v_scales[j];
        }
        for (int64_t j = 0; j < visible; ++j) {
          decode_unscaled<Ops, T>(pr.v.format, values[j], D, sc.v_tile.data() + j * D);
          sc.tile_rows[static_cast<size_t>(j)] = sc.v_tile.data() + j * D;
        }
        for (int64_t i0 = 0; i0 < G; i0 += kRowsAtOnce) {
          const int n_rows = static_cast<int>(std::min<int64_t>(kRowsAtOnce, G - i0));
          float* acc[kRowsAtOnce];
          for (int i = 0; i < n_rows; ++i) acc[i] = acc_all + (r0 + i0 + i) * D;
          Ops::accumulate(acc, n_rows, sc.tile_rows.data(), sc.scores.data() + i0 * kKeyBlock, visible, D);
        }
      }
    }
  }

  for (int64_t s = w.s0; s < w.s1; ++s) {
    for (int64_t h = 0; h < w.nh; ++h) {
      for (int64_t i = 0; i < G; ++i) {
        const int64_t r = ((s - w.s0) * w.nh + h) * G + i;
        const float* acc = acc_all + r * D;
        if (w.partial < 0) {
          store_row(pr.out + ((w.b * pr.n_queries + s) * pr.n_heads + (w.h0 + h) * G + i) * D, acc, sum[r], D);
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

template <class Ops, class T, class Index>
void run_quant_items(const QuantProblem<T, Index>& pr, const Plan& p, int64_t begin, int64_t end) {
  auto& sc = QuantScratch::local(p.max_rows, p.heads, pr.group, pr.g.head_dim);
  for (int64_t i = begin; i < end; ++i) run_quant_item<Ops>(pr, p.work[static_cast<size_t>(i)], sc);
}

#ifdef PAGEDKV_ATTENTION_AVX2
template <class T, class Index>
PAGEDKV_TARGET_AVX2 __attribute__((flatten)) void run_quant_items_avx2(const QuantProblem<T, Index>& pr,
                                                                         const Plan& p, int64_t begin, int64_t end) {
  run_quant_items<Avx2>(pr, p, begin, end);
}
#endif
#ifdef PAGEDKV_ATTENTION_AVX512
template <class T, class Index>
PAGEDKV_TARGET_AVX512 __attribute__((flatten)) void run_quant_items_avx512(const QuantProblem<T, Index>& pr,
                                                                             const Plan& p, int64_t begin,
                                                                             int64_t end) {
  run_quant_items<Avx512>(pr, p, begin, end);
}
#endif

template <class T, class Index>
void run_quant_items_with(Isa isa, const QuantProblem<T, Index>& pr, const Plan& p, int64_t begin, int64_t end) {
  switch (isa) {
#ifdef PAGEDKV_ATTENTION_AVX512
    case Isa::avx512: return run_quant_items_avx512(pr, p, begin, end);
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case Isa::avx2: return run_quant_items_avx2(pr, p, begin, end);
#endif
    default: return run_quant_items<Portable>(pr, p, begin, end);
  }
}

template <class T, class Index>
void paged_attention_quant_impl(const PageTableRef<Index>& table, const std::vector<int64_t>& lengths,
                                const float* q,  // [B, Sq, n_heads, D], contiguous, pre-scaled
                                T* out,          // [B, Sq, n_heads, D], contiguous
                                const QuantSide& k, const QuantSide& v, const PageGeometry& g, int64_t n_queries,
                                int64_t n_heads) {
  const int64_t group = n_heads / g.n_heads;
  const Plan p = plan(lengths, n_queries, group, g.n_heads, at::get_num_threads());
  std::vector<float> partials(static_cast<size_t>(p.partial_rows * (g.head_dim + 2)));
  const QuantProblem<T, Index> pr{table, lengths.data(), q, out, k, v, partials.data(), g, n_queries, n_heads, group};
  const Isa isa = selected_isa();
  at::parallel_for(0, static_cast<int64_t>(p.work.size()), 1, [&](int64_t begin, int64_t end) {
    run_quant_items_with(isa, pr, p, begin, end);
  });
  if (p.split.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(p.split.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(g.head_dim));
    for (int64_t i = begin; i < end; ++i) merge_tile(pr, p.split[static_cast<size_t>(i)], acc.data());
  });
}

/// paged_attention on a CPU cache with a quantized side (inputs validated).
template <class Layout, class Index>
at::Tensor paged_attention_quantized_cpu(const PagedCache<Layout>& cache, int64_t layer,
                                         const PageTableRef<Index>& table, const std::vector<int64_t>& lengths,
                                         const at::Tensor& q,  // [B, Sq, n_heads, D]
                                         double scale) {
  const auto side = [&](const at::Tensor& pages, const at::Tensor& scales, KVFormat format) {
    const at::Tensor l = pages.select(0, layer);
    return QuantSide{format, static_cast<const char*>(l.data_ptr()), static_cast<int64_t>(l.element_size()),
                     scales.defined() ? scales.select(0, layer).data_ptr<float>() : nullptr};
  };
  const QuantSide k = side(cache.k_cache(), cache.k_scales(), cache.quant().k);
  const QuantSide v = side(cache.v_cache(), cache.v_scales(), cache.quant().v);
  const at::Tensor qf = q.to(at::kFloat).mul(scale).contiguous();  // [B, Sq, n_heads, D]
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n_queries = q.size(1);
  const int64_t n_heads = q.size(2);
  switch (cache.dtype()) {
    case at::kHalf:
      paged_attention_quant_impl(table, lengths, qf.data_ptr<float>(), out.data_ptr<c10::Half>(), k, v,
                                 cache.geometry(), n_queries, n_heads);
      break;
    case at::kBFloat16:
      paged_attention_quant_impl(table, lengths, qf.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), k, v,
                                 cache.geometry(), n_queries, n_heads);
      break;
    default:
      paged_attention_quant_impl(table, lengths, qf.data_ptr<float>(), out.data_ptr<float>(), k, v,
                                 cache.geometry(), n_queries, n_heads);
      break;
  }
  return out;
}

}  // namespace attention_kernels
}  // namespace pagedkv
