// Every argument check of the public API, in one place. Each throws
// c10::Error naming the function, the argument, what was expected and what
// was given; none of them changes anything.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <sstream>
#include <utility>
#include <vector>

#include "pagedkv/attention_options.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_pool.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace checks {

/// The public function a check runs for; printed as pagedkv::Class<Layout>::function
/// (or pagedkv::function<Layout> for a free function: cls = its name, function = nullptr).
struct Caller {
  const char* cls;
  const char* layout;    // nullptr for non-templates
  const char* function;  // nullptr for free functions
};

inline std::ostream& operator<<(std::ostream& os, const Caller& c) {
  os << "pagedkv::" << c.cls;
  if (c.layout != nullptr) os << '<' << c.layout << '>';
  if (c.function != nullptr) os << "::" << c.function;
  return os;
}

inline void layer(const Caller& caller, int64_t layer, int64_t n_layers) {
  TORCH_CHECK_INDEX(layer >= 0 && layer < n_layers, caller, ": argument 'layer' expected in [0, ", n_layers, "), got ",
                    layer);
}

inline void positive(const Caller& caller, const char* arg, int64_t value) {
  TORCH_CHECK(value >= 1, caller, ": argument '", arg, "' expected >= 1, got ", value);
}

inline void non_negative(const Caller& caller, const char* arg, int64_t value) {
  TORCH_CHECK(value >= 0, caller, ": argument '", arg, "' expected >= 0, got ", value);
}

/// The side ("keys" or "values") of `cache` stored as fp8 e4m3 codes.
inline void fp8_side(const Caller& caller, const char* side, KVFormat format) {
  TORCH_CHECK(format == KVFormat::fp8_e4m3, caller, ": argument 'cache' expected ", side, " stored as ",
              format_name(KVFormat::fp8_e4m3), ", got ", format_name(format));
}

inline bool is_index_type(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

/// The cache's storage, the product of `dims` (each >= 1: n_layers, n_pages,
/// page_size, n_kv_heads, head_dim) elements of `elem_size` bytes, has a byte
/// size that int64 holds, so no size or offset computed from them overflows.
inline void storage_fits(const Caller& caller, std::initializer_list<int64_t> dims, int64_t elem_size) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t bytes = elem_size;
  bool fits = true;
  for (const int64_t d : dims) {
    fits = fits && d <= kMax / bytes;
    if (fits) bytes *= d;
  }
  if (fits) return;
  std::ostringstream product;
  for (const int64_t d : dims) product << d << " x ";
  TORCH_CHECK(false, caller, ": expected n_layers x n_pages x page_size x n_kv_heads x head_dim x element size <= ",
              kMax, " bytes, got ", product.str(), elem_size);
}

/// Page tables and per-sequence tensors may live on the CPU or the cache's device.
inline void host_or_cache_device(const Caller& caller, const char* arg, const at::Tensor& t,
                                 const at::Device& cache_device) {
  TORCH_CHECK(t.device().is_cpu() || t.device() == cache_device, caller, ": argument '", arg,
              "' expected on cpu or ", cache_device, ", got ", t.device());
}

/// page_table: [B, max_pages], int32 or int64.
inline void page_table(const Caller& caller, const at::Tensor& table, const at::Device& cache_device) {
  TORCH_CHECK(table.defined(), caller, ": argument 'page_table' expected a tensor, got an undefined one");
  TORCH_CHECK(table.dim() == 2, caller, ": argument 'page_table' expected 2-D [batch, max_pages], got ", table.dim(),
              "-D with shape ", table.sizes());
  TORCH_CHECK(is_index_type(table.scalar_type()), caller,
              ": argument 'page_table' expected dtype int32 or int64, got ", table.scalar_type());
  host_or_cache_device(caller, "page_table", table, cache_device);
}

