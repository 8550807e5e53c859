// The decode path of the CPU attention kernel: one query per sequence
// (n_queries == 1), native pages on both sides or codes of one format (fp8
// e4m3, int8: each key's scale multiplies its score, each value's its
// softmax weight), head_dim a multiple of 16,
// on an instruction set with a decode step (AVX2: decode_avx2.hpp). A work
// item's keys are read page by page and, in a page, kv head by kv head,
// kDecodeKeys tokens per step: each step scores its keys against the head's
// GQA group, updates the group's softmax and adds the values, straight from
// the page (a head's token vectors are a fixed stride apart in either
// layout, so no per-token row pointers are built). The next page of the
// item is read ahead while this one is worked on, a page ahead and spread
// over its steps. The AVX-512 path takes the AVX2 step too (below), with
// bf16 scores by dot products where the CPU has AVX-512 BF16
// (decode_avx512_bf16.hpp), or, where a 512-bit FMA does twice the work of
// a 256-bit one, the 512-bit step (decode_avx512.hpp). Every other call
// (prefill, K and V in different formats, the portable path) takes the
// general item loop in kernel.hpp.
// bench/NOTES.md, "A decode path for AVX2", has what it gained and why;
// "Quantized pages take the decode step", what codes gained.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "pagedkv/cpu/attention/decode_avx2.hpp"
#include "pagedkv/cpu/attention/decode_avx512.hpp"
#include "pagedkv/cpu/attention/decode_avx512_bf16.hpp"
#include "pagedkv/cpu/attention/plan.hpp"
#include "pagedkv/cpu/attention/prefetch.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/simd/convert.hpp"
#include "pagedkv/simd/isa.hpp"
#include "pagedkv/simd/isa_avx512.hpp"

namespace pagedkv {
namespace cpu {
namespace attention {

/// The decode step of an instruction set's Ops (none: the general loop).
template <class Ops>
struct DecodeStepOf {
  static constexpr bool kAvailable = false;
  /// Whether bf16 steps score by dot products (Avx512Bf16Decode) where the
  /// CPU has them.
  static constexpr bool kDotsBf16 = false;
};

#ifdef PAGEDKV_ATTENTION_AVX2
template <>
struct DecodeStepOf<simd::Avx2> {
  static constexpr bool kAvailable = true;
  static constexpr bool kDotsBf16 = false;
  using Kernel = Avx2Decode;
};
#endif

// AVX-512 machines take the AVX2 step unless a 512-bit FMA does twice the
// work of a 256-bit one there (cpu_has_wide_fmas; then WideDecodeStep):
// where it does not (Zen 4 runs it as two halves), the AVX2 step beat
// both the AVX-512 general loop (bench/NOTES.md, "The decode step on
// AVX-512 machines") and the 512-bit step ("The decode step in 512
// bits").
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
template <>
struct DecodeStepOf<simd::Avx512> {
  static constexpr bool kAvailable = true;
  static constexpr bool kDotsBf16 = true;
  using Kernel = Avx2Decode;
};

/// The AVX-512 path's decode step on cores with two 512-bit FMA pipes:
/// every dtype through 512-bit FMAs (bf16 scores too: there they run as
/// many multiply-adds per cycle as 256-bit dot products).
struct WideDecodeStep {
  static constexpr bool kAvailable = true;
  static constexpr bool kDotsBf16 = false;
  using Kernel = Avx512Decode;
};
#endif

/// Which decode step the AVX-512 path takes (the AVX2 path takes avx2):
/// best, the CPU's (avx512 where cpu_has_wide_fmas), or one forced.
enum class DecodeStep { best, avx2, avx512 };

inline DecodeStep& decode_step_override() noexcept {
  thread_local DecodeStep step = DecodeStep::best;
  return step;
}

/// Sets the AVX-512 path's decode step for the calling thread, for one
/// scope: tests run both steps on any AVX-512 CPU, timings compare them.
class ScopedDecodeStep {
 public:
  explicit ScopedDecodeStep(DecodeStep step) : previous_(decode_step_override()) { decode_step_override() = step; }
  ~ScopedDecodeStep() { decode_step_override() = previous_; }
  ScopedDecodeStep(const ScopedDecodeStep&) = delete;
  ScopedDecodeStep& operator=(const ScopedDecodeStep&) = delete;

