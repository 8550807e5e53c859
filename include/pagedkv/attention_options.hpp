// The options of paged attention: one struct that paged_attention takes and
// every backend's attention receives whole (the scale resolved, the other
// options checked), so that an option is added in one place and read once
// by each backend. docs/attention.md teaches them with the model families
// that need each one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pagedkv {

struct AttentionOptions {
  /// Multiplies every logit q.k; <= 0: 1/sqrt(head_dim) (paged_attention
  /// resolves it before a backend sees the options).
  double scale = 0.0;
  /// 0: no window; w >= 1: the query at position p sees positions
  /// [p - w + 1, p] only (transformers' `sliding_window`): older keys are
  /// never read, and their pages may be unmapped (-1).
  int64_t window = 0;
  /// > 0: every scaled logit x becomes softcap * tanh(x / softcap) (Gemma 2).
  double softcap = 0.0;
  /// Undefined, or [n_heads] float32 on the cache's device: one logit per
  /// query head, in the units of the scaled (and capped) logits, that joins
  /// the softmax's denominator and contributes no value (gpt-oss).
  at::Tensor sinks;
  /// Undefined, or [B, Sq, Sq] bool on the cache's device: among the Sq new
  /// tokens, query i sees new token j iff tree_mask[b][i][j] (speculative
  /// decoding's token trees); every older token as usual.
  at::Tensor tree_mask;

  /// Whether any option beyond the scale is set.
  bool beyond_scale() const { return window > 0 || softcap > 0.0 || sinks.defined() || tree_mask.defined(); }
};

}  // namespace pagedkv