/// A per-sequence integer tensor [B] (start_pos, lengths), copied to the
/// host; every value must be >= 0.
inline std::vector<int64_t> per_sequence(const Caller& caller, const char* arg, const at::Tensor& t, int64_t batch,
                                         const at::Device& cache_device) {
  TORCH_CHECK(t.defined(), caller, ": argument '", arg, "' expected a tensor, got an undefined one");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, caller, ": argument '", arg, "' expected shape [", batch,
              "] (one per page_table row), got ", t.sizes());
  TORCH_CHECK(is_index_type(t.scalar_type()), caller, ": argument '", arg, "' expected dtype int32 or int64, got ",
              t.scalar_type());
  host_or_cache_device(caller, arg, t, cache_device);
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  std::vector<int64_t> values(data, data + batch);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(values[static_cast<size_t>(b)] >= 0, caller, ": argument '", arg, "' expected every value >= 0, got ",
                arg, "[", b, "] = ", values[static_cast<size_t>(b)]);
  }
  return values;
}

/// k or v: [B, S, n_heads, head_dim], the cache's dtype and device.
inline void key_or_value(const Caller& caller, const char* arg, const at::Tensor& t, int64_t batch,
                         const PageGeometry& g, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK(t.defined(), caller, ": argument '", arg, "' expected a tensor, got an undefined one");
  TORCH_CHECK(t.dim() == 4, caller, ": argument '", arg, "' expected 4-D [batch, seq, n_kv_heads, head_dim], got ",
              t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK(t.size(0) == batch, caller, ": argument '", arg, "' expected batch ", batch,
              " (page_table rows) at dim 0, got shape ", t.sizes());
  TORCH_CHECK(t.size(2) == g.n_heads, caller, ": argument '", arg, "' expected n_kv_heads ", g.n_heads,
              " at dim 2, got shape ", t.sizes());
  TORCH_CHECK(t.size(3) == g.head_dim, caller, ": argument '", arg, "' expected head_dim ", g.head_dim,
              " at dim 3, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, caller, ": argument '", arg, "' expected dtype ", dtype,
              " (the cache's), got ", t.scalar_type());
  TORCH_CHECK(t.device() == device, caller, ": argument '", arg, "' expected on ", device,
              " (the cache's device), got ", t.device());
}

/// k, v: both valid, and of equal shapes.
inline void key_values(const Caller& caller, const at::Tensor& k, const at::Tensor& v, int64_t batch,
                       const PageGeometry& g, at::ScalarType dtype, const at::Device& device) {
  key_or_value(caller, "k", k, batch, g, dtype, device);
  key_or_value(caller, "v", v, batch, g, dtype, device);
  TORCH_CHECK(k.sizes() == v.sizes(), caller, ": arguments 'k' and 'v' expected equal shapes, got ", k.sizes(),
              " and ", v.sizes());
}

/// The page at (row, col) exists and is allocated: writes need this for
/// every page they touch, and reads for every mapped page they read.
template <class Index>
void page_allocated(const Caller& caller, const PageTableRef<Index>& table, int64_t row, int64_t col,
                    const PagePool& pool) {
  const int64_t page = table(row, col);
  TORCH_CHECK_INDEX(page >= 0 && page < pool.n_pages(), caller, ": argument 'page_table' expected a page id in [0, ",
                    pool.n_pages(), ") at page_table[", row, "][", col, "], got ", page,
                    page == kUnmappedPage ? " (unmapped)" : "");
  TORCH_CHECK(pool.is_allocated(page), caller, ": argument 'page_table' expected an allocated page at page_table[", row,
              "][", col, "], got page ", page, " which is free (use after free)");
}

/// Tokens [start, start + n) of row `row` fit in the table and sit on
/// allocated pages.
template <class Index>
void write_range(const Caller& caller, const PageTableRef<Index>& table, int64_t row, int64_t start, int64_t n,
                 int64_t page_size, const PagePool& pool) {
  if (n == 0) return;
  const int64_t capacity = table.cols * page_size;
  // start (validated >= 0) may be close to INT64_MAX: the last position,
  // start + n - 1 < 2^64, is computed unsigned.
  TORCH_CHECK_INDEX(start <= capacity - n, caller, ": write of ", n, " tokens at start_pos ", start, " in row ", row,
                    " expected to end within the page table's ", table.cols, " columns (", capacity,
                    " tokens), got last position ", static_cast<uint64_t>(start) + static_cast<uint64_t>(n - 1),
                    " (a write past the last column)");
  const PageDivisor pages(page_size);
  const int64_t last_col = pages.column(start + n - 1);
  for (int64_t col = pages.column(start); col <= last_col; ++col) page_allocated(caller, table, row, col, pool);
}

/// Number of leading columns that map a page in at least one row (the
/// reference's gather stops at the first column with none).
template <class Index>
int64_t mapped_columns(const PageTableRef<Index>& table) {
  for (int64_t col = 0; col < table.cols; ++col) {
    bool any = false;
    for (int64_t row = 0; row < table.rows && !any; ++row) any = table(row, col) >= 0;
    if (!any) return col;
  }
  return table.cols;
}

/// Every entry of the first `n_cols` columns is -1 or an allocated page.
template <class Index>
void readable_columns(const Caller& caller, const PageTableRef<Index>& table, int64_t n_cols, const PagePool& pool) {
  for (int64_t row = 0; row < table.rows; ++row) {
    for (int64_t col = 0; col < n_cols; ++col) {
      if (table(row, col) != kUnmappedPage) page_allocated(caller, table, row, col, pool);
    }
  }
}

/// Row `row` maps every page that holds positions [0, length).
template <class Index>
void mapped_prefix(const Caller& caller, const PageTableRef<Index>& table, int64_t row, int64_t length,
                   int64_t page_size, const PagePool& pool) {
  TORCH_CHECK_INDEX(length <= table.cols * page_size, caller, ": argument 'lengths' expected lengths[", row,
                    "] <= ", table.cols * page_size, " (the tokens page_table row ", row, " can map), got ",
                    length);
  for (int64_t col = 0; col * page_size < length; ++col) {
    const int64_t page = table(row, col);
    TORCH_CHECK_INDEX(page != kUnmappedPage, caller, ": argument 'lengths' expected lengths[", row, "] <= ",
                      col * page_size, " (the tokens page_table row ", row, " maps before its first -1 at column ",
                      col, "), got ", length);
    page_allocated(caller, table, row, col, pool);
  }
}

/// Row `row` maps every page that holds positions [first, length): the
/// keys an attention call with a window reads (first = the earliest
/// query's window start; 0 without a window: mapped_prefix). Columns
/// before first's page are not read, and may be -1.
template <class Index>
void mapped_range(const Caller& caller, const PageTableRef<Index>& table, int64_t row, int64_t first, int64_t length,
                  int64_t page_size, const PagePool& pool) {
  if (first <= 0) {
    mapped_prefix(caller, table, row, length, page_size, pool);
    return;
  }
  TORCH_CHECK_INDEX(length <= table.cols * page_size, caller, ": argument 'lengths' expected lengths[", row,
                    "] <= ", table.cols * page_size, " (the tokens page_table row ", row, " can map), got ",
                    length);
  for (int64_t col = first / page_size; col * page_size < length; ++col) {
    TORCH_CHECK_INDEX(table(row, col) != kUnmappedPage, caller, ": argument 'page_table' expected a page at page_table[",
                      row, "][", col, "] (it holds positions a query's window sees, ", first, " to lengths[", row,
                      "] - 1 = ", length - 1, "), got -1");
    page_allocated(caller, table, row, col, pool);
  }
}

/// Row `row` maps every page from its first mapped column through the one
/// that holds position length - 1: the leading -1 columns a windowed
/// SequenceTable leaves (pages wholly older than every query's window) are
/// allowed, a -1 after a mapped column or at the last token is not. A row
/// that starts with a page is checked (and reported) as by mapped_prefix.
template <class Index>
void mapped_window(const Caller& caller, const PageTableRef<Index>& table, int64_t row, int64_t length,
                   int64_t page_size, const PagePool& pool) {
  if (length == 0 || table.cols == 0 || table(row, 0) != kUnmappedPage) {
    mapped_prefix(caller, table, row, length, page_size, pool);
    return;
  }
  TORCH_CHECK_INDEX(length <= table.cols * page_size, caller, ": argument 'lengths' expected lengths[", row,
                    "] <= ", table.cols * page_size, " (the tokens page_table row ", row, " can map), got ",
                    length);
  const int64_t last = (length - 1) / page_size;
  int64_t first = 0;
  while (first < last && table(row, first) == kUnmappedPage) ++first;
  for (int64_t col = first; col <= last; ++col) {
    TORCH_CHECK_INDEX(table(row, col) != kUnmappedPage, caller, ": argument 'page_table' expected a page at page_table[",
                      row, "][", col, "] (a row may start with -1 columns, then maps every page through the one of ",
                      "its last token, position lengths[", row, "] - 1 = ", length - 1, "), got -1");
    page_allocated(caller, table, row, col, pool);
  }
}

/// truncate's n_tokens: in [0, length] of sequence `seq`.
inline void kept_tokens(const Caller& caller, int64_t seq, int64_t n_tokens, int64_t length) {
  TORCH_CHECK(n_tokens >= 0 && n_tokens <= length, caller, ": argument 'n_tokens' expected in [0, ", length,
              "] (the length of sequence ", seq, "), got ", n_tokens);
}

/// A sequence of a table with window `window` that released its tokens
/// before `first_held` keeps n_tokens only if the window of the next query,
/// [n_tokens - window + 1, n_tokens], starts at or after first_held: a
/// window cannot grow back.
inline void window_reachable(const Caller& caller, int64_t seq, int64_t n_tokens, int64_t window,
                             int64_t first_held) {
  if (first_held == 0) return;
  TORCH_CHECK(n_tokens - first_held >= window - 1, caller, ": argument 'n_tokens' expected >= ",
              first_held + window - 1, " (the table's window is ", window, " tokens and sequence ", seq,
              " released its tokens before position ", first_held,
              ": the window of a shorter sequence would need them again), got ", n_tokens);
}

/// A table a PrefixCache attaches to keeps every token (window() = 0): a
/// windowed table releases the early pages that a prefix match shares.
inline void unwindowed_table(const Caller& caller, int64_t window) {
  TORCH_CHECK(window == 0, caller, ": argument 'seqs' expected a table without a window (window() = 0), got one "
              "with window ", window, " (a windowed table frees the early pages a prefix cache would share)");
}

/// A view bound into a cache's per-shape device buffers
/// (BindBuffers::per_shape) finds them as its bind left them: no later
/// bind of the shape wrote into them (generations equal; 0 and 0 for a
/// view with buffers of its own).
inline void bound_buffers_current(const Caller& caller, uint64_t buffers_generation, uint64_t view_generation) {
  TORCH_CHECK(buffers_generation == view_generation, caller,
              ": expected a view whose device buffers hold its own bind, got one whose buffers a later bind of the "
              "same shape reused (BindBuffers::per_shape, ",
              buffers_generation - view_generation, " bind(s) later): use the latest view");
}

/// The pages of row `row`, columns [first_col, end_col), are those the view
/// bound when the pool stood at alloc_epoch `epoch`: none freed, or freed
/// and reallocated, since (entries of -1 and ids out of range are left to
/// the other checks).
template <class Index>
void bound_pages_current(const Caller& caller, const PageTableRef<Index>& table, int64_t row, int64_t first_col,
                         int64_t end_col, const PagePool& pool, uint64_t epoch) {
  end_col = std::min(end_col, table.cols);
  for (int64_t col = std::max<int64_t>(first_col, 0); col < end_col; ++col) {
    const int64_t page = table(row, col);
    if (page < 0 || page >= pool.n_pages()) continue;
    TORCH_CHECK(!pool.reallocated_since(page, epoch), caller, ": expected the view's pages as they were at bind, got ",
                "page_table[", row, "][", col, "] = ", page,
                pool.is_allocated(page) ? " which was freed and reallocated" : " which was freed",
                " since (a stale view: bind again)");
  }
}

/// Not inside a CUDA graph capture (`capturing`: cuda::capturing of the
/// cache's device), where bind's uploads cannot run.
inline void not_capturing(const Caller& caller, bool capturing) {
  TORCH_CHECK(!capturing, caller,
              ": expected to be called outside a CUDA graph capture (it copies host memory to the device, or the "
              "device's to the host): bind before capturing, and pass start_pos on the cpu");
}

/// A write's start positions, inside a CUDA graph capture, are the bound
/// lengths' tail (the captured kernel reads the bound lengths on the device).
inline void tail_in_capture(const Caller& caller, bool capturing, int64_t n_tokens) {
  TORCH_CHECK(!capturing, caller, ": argument 'start_pos' expected to equal the bound lengths - ", n_tokens,
              " inside a CUDA graph capture (the captured write reads the bound lengths on the device), got other "
              "positions");
}

/// A view bound for the CUDA kernels may be used: no later bind reused its
/// per-shape buffers, and (when the pool freed pages since its bind) every
/// page the call touches, columns [first, end) = columns(row) of each row,
/// is the page of its bind. O(1) when no page was freed since.
template <class Index, class ColumnRange>
void bound_view_current(const Caller& caller, const cuda::BoundTables& b, const PageTableRef<Index>& table,
                        const PagePool& pool, const ColumnRange& columns) {
  bound_buffers_current(caller, b.buffers != nullptr ? b.buffers->generation : 0, b.generation);
  if (pool.free_epoch() == b.free_epoch) return;
  for (int64_t row = 0; row < table.rows; ++row) {
    const std::pair<int64_t, int64_t> cols = columns(row);
    bound_pages_current(caller, table, row, cols.first, cols.second, pool, b.alloc_epoch);
  }
}

/// Attention reads the cache as float32, float16 or bfloat16.
inline void attention_dtype(const Caller& caller, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, caller,
              ": expected a cache of dtype float32, float16 or bfloat16, got ", dtype);
}