 private:
  DecodeStep previous_;
};

/// Whether the calling thread's AVX-512 path takes the 512-bit step
/// (WideDecodeStep): its ScopedDecodeStep, else cpu_has_wide_fmas().
inline bool takes_wide_decode_step() {
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
  switch (decode_step_override()) {
    case DecodeStep::avx2: return false;
    case DecodeStep::avx512: return simd::cpu_has_avx512();
    default: return simd::cpu_has_wide_fmas();
  }
#else
  return false;
#endif
}

/// The instruction set of the decode step that path `isa` takes on this
/// CPU and thread ("avx512"; "avx2", or "avx2, bf16 scores by avx512_bf16"
/// where bf16 steps score by dot products), or nullptr where its decode
/// takes the general loop: on AVX-512 machines the kernel's path
/// (selected_isa) and its decode step may differ, and bench/report prints
/// both.
inline const char* decode_step_isa_name(simd::Isa isa) {
  switch (isa) {
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
    case simd::Isa::avx512:
      if (takes_wide_decode_step()) return WideDecodeStep::Kernel::kIsaName;
      return simd::cpu_has_avx512_bf16() ? "avx2, bf16 scores by avx512_bf16" : DecodeStepOf<simd::Avx512>::Kernel::kIsaName;
#endif
#ifdef PAGEDKV_ATTENTION_AVX2
    case simd::Isa::avx2: return DecodeStepOf<simd::Avx2>::Kernel::kIsaName;
#endif
    default: return nullptr;
  }
}

/// Runs Step's step for R = rows (1..4).
template <class Step, class T>
void run_decode_step(int64_t rows, const typename Step::template Operands<T>& st) {
  switch (rows) {
    case 4: Step::template run<4>(st); break;
    case 3: Step::template run<3>(st); break;
    case 2: Step::template run<2>(st); break;
    default: Step::template run<1>(st); break;
  }
}

/// Whether problem `pr` (a Problem<T>, kernel.hpp) takes the decode path,
/// on an Ops whose DecodeStepOf is available: native pages, or both sides
/// quantized in one format; no tree mask (a decode's one-token mask is the
/// general loop's). A window needs nothing here (the plan's items start at
/// it), soft-cap is the step's, sinks are kernel.hpp's write_rows.
template <class Pr>
bool takes_decode_path(const Pr& pr) noexcept {
  return pr.n_queries == 1 && pr.k.format == pr.v.format && pr.g.head_dim % 16 == 0 && pr.tree_mask == nullptr;
}

/// One work item on the decode path with pages of E: T (native) or a code
/// type (E4m3Code, int8_t), by StepOf's step (a DecodeStepOf, or
/// WideDecodeStep); decode_item's.
template <class StepOf, class E, class T, class Pr>
void decode_item_of(const Pr& pr, const Work& w,
                    float* acc_all,  // [nh * G, D]
                    float* max,      // [nh * G]
                    float* sum) {    // [nh * G]
  using Step = typename StepOf::Kernel;
  const PageGeometry& g = pr.g;
  const int64_t D = g.head_dim;
  const int64_t G = pr.group;
  const int64_t rows = w.nh * G;
  std::fill(max, max + rows, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rows, 0.0f);
  std::fill(acc_all, acc_all + rows * D, 0.0f);

  const char* k_pages = pr.k.pages;  // [n_pages, page_elems] of E
  const char* v_pages = pr.v.pages;  // [n_pages, page_elems] of E
  constexpr auto kElem = static_cast<int64_t>(sizeof(E));
  const int64_t page_bytes = g.page_elems * kElem;
  // Codes: one scale per (token, head) vector, in the pages' layout order.
  const int64_t page_scales = g.page_elems / D;
  const int64_t token_scales = g.token_stride / D;
  const int64_t head_scales = g.head_stride / D;
  const int64_t q_offset = ((w.b * pr.n_queries + w.s0) * pr.n_heads + w.h0 * G) * D;
  const float* q_item = pr.q + q_offset;            // [nh * G, D]
  const T* q_item_given = pr.q_given + q_offset;    // [nh * G, D]
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
  constexpr bool kMayDot = StepOf::kDotsBf16 && std::is_same<E, c10::BFloat16>::value;
  [[maybe_unused]] const bool dots = kMayDot && simd::cpu_has_avx512_bf16();
#endif
  // A token's vectors of every head of the item lie in one run (NHD pages,
  // all heads): read ahead in memory order, 1 / nh of it per head.
  const bool whole_tokens = g.heads_adjacent() && w.nh == g.n_heads;
  // Causal: the query (at position lengths[b] - 1) sees every key before it.
  const int64_t t_end = std::min(w.t1, pr.lengths[w.b] - pr.n_queries + w.s0 + 1);

  for (int64_t t = w.t0; t < t_end;) {
    const int64_t column = t / g.page_size;
    const int64_t in_page = t % g.page_size;
    const int64_t run = std::min(t_end - t, g.page_size - in_page);
    const int64_t page = pr.table(w.b, column);
    // The item's next page, read ahead: its first tokens, as many as this run.
    // On every CPU and side, unlike the general loop (prefetches_side leaves
    // runs of 2 KiB and more to Intel's hardware prefetchers): the step waits
    // for memory without it (bench/NOTES.md, "An FMA-only pass; where the
    // decode step's time goes on Zen 4"), and on issue 35's Sapphire Rapids
    // guest the general loop was slower per byte on HND pages, not read ahead,
    // than on NHD pages, read ahead. The step is unmeasured on Intel:
    // bench/NOTES.md, "Decode steps read ahead on Intel too".
    const int64_t n_next = std::min(run, t_end - (t + run));
    const int64_t next_page = n_next > 0 ? pr.table(w.b, column + 1) : 0;
    if constexpr (kIsCode<E>) {
      if (n_next > 0) {  // the next page's scales, one float a vector: read ahead whole
        prefetch_bytes(pr.k.scales + next_page * page_scales, page_scales * static_cast<int64_t>(sizeof(float)));
        prefetch_bytes(pr.v.scales + next_page * page_scales, page_scales * static_cast<int64_t>(sizeof(float)));
      }
    }
    for (int64_t j0 = 0; j0 < run; j0 += kDecodeKeys) {
      const int64_t n = std::min(kDecodeKeys, run - j0);
      const int64_t n_ahead = std::max<int64_t>(0, std::min(n, n_next - j0));
      for (int64_t h = 0; h < w.nh; ++h) {
        const int64_t offset = g.offset(in_page + j0, w.h0 + h) * kElem;  // bytes into the page
        // Codes: the scale of the step's first key and value (one index for both sides).
        const int64_t first_scale =
            kIsCode<E> ? page * page_scales + (in_page + j0) * token_scales + (w.h0 + h) * head_scales : 0;
        // What this head's step reads ahead of the next page, per side.
        const auto ahead = [&](const char* pages) {
          const char* next = pages + next_page * page_bytes;
          if (n_ahead == 0) return LinesAhead();
          if (whole_tokens) {
            const int64_t bytes = n_ahead * g.token_stride * kElem;
            const int64_t first = bytes * h / w.nh;
            return LinesAhead(next + g.offset(j0, 0) * kElem + first, bytes * (h + 1) / w.nh - first, 1, 0);
          }
          return LinesAhead(next + g.offset(j0, w.h0 + h) * kElem, D * kElem, n_ahead, g.token_stride * kElem);
        };
        const LinesAhead ahead_keys = ahead(k_pages);
        const LinesAhead ahead_values = ahead(v_pages);
        // The step's operands for rows r0.. of the item (the head's first
        // rows read ahead for all of them).
        const auto operands = [&](int64_t r0, bool first) {
          return typename Step::template Operands<E>{
              q_item + r0 * D,
              reinterpret_cast<const E*>(k_pages + page * page_bytes + offset),
              reinterpret_cast<const E*>(v_pages + page * page_bytes + offset),
              g.token_stride,
              n,
              D,
              max + r0,
              sum + r0,
              acc_all + r0 * D,
              first ? ahead_keys : LinesAhead(),
              first ? ahead_values : LinesAhead(),
              kIsCode<E> ? pr.k.scales + first_scale : nullptr,
              kIsCode<E> ? pr.v.scales + first_scale : nullptr,
              token_scales,
              // bf16 dot products only, where E is T.
              std::is_same<E, T>::value ? reinterpret_cast<const E*>(q_item_given + r0 * D) : nullptr,
              pr.scale,
              pr.softcap};
        };
        if constexpr (std::is_same<E, simd::E4m3Code>::value) {
          if (G > Step::kRows && D <= Step::kMaxWidenedDim) {  // the head's codes widened once for all G rows
            Step::run_widened_head(operands(h * G, true), G);
            continue;
          }
        }
        for (int64_t i0 = 0; i0 < G; i0 += Step::kRows) {
          const typename Step::template Operands<E> st = operands(h * G + i0, i0 == 0);
          const int64_t rows_now = std::min<int64_t>(Step::kRows, G - i0);
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
          if constexpr (kMayDot) {
            if (dots) {
              run_decode_step<Avx512Bf16Decode, E>(rows_now, st);
              continue;
            }
          }
#endif
          run_decode_step<Step, E>(rows_now, st);
        }
      }
    }
    t += run;
  }
  // Steps on bf16 pages add the values in a permuted lane order (ValueLanes).
  if constexpr (Step::template kPermutesAccumulators<E>) Step::template restore_accumulators<E>(acc_all, rows * D);
}

/// decode_item by StepOf's step.
template <class StepOf, class T, class Pr>
void decode_item_by(const Pr& pr, const Work& w,
                    float* acc_all,  // [nh * G, D]
                    float* max,      // [nh * G]
                    float* sum) {    // [nh * G]
  switch (pr.k.format) {
    case KVFormat::fp8_e4m3: return decode_item_of<StepOf, simd::E4m3Code, T>(pr, w, acc_all, max, sum);
    case KVFormat::int8: return decode_item_of<StepOf, int8_t, T>(pr, w, acc_all, max, sum);
    default: return decode_item_of<StepOf, T, T>(pr, w, acc_all, max, sum);
  }
}

/// One work item on the decode path: acc, max and sum of its rows (row
/// h * G + i is query head (h0 + h) * G + i) over keys [t0, t1), for
/// kernel.hpp to write out. T: the cache's dtype; its pages hold T, or
/// codes of the format both sides share (takes_decode_path). On the
/// AVX-512 path, the 512-bit step where pr.wide_decode_step (chosen on the
/// calling thread: takes_wide_decode_step).
template <class Ops, class T, class Pr>
void decode_item(const Pr& pr, const Work& w,
                 float* acc_all,  // [nh * G, D]
                 float* max,      // [nh * G]
                 float* sum) {    // [nh * G]
#if defined(PAGEDKV_ATTENTION_AVX512) && defined(PAGEDKV_ATTENTION_AVX2)
  if constexpr (std::is_same<Ops, simd::Avx512>::value) {
    if (pr.wide_decode_step) return decode_item_by<WideDecodeStep, T>(pr, w, acc_all, max, sum);
  }
#endif
  decode_item_by<DecodeStepOf<Ops>, T>(pr, w, acc_all, max, sum);
}

}  // namespace attention
}  // namespace cpu
}  // namespace pagedkv
