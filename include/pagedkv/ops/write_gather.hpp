// write and gather: the one entry point of each, for a validated call
// (PagedCache, its views and the Python ops check first; nothing here
// checks, and nothing throws but a device error). Each picks its backend
// once (ops/backend.hpp) and hands the call to it: cpu/write_gather.hpp
// (native pages) and cpu/quant/write_gather.hpp (codes and scales),
// cuda/write_gather.hpp, or generic/write_gather.hpp and generic/quant.hpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "pagedkv/cpu/quant/write_gather.hpp"
#include "pagedkv/cpu/storage.hpp"
#include "pagedkv/cpu/write_gather.hpp"
#include "pagedkv/cuda/bound_tables.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "pagedkv/generic/quant.hpp"
#include "pagedkv/generic/write_gather.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/ops/storage.hpp"
#include "pagedkv/page_table.hpp"

namespace pagedkv {
namespace ops {

namespace detail {

/// Calls f(T{}) with the C++ type of a quantized cache's logical dtype
/// (float32, float16 or bfloat16).
template <class F>
void visit_float_dtype(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kHalf: return f(c10::Half());
    case at::kBFloat16: return f(c10::BFloat16());
    default: return f(float());
  }
}

inline bool all_equal(const std::vector<int64_t>& values) {
  return std::adjacent_find(values.begin(), values.end(), std::not_equal_to<int64_t>()) == values.end();
}

/// One side (0: K, 1: V) of a layer as raw bytes for the CPU kernels of quantized pages.
template <class Byte>
cpu::quant::SidePages<Byte> side_pages(const Storage& s, int side, int64_t layer) {
  const at::Tensor& pages = side == 0 ? s.k : s.v;
  const at::Tensor& scales = side == 0 ? s.k_scales : s.v_scales;
  return {side == 0 ? s.quant.k : s.quant.v, cpu::layer_bytes(pages, layer),
          scales.defined() ? cpu::layer_floats(scales, layer) : nullptr, static_cast<int64_t>(pages.element_size())};
}

inline at::Tensor layer_of(const at::Tensor& t, int64_t layer) {
  return t.defined() ? t.select(0, layer) : at::Tensor();
}

/// Layer `layer`'s K and V sides for the CUDA kernels.
inline void cuda_sides(const Storage& s, int64_t layer, cuda::Side (&sides)[2]) {
  sides[0] = {cuda::pages_ref(s.k, s.k_scales, layer, s.geometry), s.quant.k};
  sides[1] = {cuda::pages_ref(s.v, s.v_scales, layer, s.geometry), s.quant.v};
}

/// The table the CUDA kernels read: bind's device copy, else the caller's
/// (uploaded when it is on the host).
inline at::Tensor cuda_table(const Storage& s, const Table& t) {
  return t.bound != nullptr ? t.bound->device_table : cuda::on_device(t.given, s.device());
}

template <class Index>
void write_cpu(const Storage& s, int64_t layer, const PageTableRef<Index>& table, const std::vector<int64_t>& starts,
               int64_t n_tokens, const at::Tensor& k, const at::Tensor& v) {
  if (is_quantized(s.quant)) {
    const auto tokens_of = [](const at::Tensor& x) {
      return cpu::quant::SideTokens<const char>{static_cast<const char*>(x.data_ptr()),
                                                x.stride(0) * static_cast<int64_t>(x.element_size()),
                                                cpu::token_major_strides(x)};
    };
    const cpu::quant::SideTokens<const char> src[2] = {tokens_of(k), tokens_of(v)};
    const cpu::quant::SidePages<char> dst[2] = {side_pages<char>(s, 0, layer), side_pages<char>(s, 1, layer)};
    visit_float_dtype(s.dtype, [&](auto t) {
      cpu::quant::write_sides_cpu<decltype(t)>(table, starts, n_tokens, src, dst, s.geometry);
    });
    return;
  }
  const auto elem_size = static_cast<int64_t>(s.k.element_size());
  const auto src =
      cpu::token_major(static_cast<const char*>(k.data_ptr()), k, static_cast<const char*>(v.data_ptr()), v);
  const cpu::LayerPages<char> dst{cpu::layer_bytes(s.k, layer), cpu::layer_bytes(s.v, layer),
                                  s.geometry.page_elems * elem_size, cpu::page_strides(s.geometry, elem_size)};
  cpu::write_cpu(table, starts, n_tokens, src, dst, s.geometry, elem_size);
}

template <class Index>
void write_generic(const Storage& s, int64_t layer, const PageTableRef<Index>& table,
                   const std::vector<int64_t>& starts, int64_t n_tokens, const at::Tensor& k, const at::Tensor& v) {
  if (!is_quantized(s.quant)) {
    generic::write_generic(table, starts, n_tokens, k, v, s.k.select(0, layer), s.v.select(0, layer), s.geometry);
    return;
  }
  generic::write_side_generic(table, starts, n_tokens, k, s.quant.k, s.k.select(0, layer),
                              layer_of(s.k_scales, layer), s.geometry);
  generic::write_side_generic(table, starts, n_tokens, v, s.quant.v, s.v.select(0, layer),
                              layer_of(s.v_scales, layer), s.geometry);
}

inline void write_cuda(const Storage& s, int64_t layer, const Table& t, const WriteStarts& where, const at::Tensor& k,
                       const at::Tensor& v) {
  const at::Tensor table = cuda_table(s, t);
  cuda::Starts starts;
  at::Tensor uploaded;
  if (where.bound_tail) {
    starts.tail_lengths = t.bound->device_lengths.data_ptr<int64_t>();
  } else if (where.one_start || all_equal(where.starts)) {
    starts.scalar = where.starts.empty() ? 0 : where.starts.front();
  } else {
    uploaded = cuda::on_device(cuda::host_int64(where.starts), s.device());
    starts.per_row = uploaded.data_ptr<int64_t>();
  }
  cuda::Side sides[2];
  cuda_sides(s, layer, sides);
  cuda::write(cuda::executor_for(s.device()), cuda::table_ref(table), starts, k, v, sides, s.geometry, s.dtype,
              s.n_pages());
}

template <class Index>
std::pair<at::Tensor, at::Tensor> gather_cpu(const Storage& s, int64_t layer, const PageTableRef<Index>& table,
                                             const std::vector<int64_t>& lengths, int64_t n_tokens,
                                             cpu::OutputRecycler& outputs) {
  const std::vector<int64_t> shape{table.rows, n_tokens, s.geometry.n_heads, s.geometry.head_dim};
  if (is_quantized(s.quant)) {
    at::Tensor out[2];
    for (int side = 0; side < 2; ++side) {
      out[side] = outputs.empty(static_cast<size_t>(side), shape, s.k.options().dtype(s.dtype));
      const auto src = side_pages<const char>(s, side, layer);
      visit_float_dtype(s.dtype, [&](auto t) {
        using T = decltype(t);
        cpu::quant::gather_side_cpu<T>(table, lengths, n_tokens, src, out[side].data_ptr<T>(), s.geometry);
      });
    }
    return {out[0], out[1]};
  }
  at::Tensor k_out = outputs.empty(0, shape, s.k.options());
  at::Tensor v_out = outputs.empty(1, shape, s.v.options());
  const auto elem_size = static_cast<int64_t>(s.k.element_size());
  const cpu::LayerPages<const char> src{cpu::layer_bytes(s.k, layer), cpu::layer_bytes(s.v, layer),
                                        s.geometry.page_elems * elem_size, cpu::page_strides(s.geometry, elem_size)};
  const auto dst =
      cpu::token_major(static_cast<char*>(k_out.data_ptr()), k_out, static_cast<char*>(v_out.data_ptr()), v_out);
  cpu::gather_cpu(table, lengths, n_tokens, src, dst, s.geometry, elem_size);
  return {k_out, v_out};
}

template <class Index>
std::pair<at::Tensor, at::Tensor> gather_generic(const Storage& s, int64_t layer, const PageTableRef<Index>& table,
                                                 const std::vector<int64_t>& lengths, int64_t n_tokens) {
  if (!is_quantized(s.quant)) {
    return generic::gather_generic(table, lengths, n_tokens, s.k.select(0, layer), s.v.select(0, layer), s.geometry);
  }
  return {generic::gather_side_generic(table, lengths, n_tokens, s.quant.k, s.k.select(0, layer),
                                       layer_of(s.k_scales, layer), s.geometry, s.dtype),
          generic::gather_side_generic(table, lengths, n_tokens, s.quant.v, s.v.select(0, layer),
                                       layer_of(s.v_scales, layer), s.geometry, s.dtype)};
}

/// The CUDA gather: lengths from the bound view on the device when the call
/// reads them, one launch argument when they are all equal, else uploaded.
inline std::pair<at::Tensor, at::Tensor> gather_cuda(const Storage& s, int64_t layer, const Table& t,
                                                     const std::vector<int64_t>& lengths, bool bound_lengths,
                                                     int64_t n_tokens) {
  const at::Tensor table = cuda_table(s, t);
  const at::TensorOptions options = s.k.options().dtype(s.dtype);
  const int64_t rows = t.rows();
  at::Tensor k = at::empty({rows, n_tokens, s.geometry.n_heads, s.geometry.head_dim}, options);
  at::Tensor v = at::empty({rows, n_tokens, s.geometry.n_heads, s.geometry.head_dim}, options);
  cuda::Side sides[2];
  cuda_sides(s, layer, sides);
  const int64_t* device_lengths = nullptr;
  int64_t length = 0;
  at::Tensor uploaded;
  if (bound_lengths) {
    device_lengths = t.bound->device_lengths.data_ptr<int64_t>();
  } else if (all_equal(lengths)) {
    length = lengths.empty() ? 0 : lengths.front();
  } else {
    uploaded = cuda::on_device(cuda::host_int64(lengths), s.device());
    device_lengths = uploaded.data_ptr<int64_t>();
  }
  cuda::gather(cuda::executor_for(s.device()), cuda::table_ref(table), device_lengths, length, sides, k, v,
               s.geometry, s.dtype, s.n_pages());
  return {k, v};
}

}  // namespace detail

/// Writes k, v [B, S, H, D] (any strides, the storage's dtype) into layer
/// `layer`: token s of row b at position where.starts[b] + s. Validated:
/// every page the write touches is mapped and allocated.
inline void write(const Storage& s, int64_t layer, const Table& table, const WriteStarts& where, const at::Tensor& k,
                  const at::Tensor& v) {
  switch (kernels_for(s.device())) {
    case Kernels::cuda: return detail::write_cuda(s, layer, table, where, k, v);
    case Kernels::cpu:
      return visit_page_table(table.host, [&](const auto& t) {
        detail::write_cpu(s, layer, t, where.starts, k.size(1), k, v);
      });
    case Kernels::generic:
      return visit_page_table(table.host, [&](const auto& t) {
        detail::write_generic(s, layer, t, where.starts, k.size(1), k, v);
      });
  }
}

/// k, v of layer `layer` as new [B, n_tokens, H, D] tensors in the
/// storage's dtype: positions [0, lengths[b]) of row b, zeros past them and
/// for unmapped (-1) pages. `bound_lengths`: `lengths` are the bound view's
/// (table.bound), which the CUDA kernels read on the device. CPU outputs
/// come from `outputs`, which recycles the storage of dropped ones.
inline std::pair<at::Tensor, at::Tensor> gather(const Storage& s, int64_t layer, const Table& table,
                                                const std::vector<int64_t>& lengths, bool bound_lengths,
                                                int64_t n_tokens, cpu::OutputRecycler& outputs) {
  switch (kernels_for(s.device())) {
    case Kernels::cuda: return detail::gather_cuda(s, layer, table, lengths, bound_lengths, n_tokens);
    case Kernels::cpu:
      return visit_page_table(table.host, [&](const auto& t) {
        return detail::gather_cpu(s, layer, t, lengths, n_tokens, outputs);
      });
    case Kernels::generic:
      break;
  }
  return visit_page_table(table.host,
                          [&](const auto& t) { return detail::gather_generic(s, layer, t, lengths, n_tokens); });
}

}  // namespace ops
}  // namespace pagedkv