/// q for attention: [B, Sq, n_heads, head_dim], the cache's dtype and
/// device, n_heads a positive multiple of the cache's n_kv_heads.
inline void attention_query(const Caller& caller, const at::Tensor& q, int64_t batch, const PageGeometry& g,
                            at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK(q.defined(), caller, ": argument 'q' expected a tensor, got an undefined one");
  TORCH_CHECK(q.dim() == 4, caller, ": argument 'q' expected 4-D [batch, seq, n_heads, head_dim], got ", q.dim(),
              "-D with shape ", q.sizes());
  TORCH_CHECK(q.size(0) == batch, caller, ": argument 'q' expected batch ", batch,
              " (page_table rows) at dim 0, got shape ", q.sizes());
  TORCH_CHECK(q.size(2) >= g.n_heads && q.size(2) % g.n_heads == 0, caller,
              ": argument 'q' expected n_heads at dim 2 to be a positive multiple of the cache's n_kv_heads ",
              g.n_heads, " (GQA/MQA), got shape ", q.sizes());
  TORCH_CHECK(q.size(3) == g.head_dim, caller, ": argument 'q' expected head_dim ", g.head_dim,
              " (the cache's) at dim 3, got shape ", q.sizes());
  TORCH_CHECK(q.scalar_type() == dtype, caller, ": argument 'q' expected dtype ", dtype, " (the cache's), got ",
              q.scalar_type());
  TORCH_CHECK(q.device() == device, caller, ": argument 'q' expected on ", device, " (the cache's device), got ",
              q.device());
}

