// Deprecated: moved to pagedkv/simd/convert.hpp in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/attention/convert.hpp is deprecated: include pagedkv/simd/convert.hpp")
#endif

#include "pagedkv/simd/convert.hpp"
