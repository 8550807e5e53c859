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
#include "pagedkv/ops/attention.hpp"
#include "pagedkv/page_table.hpp"
#include "stateless.hpp"

// Compiled in attention_f32.cpp, attention_f16.cpp, attention_bf16.cpp.
PAGEDKV_PY_ATTENTION_KERNEL(extern, float)
PAGEDKV_PY_ATTENTION_KERNEL(extern, c10::Half)
PAGEDKV_PY_ATTENTION_KERNEL(extern, c10::BFloat16)

namespace pagedkv_py {

namespace checks = pagedkv::checks;

at::Tensor View::paged_attention(int64_t layer, const at::Tensor& q, const pagedkv::AttentionOptions& options) const {
  return std::visit([&](const auto& view) { return pagedkv::paged_attention(view, layer, q, options); }, view_);
}

namespace {

at::Tensor paged_attention_op(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer,
                              const at::Tensor& page_table, const at::Tensor& lengths, const at::Tensor& q,
                              double scale, c10::string_view layout, const c10::optional<at::Tensor>& k_scales,
                              const c10::optional<at::Tensor>& v_scales, int64_t window, double softcap,
                              const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& tree_mask) {
  return op_body([&] {
    const checks::Caller caller = op_checks::op("paged_attention");
    op_checks::Storage s = op_checks::storage(caller, k_cache, v_cache, k_scales, v_scales, layout);
    TORCH_CHECK(q.defined(), caller, ": argument 'q' expected a tensor, got an undefined one");
    const bool has_native = !is_quantized(s.quant.k) || !is_quantized(s.quant.v);
    const at::ScalarType dtype =
        op_checks::logical_dtype(caller, s, "q", has_native ? c10::nullopt : c10::make_optional(q.scalar_type()));
    s.dtype = dtype;
    checks::layer(caller, layer, s.n_layers());
    checks::attention_dtype(caller, dtype);
    checks::page_table(caller, page_table, s.device());
    const int64_t batch = page_table.size(0);
    checks::attention_query(caller, q, batch, s.geometry, dtype, s.device());
    pagedkv::AttentionOptions options;
    options.scale = scale;
    options.window = window;
    options.softcap = softcap;
    if (sinks.has_value()) options.sinks = *sinks;
    if (tree_mask.has_value()) options.tree_mask = *tree_mask;
    const int64_t n_queries = q.size(1);
    checks::attention_options(caller, options, batch, n_queries, q.size(2), s.device());
    const std::vector<int64_t> lens = checks::per_sequence(caller, "lengths", lengths, batch, s.device());
    checks::attention_lengths(caller, lens, n_queries);
    const at::Tensor host_table = on_host(page_table);
    pagedkv::visit_page_table(host_table, [&](const auto& table) {
      for (int64_t row = 0; row < table.rows; ++row) {
        const int64_t length = lens[static_cast<size_t>(row)];
        op_checks::mapped_range(caller, table, row, checks::first_visible(length, n_queries, window), length,
                                s.geometry.page_size, s.n_pages());
      }
    });
    // Validated: from here on nothing throws (but a device error).
    if (q.size(0) == 0 || n_queries == 0) return at::empty(q.sizes(), q.options());
    if (options.scale <= 0.0) options.scale = 1.0 / std::sqrt(static_cast<double>(s.geometry.head_dim));
    return pagedkv::ops::attention(s, layer, pagedkv::ops::Table{page_table, host_table, nullptr}, lens, false, q,
                                   options);
  });
}

}  // namespace
}  // namespace pagedkv_py

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("paged_attention", &pagedkv_py::paged_attention_op); }

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("paged_attention", &pagedkv_py::paged_attention_op); }