/// scale: finite (<= 0 selects 1/sqrt(head_dim)).
inline void attention_scale(const Caller& caller, double scale) {
  TORCH_CHECK(std::isfinite(scale), caller,
              ": argument 'scale' expected a finite value (<= 0 for 1/sqrt(head_dim)), got ", scale);
}

/// The options beyond the scale: window >= 0; softcap >= 0 and finite;
/// sinks undefined or [n_heads] float32 on `device`; tree_mask undefined or
/// [batch, n_queries, n_queries] bool on `device`.
inline void attention_options(const Caller& caller, const AttentionOptions& options, int64_t batch,
                              int64_t n_queries, int64_t n_heads, const at::Device& device) {
  attention_scale(caller, options.scale);
  TORCH_CHECK(options.window >= 0, caller, ": argument 'options.window' expected >= 0 (0: no window), got ",
              options.window);
  TORCH_CHECK(std::isfinite(options.softcap) && options.softcap >= 0.0, caller,
              ": argument 'options.softcap' expected a finite value >= 0 (0: no soft-cap), got ", options.softcap);
  if (options.sinks.defined()) {
    const at::Tensor& sinks = options.sinks;
    TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == n_heads, caller,
                ": argument 'options.sinks' expected shape [", n_heads, "] (one logit per query head), got ",
                sinks.sizes());
    TORCH_CHECK(sinks.scalar_type() == at::kFloat, caller,
                ": argument 'options.sinks' expected dtype float32, got ", sinks.scalar_type());
    TORCH_CHECK(sinks.device() == device, caller, ": argument 'options.sinks' expected on ", device,
                " (the cache's device), got ", sinks.device());
  }
  if (options.tree_mask.defined()) {
    const at::Tensor& mask = options.tree_mask;
    TORCH_CHECK(mask.dim() == 3 && mask.size(0) == batch && mask.size(1) == n_queries && mask.size(2) == n_queries,
                caller, ": argument 'options.tree_mask' expected shape [", batch, ", ", n_queries, ", ", n_queries,
                "] ([batch, Sq, Sq]), got ", mask.sizes());
    TORCH_CHECK(mask.scalar_type() == at::kBool, caller,
                ": argument 'options.tree_mask' expected dtype bool, got ", mask.scalar_type());
    TORCH_CHECK(mask.device() == device, caller, ": argument 'options.tree_mask' expected on ", device,
                " (the cache's device), got ", mask.device());
  }
}

