// Paged attention: the one entry point, for a validated call (the checks
// are paged_attention's, attention.hpp, and the Python op's). It picks the
// backend once (ops/backend.hpp): cpu/attention/kernel.hpp, on native and
// quantized pages alike; cuda/attention.hpp, for the head_dims its kernels
// take; else generic/attention.hpp (gather, then ATen). Every backend
// receives the options whole.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pagedkv/attention_options.hpp"
#include "pagedkv/cpu/attention/kernel.hpp"
#include "pagedkv/cuda/attention.hpp"
#include "pagedkv/generic/attention.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/ops/storage.hpp"
#include "pagedkv/ops/write_gather.hpp"

namespace pagedkv {
namespace ops {

/// The kernels that run attention on `s`: those of kernels_for, but the
/// ATen path for a head_dim the CUDA kernels do not take.
inline Kernels attention_kernels_for(const Storage& s) {
  const Kernels kernels = kernels_for(s.device());
  if (kernels == Kernels::cuda && !cuda::attention_supports(s.geometry.head_dim, cuda::executor_for(s.device()))) {
    return Kernels::generic;
  }
  return kernels;
}

/// Causal attention of q [B, Sq, n_heads, D] (the storage's dtype) over
/// layer `layer`: query s of row b at position lengths[b] - Sq + s, with
/// the options (window, soft-cap, sinks, tree mask) AttentionOptions says.
/// Validated: Sq >= 1, lengths[b] >= Sq, every page holding positions
/// [checks::first_visible(lengths[b], Sq, options.window), lengths[b])
/// mapped and allocated (the columns before may be -1); options.scale > 0
/// and the other options checked (checks::attention_options). `bound_lengths`: `lengths` are
/// the bound view's (table.bound), which the CUDA kernels read on the device.
/// Returns [B, Sq, n_heads, D] in q's dtype.
inline at::Tensor attention(const Storage& s, int64_t layer, const Table& table, const std::vector<int64_t>& lengths,
                            bool bound_lengths, const at::Tensor& q, const AttentionOptions& options) {
  switch (attention_kernels_for(s)) {
    case Kernels::cuda: {
      const at::Tensor device_table = detail::cuda_table(s, table);
      at::Tensor uploaded;
      const int64_t* device_lengths = nullptr;
      if (bound_lengths) {
        device_lengths = table.bound->device_lengths.data_ptr<int64_t>();
      } else {
        uploaded = cuda::on_device(cuda::host_int64(lengths), s.device());
        device_lengths = uploaded.data_ptr<int64_t>();
      }
      cuda::Side sides[2];
      detail::cuda_sides(s, layer, sides);
      return cuda::attention(cuda::executor_for(s.device()), cuda::table_ref(device_table), device_lengths, q, sides,
                             s.geometry, s.dtype, s.n_pages(), options);
    }
    case Kernels::cpu: {
      const cpu::attention::KVSide k = cpu::attention::layer_side(s.k, s.k_scales, s.quant.k, layer);
      const cpu::attention::KVSide v = cpu::attention::layer_side(s.v, s.v_scales, s.quant.v, layer);
      return visit_page_table(table.host, [&](const auto& t) {
        return cpu::attention::paged_attention_cpu(t, lengths, q, k, v, s.geometry, options);
      });
    }
    case Kernels::generic:
      break;
  }
  return visit_page_table(table.host, [&](const auto& t) {
    if (is_quantized(s.quant)) {
      const int64_t n_tokens = *std::max_element(lengths.begin(), lengths.end());
      return generic::attention_over_gathered(detail::gather_generic(s, layer, t, lengths, n_tokens), lengths, q,
                                              s.geometry, options);
    }
    return generic::paged_attention_generic(t, lengths, q, s.k.select(0, layer), s.v.select(0, layer), s.geometry,
                                            options);
  });
}

}  // namespace ops
}  // namespace pagedkv
