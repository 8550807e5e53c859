// Everything that differs between the libtorch versions pagedkv supports:
// Debian's libtorch 1.13 (the baseline `make test` builds against) and the
// 2.x inside pip's torch (`make test-torch2`, checked up to 2.15). Code
// elsewhere never tests a torch version itself: it uses what this header
// defines, so the next API change is mended here once.
#pragma once

#include <torch/version.h>  // TORCH_VERSION_MAJOR / _MINOR: in 1.13 and every 2.x

/// True when the libtorch being compiled against is at least major.minor.
#define PAGEDKV_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

/// 1 where the libtorch has the float8_e4m3fn dtype (2.1 and later), and
/// with it pagedkv's k_cache_as_float8 / v_cache_as_float8
/// (float8_view.hpp); 0 otherwise.
#if PAGEDKV_TORCH_AT_LEAST(2, 1)
#define PAGEDKV_HAS_TORCH_FLOAT8 1
#else
#define PAGEDKV_HAS_TORCH_FLOAT8 0
#endif

/// 1 where the libtorch's at::scaled_dot_product_attention takes
/// `enable_gqa` (2.5 and later): fewer kv heads than query heads without
/// repeating K/V first. Only the benchmarks use it (their SDPA rows, the
/// peer of paged decode attention); 0 otherwise.
#if PAGEDKV_TORCH_AT_LEAST(2, 5)
#define PAGEDKV_HAS_TORCH_SDPA_GQA 1
#else
#define PAGEDKV_HAS_TORCH_SDPA_GQA 0
#endif