/// The first position any query of a row of length `length` reads: the
/// earliest query's (at length - n_queries) window start; 0 without one.
inline int64_t first_visible(int64_t length, int64_t n_queries, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, length - n_queries - window + 1) : 0;
}

/// The view carries per-sequence lengths (bind(page_table, lengths)).
inline void bound_with_lengths(const Caller& caller, const at::Tensor& lengths) {
  TORCH_CHECK(lengths.defined(), caller,
              ": argument 'view' expected a view bound with per-sequence lengths "
              "(PagedCache::bind(page_table, lengths)), got one bound with a total_len");
}

/// Every sequence's length counts its n_queries new tokens, and a query
/// needs at least one position to attend to.
inline void attention_lengths(const Caller& caller, const std::vector<int64_t>& lengths, int64_t n_queries) {
  for (size_t b = 0; b < lengths.size(); ++b) {
    TORCH_CHECK(n_queries == 0 || lengths[b] >= 1, caller, ": argument 'lengths' expected lengths[", b,
                "] >= 1 (with a length of 0 a query has nothing to attend to), got 0");
    TORCH_CHECK(lengths[b] >= n_queries, caller, ": argument 'lengths' expected lengths[", b, "] >= ", n_queries,
                " (the lengths include the Sq = ", n_queries, " query tokens, written before the call), got ",
                lengths[b]);
  }
}

