// pagedkv.paged_attention (on a CacheView) and the stateless op
// pagedkv::paged_attention, in one file, over one set of instances of the
// CPU attention kernel (compiled in attention_{f32,f16,bf16}.cpp).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_kernel.hpp"
#include "handles.hpp"
#include "op_checks.hpp"
#include "pagedkv/attention.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/kernels.hpp"
#include "pagedkv/page_table.hpp"
#include "stateless.hpp"

// Compiled in attention_f32.cpp, attention_f16.cpp, attention_bf16.cpp.
PAGEDKV_PY_ATTENTION_KERNEL(extern, float)
PAGEDKV_PY_ATTENTION_KERNEL(extern, c10::Half)
PAGEDKV_PY_ATTENTION_KERNEL(extern, c10::BFloat16)

namespace pagedkv_py {

namespace checks = pagedkv::checks;
namespace attention_kernels = pagedkv::attention_kernels;

at::Tensor View::paged_attention(int64_t layer, const at::Tensor& q, double scale) const {
  return std::visit([&](const auto& view) { return pagedkv::paged_attention(view, layer, q, scale); }, view_);
}

namespace {

/// pagedkv::paged_attention's body after its checks, on op storage.
at::Tensor attention_unchecked(const op_checks::Storage& s, int64_t layer, const at::Tensor& host_table,
                               const std::vector<int64_t>& lengths, const at::Tensor& q, double scale) {
  const pagedkv::PageGeometry& g = s.geometry;
  const int64_t n_queries = q.size(1);
  if (q.size(0) == 0 || n_queries == 0) return at::empty(q.sizes(), q.options());
  const double sc = scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  if (!pagedkv::kernels::use_cpu_kernels(s.device())) {
    if (is_quantized(s.quant)) {
      const int64_t n_tokens = *std::max_element(lengths.begin(), lengths.end());
      return attention_kernels::attention_over_gathered(
          gather_pages(s, layer, host_table, lengths, n_tokens, q.scalar_type()), lengths, q, g, sc);
    }
    return pagedkv::visit_page_table(host_table, [&](const auto& table) {
      return attention_kernels::paged_attention_generic(table, lengths, q, s.k.select(0, layer), s.v.select(0, layer),
                                                        g, sc);
    });
  }
  const attention_kernels::KVSide k = attention_kernels::layer_side(s.k, s.k_scales, s.quant.k, layer);
  const attention_kernels::KVSide v = attention_kernels::layer_side(s.v, s.v_scales, s.quant.v, layer);
  return pagedkv::visit_page_table(host_table, [&](const auto& table) {
    return attention_kernels::paged_attention_cpu(table, lengths, q, k, v, g, sc);
  });
}

at::Tensor paged_attention_op(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                              const at::Tensor& page_table, const at::Tensor& lengths, const at::Tensor& q,
                              double scale, c10::string_view layout, const c10::optional<at::Tensor>& k_scales,
                              const c10::optional<at::Tensor>& v_scales) {
  return op_body([&] {
    const checks::Caller caller = op_checks::op("paged_attention");
    const op_checks::Storage s = op_checks::storage(caller, k_cache, v_cache, k_scales, v_scales, layout);
    TORCH_CHECK(q.defined(), caller, ": argument 'q' expected a tensor, got an undefined one");
    const bool has_native = !is_quantized(s.quant.k) || !is_quantized(s.quant.v);
    const at::ScalarType dtype =
        op_checks::logical_dtype(caller, s, "q", has_native ? c10::nullopt : c10::make_optional(q.scalar_type()));
    checks::layer(caller, layer, s.n_layers);
    checks::attention_dtype(caller, dtype);
    checks::page_table(caller, page_table, s.device());
    const int64_t batch = page_table.size(0);
    checks::attention_query(caller, q, batch, s.geometry, dtype, s.device());
    checks::attention_scale(caller, scale);
    const std::vector<int64_t> lens = checks::per_sequence(caller, "lengths", lengths, batch, s.device());
    checks::attention_lengths(caller, lens, q.size(1));
    const at::Tensor host_table = on_host(page_table);
    pagedkv::visit_page_table(host_table, [&](const auto& table) {
      for (int64_t row = 0; row < table.rows; ++row) {
        op_checks::mapped_prefix(caller, table, row, lens[static_cast<size_t>(row)], s.geometry.page_size, s.n_pages);
      }
    });
    // Validated: from here on nothing throws.
    return attention_unchecked(s, layer, host_table, lens, q, scale);
  });
}

}  // namespace
}  // namespace pagedkv_py

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("paged_attention", &pagedkv_py::paged_attention_op); }

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("paged_attention", &pagedkv_py::paged_attention_op); }
