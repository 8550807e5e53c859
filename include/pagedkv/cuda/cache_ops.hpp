// PagedCache's calls on a cache that runs the CUDA kernels (or, in tests,
// a CPU cache under a ScopedExecutor): bind, the per-layer calls of a
// bound view (write, gather, paged_attention), and the direct write and
// gather. The views' calls read only host snapshots made by bind and
// launch on the current stream: no device memory comes back to the host
// and nothing waits for the device. Every check runs before anything
// changes, as on the CPU.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/cuda/attention.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/cuda/executor.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace cuda {

/// Layer `layer`'s K and V sides of `cache`.
template <class Cache>
void cache_sides(const Cache& cache, int64_t layer, Side (&sides)[2]) {
  sides[0] = {pages_ref(cache.k_cache(), cache.k_scales(), layer, cache.geometry()), cache.quant().k};
  sides[1] = {pages_ref(cache.v_cache(), cache.v_scales(), layer, cache.geometry()), cache.quant().v};
}

/// The kernels a cache of `dtype`, `quant` and `head_dim` launches from its
/// views' per-layer calls (bind loads them, so that none is compiled then).
inline std::vector<KernelKey> view_kernels(at::ScalarType dtype, const KVQuant& quant, int64_t head_dim) {
  std::vector<KernelKey> out;
  const bool native = !is_quantized(quant.k) || !is_quantized(quant.v);
  if (native) {
    out.push_back(write_native_kernel());
    out.push_back(gather_native_kernel());
  }
  const int dt = dtype_id(dtype);
  for (const KVFormat f : {quant.k, quant.v}) {
    if (!is_quantized(f)) continue;
    out.push_back(write_quantized_kernel(dt, f));
    out.push_back(gather_quantized_kernel(dt, f));
  }
  if (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) {
    if (quant.k == quant.v && head_dim <= kMaxHeadDim) {
      for (const int tile : {1, 2, 4, 8}) {
        out.push_back(attention_decode_kernel(dt, quant.k, static_cast<int>(head_dim), tile));
      }
    }
    out.push_back(attention_prefill_kernel());
    out.push_back(attention_merge_kernel());
  }
  std::sort(out.begin(), out.end(), [](const KernelKey& a, const KernelKey& b) { return a.name() < b.name(); });
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

/// Launches the write of k, v [B, S, H, D] into layer `layer` (validated).
template <class Cache>
void write_layer(const Cache& cache, int64_t layer, const kernel_params::TableRef& table, const Starts& starts,
                 const at::Tensor& k, const at::Tensor& v) {
  Side sides[2];
  cache_sides(cache, layer, sides);
  write(executor_for(cache.device()), table, starts, k, v, sides, cache.geometry(), cache.dtype(), cache.n_pages());
}

/// Launches the gather of layer `layer` into new [B, n_tokens, H, D]
/// tensors: positions [0, lengths[b]) (on the device) or [0, length).
template <class Cache>
std::pair<at::Tensor, at::Tensor> gather_layer(const Cache& cache, int64_t layer,
                                               const kernel_params::TableRef& table, const int64_t* lengths,
                                               int64_t length, int64_t n_tokens) {
  const at::TensorOptions options = cache.k_cache().options().dtype(cache.dtype());
  at::Tensor k = at::empty({table.rows, n_tokens, cache.n_kv_heads(), cache.head_dim()}, options);
  at::Tensor v = at::empty({table.rows, n_tokens, cache.n_kv_heads(), cache.head_dim()}, options);
  Side sides[2];
  cache_sides(cache, layer, sides);
  gather(executor_for(cache.device()), table, lengths, length, sides, k, v, cache.geometry(), cache.dtype(),
         cache.n_pages());
  return {k, v};
}

/// bind on a cache with CUDA kernels: a snapshot of the validated table
/// (`host_table`, on the cpu) and lengths, and their device copies, in
/// memory of the view's own or the cache's per-shape buffers (`sets`).
template <class Cache>
std::shared_ptr<const BoundTables> bind_tables(const checks::Caller& caller, const Cache& cache, BindBufferSets& sets,
                                               const at::Tensor& host_table, const std::vector<int64_t>* lengths,
                                               BindBuffers buffers) {
  const at::Device device = cache.device();
  TORCH_CHECK(!capturing(device), caller,
              ": expected to be called outside a CUDA graph capture (bind uploads the page table); bind before "
              "capturing, then capture the per-layer calls");
  prepare(device, view_kernels(cache.dtype(), cache.quant(), cache.head_dim()));
  auto b = std::make_shared<BoundTables>();
  b->host_table = host_table.contiguous();
  if (b->host_table.data_ptr() == host_table.data_ptr()) b->host_table = b->host_table.clone();  // a snapshot
  if (lengths != nullptr) b->host_lengths = *lengths;
  const int64_t batch = host_table.size(0);
  const at::TensorOptions on = at::TensorOptions().device(device);
  if (buffers == BindBuffers::per_shape) {
    std::shared_ptr<BindBufferSet>& set =
        sets[BindShape{batch, host_table.size(1), static_cast<int>(host_table.scalar_type())}];
    if (!set) {
      set = std::make_shared<BindBufferSet>();
      set->table = at::empty(host_table.sizes(), on.dtype(host_table.scalar_type()));
      set->lengths = at::empty({batch}, on.dtype(at::kLong));
    }
    b->device_table = set->table;
    b->device_lengths = set->lengths;
    b->buffers = set;
    b->generation = ++set->generation;
  } else {
    b->device_table = at::empty(host_table.sizes(), on.dtype(host_table.scalar_type()));
    if (lengths != nullptr) b->device_lengths = at::empty({batch}, on.dtype(at::kLong));
  }
  upload(b->device_table, b->host_table);
  if (lengths != nullptr) upload(b->device_lengths, host_int64(*lengths));
  b->alloc_epoch = cache.pool().alloc_epoch();
  b->free_epoch = cache.pool().free_epoch();
  return b;
}

/// A bound view is still usable: no later bind reused its buffers, and
/// (when the pool freed pages since bind) none of the pages it maps in
/// columns [0, end_col(row)) was freed or reallocated.
template <class Cache, class Index, class EndColumn>
void check_current(const checks::Caller& caller, const Cache& cache, const BoundTables& b,
                   const PageTableRef<Index>& table, const EndColumn& end_col) {
  checks::bound_buffers_current(caller, b.buffers != nullptr ? b.buffers->generation : 0, b.generation);
  if (cache.pool().free_epoch() == b.free_epoch) return;  // nothing freed since bind: O(1)
  for (int64_t row = 0; row < table.rows; ++row) {
    checks::bound_pages_current(caller, table, row, 0, end_col(row), cache.pool(), b.alloc_epoch);
  }
}

/// CacheView::write on a bound view: start positions `start_pos` ([B]
/// tensor) or, when undefined, `scalar`.
template <class View>
void view_write(const View& view, int64_t layer, const at::Tensor& start_pos, int64_t scalar, const at::Tensor& k,
                const at::Tensor& v) {
  const auto& cache = view.cache();
  const BoundTables& b = *view.bound_tables();
  const checks::Caller caller{"PagedCache", View::layout_type::name, "write"};
  const int64_t batch = b.host_table.size(0);
  checks::layer(caller, layer, cache.n_layers());
  checks::page_table(caller, b.host_table, cache.device());
  checks::key_values(caller, k, v, batch, cache.geometry(), cache.dtype(), cache.device());
  std::vector<int64_t> starts;
  if (start_pos.defined()) {
    TORCH_CHECK(start_pos.device().is_cpu() || !capturing(cache.device()), caller,
                ": argument 'start_pos' expected on cpu in a CUDA graph capture (it is validated on the host), got ",
                start_pos.device());
    starts = checks::per_sequence(caller, "start_pos", start_pos, batch, cache.device());
  } else {
    checks::non_negative(caller, "start_pos", scalar);
    starts.assign(static_cast<size_t>(batch), scalar);
  }
  const int64_t n_tokens = k.size(1);
  const int64_t page_size = cache.page_size();
  visit_page_table(b.host_table, [&](const auto& table) {
    for (int64_t row = 0; row < table.rows; ++row) {
      checks::write_range(caller, table, row, starts[static_cast<size_t>(row)], n_tokens, page_size, cache.pool());
    }
    checks::bound_buffers_current(caller, b.buffers != nullptr ? b.buffers->generation : 0, b.generation);
    if (cache.pool().free_epoch() != b.free_epoch && n_tokens > 0) {
      const PageDivisor pages(page_size);
      for (int64_t row = 0; row < table.rows; ++row) {
        const int64_t first = starts[static_cast<size_t>(row)];
        checks::bound_pages_current(caller, table, row, pages.column(first), pages.column(first + n_tokens - 1) + 1,
                                    cache.pool(), b.alloc_epoch);
      }
    }
  });
  // Validated: from here on nothing throws but a device error.
  Starts where;
  at::Tensor uploaded;
  bool tail = start_pos.defined() && !b.host_lengths.empty();
  for (int64_t row = 0; tail && row < batch; ++row) {
    tail = starts[static_cast<size_t>(row)] + n_tokens == b.host_lengths[static_cast<size_t>(row)];
  }
  if (!start_pos.defined()) {
    where.scalar = scalar;
  } else if (tail) {
    where.tail_lengths = b.device_lengths.data_ptr<int64_t>();  // the bound lengths: what a graph replays with
  } else {
    TORCH_CHECK(!capturing(cache.device()), caller,
                ": argument 'start_pos' expected to equal the bound lengths - ", n_tokens,
                " in a CUDA graph capture (the captured write reads the bound lengths), got other positions");
    uploaded = on_device(host_int64(starts), cache.device());
    where.per_row = uploaded.data_ptr<int64_t>();
  }
  write_layer(cache, layer, table_ref(b.device_table), where, k, v);
}

/// CacheView::gather on a bound view.
template <class View>
std::pair<at::Tensor, at::Tensor> view_gather(const View& view, int64_t layer) {
  const auto& cache = view.cache();
  const BoundTables& b = *view.bound_tables();
  const bool prefix = b.host_lengths.empty() && view.total_len() > 0;
  const checks::Caller caller{prefix ? "CacheView" : "PagedCache", View::layout_type::name, "gather"};
  const int64_t page_size = cache.page_size();
  checks::layer(caller, layer, cache.n_layers());
  checks::page_table(caller, b.host_table, cache.device());
  return visit_page_table(b.host_table, [&](const auto& table) {
    int64_t n_tokens = 0;
    if (!b.host_lengths.empty()) {
      for (const int64_t l : b.host_lengths) n_tokens = std::max(n_tokens, l);
      check_current(caller, cache, b, table,
                    [&](int64_t row) { return (b.host_lengths[static_cast<size_t>(row)] + page_size - 1) / page_size; });
      return gather_layer(cache, layer, table_ref(b.device_table), b.device_lengths.data_ptr<int64_t>(), 0, n_tokens);
    }
    n_tokens = prefix ? view.total_len() : checks::mapped_columns(table) * page_size;
    const int64_t cols = (n_tokens + page_size - 1) / page_size;
    checks::readable_columns(caller, table, cols, cache.pool());
    check_current(caller, cache, b, table, [&](int64_t) { return cols; });
    return gather_layer(cache, layer, table_ref(b.device_table), nullptr, n_tokens, n_tokens);
  });
}

/// paged_attention on a bound view (checks in the order of the CPU path's).
template <class View>
at::Tensor view_attention(const View& view, int64_t layer, const at::Tensor& q, double scale) {
  const auto& cache = view.cache();
  const BoundTables& b = *view.bound_tables();
  const checks::Caller caller{"paged_attention", View::layout_type::name, nullptr};
  const PageGeometry& g = cache.geometry();
  const at::ScalarType dtype = cache.dtype();
  checks::layer(caller, layer, cache.n_layers());
  checks::attention_dtype(caller, dtype);
  checks::page_table(caller, b.host_table, cache.device());
  const int64_t batch = b.host_table.size(0);
  checks::attention_query(caller, q, batch, g, dtype, cache.device());
  checks::attention_scale(caller, scale);
  checks::bound_with_lengths(caller, view.lengths());
  const int64_t n_queries = q.size(1);
  checks::attention_lengths(caller, b.host_lengths, n_queries);
  visit_page_table(b.host_table, [&](const auto& table) {
    check_current(caller, cache, b, table, [&](int64_t row) {
      return (b.host_lengths[static_cast<size_t>(row)] + g.page_size - 1) / g.page_size;
    });
  });
  // Validated: from here on nothing throws but a device error.
  if (batch == 0 || n_queries == 0) return at::empty(q.sizes(), q.options());
  const double s = scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  Side sides[2];
  cache_sides(cache, layer, sides);
  return attention(executor_for(cache.device()), table_ref(b.device_table), b.device_lengths.data_ptr<int64_t>(), q,
                   sides, g, dtype, cache.n_pages(), s);
}

/// Whether paged_attention on `view` takes the CUDA kernels.
template <class View>
bool attends_with_cuda(const View& view) {
  const auto& cache = view.cache();
  return view.bound_tables() != nullptr && use_cuda_kernels(cache.device()) &&
         attention_supports(cache.head_dim(), executor_for(cache.device()));
}

}  // namespace cuda
}  // namespace pagedkv