/// A prompt's token ids: [n_tokens], int32 or int64, on the cpu.
inline void token_ids(const Caller& caller, const at::Tensor& tokens) {
  TORCH_CHECK(tokens.defined(), caller, ": argument 'tokens' expected a tensor, got an undefined one");
  TORCH_CHECK(tokens.dim() == 1, caller, ": argument 'tokens' expected 1-D [n_tokens], got ", tokens.dim(),
              "-D with shape ", tokens.sizes());
  TORCH_CHECK(is_index_type(tokens.scalar_type()), caller, ": argument 'tokens' expected dtype int32 or int64, got ",
              tokens.scalar_type());
  TORCH_CHECK(tokens.device().is_cpu(), caller, ": argument 'tokens' expected on cpu, got ", tokens.device());
}

/// A 1-D int32/int64 list of page ids on the cpu or one of `devices`,
/// copied to the host (values not yet range-checked).
inline std::vector<int64_t> page_list(const Caller& caller, const char* arg, const at::Tensor& t,
                                      const at::Device& device_a, const at::Device& device_b) {
  TORCH_CHECK(t.defined(), caller, ": argument '", arg, "' expected a tensor, got an undefined one");
  TORCH_CHECK(t.dim() == 1, caller, ": argument '", arg, "' expected 1-D [n_pages_to_copy], got ", t.dim(),
              "-D with shape ", t.sizes());
  TORCH_CHECK(is_index_type(t.scalar_type()), caller, ": argument '", arg,
              "' expected dtype int32 or int64, got ", t.scalar_type());
  if (device_a == device_b) {
    host_or_cache_device(caller, arg, t, device_a);
  } else {
    TORCH_CHECK(t.device().is_cpu() || t.device() == device_a || t.device() == device_b, caller, ": argument '", arg,
                "' expected on cpu, ", device_a, " or ", device_b, ", got ", t.device());
  }
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + host.numel());
}

