// How K and V are stored in a cache's pages: in the cache's own dtype
// (native), or one byte per element with a float32 scale per (token, head)
// (fp8 e4m3, int8). K and V may differ: keys carry outlier channels that
// suit fp8's range; values suit int8's even precision.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "pagedkv/layouts.hpp"

namespace pagedkv {

enum class KVFormat { native, fp8_e4m3, int8 };

struct KVQuant {
  KVFormat k = KVFormat::native;
  KVFormat v = KVFormat::native;
};

inline bool operator==(const KVQuant& a, const KVQuant& b) { return a.k == b.k && a.v == b.v; }
inline bool operator!=(const KVQuant& a, const KVQuant& b) { return !(a == b); }

/// Name used in error messages and reports.
inline const char* format_name(KVFormat f) {
  switch (f) {
    case KVFormat::fp8_e4m3: return "fp8_e4m3";
    case KVFormat::int8: return "int8";
    default: return "native";
  }
}

/// Whether pages of format `f` hold codes and scales.
inline bool is_quantized(KVFormat f) { return f != KVFormat::native; }
inline bool is_quantized(const KVQuant& q) { return is_quantized(q.k) || is_quantized(q.v); }

/// The dtype of a side's page storage: its codes (kByte for fp8, whose bit
/// patterns are not integers; kChar for int8), or the logical dtype.
inline at::ScalarType storage_dtype(KVFormat f, at::ScalarType logical) {
  switch (f) {
    case KVFormat::fp8_e4m3: return at::kByte;
    case KVFormat::int8: return at::kChar;
    default: return logical;
  }
}

/// The geometry of a scales page: one value per head row (every backend and
/// the page copies lay scales out so).
inline PageGeometry scale_geometry(const PageGeometry& g) {
  return {g.page_size, g.n_heads, 1, g.token_stride / g.head_dim, g.head_stride / g.head_dim,
          g.page_size * g.n_heads};
}

}  // namespace pagedkv
