// The options of paged attention: one struct that paged_attention takes and
// every backend's attention receives whole (the scale resolved), so that
// an option is added in one place and read once by each backend.
#pragma once

namespace pagedkv {

struct AttentionOptions {
  /// Multiplies every logit q.k; <= 0: 1/sqrt(head_dim) (paged_attention
  /// resolves it before a backend sees the options).
  double scale = 0.0;
};

}  // namespace pagedkv