/// Every id of `pages` is in range and allocated in `pool`.
inline void allocated_pages(const Caller& caller, const char* arg, const std::vector<int64_t>& pages,
                            const PagePool& pool) {
  for (size_t i = 0; i < pages.size(); ++i) {
    const int64_t page = pages[i];
    TORCH_CHECK_INDEX(page >= 0 && page < pool.n_pages(), caller, ": argument '", arg, "' expected page ids in [0, ",
                      pool.n_pages(), "), got ", arg, "[", i, "] = ", page, page == kUnmappedPage ? " (unmapped)" : "");
    TORCH_CHECK(pool.is_allocated(page), caller, ": argument '", arg, "' expected allocated pages, got ", arg, "[", i,
                "] = ", page, " which is free (use after free)");
  }
}

/// The checks every page copy makes: equal lengths, src allocated in the
/// source pool, dst allocated, distinct and not shared in the destination
/// pool. Returns whether some page is both read and written (only possible
/// within one cache).
inline bool copy_lists(const Caller& caller, const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                       const PagePool& src_pool, const PagePool& dst_pool) {
  TORCH_CHECK(src.size() == dst.size(), caller, ": arguments 'src' and 'dst' expected the same length, got ",
              src.size(), " and ", dst.size());
  allocated_pages(caller, "src", src, src_pool);
  allocated_pages(caller, "dst", dst, dst_pool);
  for (size_t i = 0; i < dst.size(); ++i) {
    const int64_t refs = dst_pool.ref_count(dst[i]);
    TORCH_CHECK(refs == 1, caller, ": argument 'dst' expected pages with ref_count 1, got dst[", i, "] = ", dst[i],
                " with ref_count ", refs, " (a copy onto a shared page; copy it to a fresh page first)");
  }
  std::vector<int64_t> sorted(dst);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_CHECK(dup == sorted.end(), caller, ": argument 'dst' expected distinct pages, got page ",
              dup == sorted.end() ? int64_t{0} : *dup, " more than once");
  if (&src_pool != &dst_pool) return false;
  return std::any_of(src.begin(), src.end(),
                     [&](int64_t page) { return std::binary_search(sorted.begin(), sorted.end(), page); });
}

/// Caches whose pages may be copied into each other: the same n_layers,
/// page_size, n_kv_heads, head_dim, dtype and formats (the layouts may differ).
template <class ToCache, class FromCache>
void same_geometry(const Caller& caller, const ToCache& to, const FromCache& from) {
  TORCH_CHECK(to.n_layers() == from.n_layers() && to.page_size() == from.page_size() &&
                  to.n_kv_heads() == from.n_kv_heads() && to.head_dim() == from.head_dim(),
              caller, ": argument 'other' expected the same geometry (n_layers, page_size, n_kv_heads, head_dim) = (",
              to.n_layers(), ", ", to.page_size(), ", ", to.n_kv_heads(), ", ", to.head_dim(), "), got (",
              from.n_layers(), ", ", from.page_size(), ", ", from.n_kv_heads(), ", ", from.head_dim(), ")");
  TORCH_CHECK(to.dtype() == from.dtype(), caller, ": argument 'other' expected dtype ", to.dtype(),
              " (this cache's), got ", from.dtype());
  TORCH_CHECK(to.quant() == from.quant(), caller, ": argument 'other' expected formats (K ", format_name(to.quant().k),
              ", V ", format_name(to.quant().v), ") (this cache's), got (K ", format_name(from.quant().k), ", V ",
              format_name(from.quant().v), ")");
}

}  // namespace checks
}  // namespace pagedkv
