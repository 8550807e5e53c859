// Deprecated: moved to pagedkv/simd/constants.hpp in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/attention/constants.hpp is deprecated: include pagedkv/simd/constants.hpp")
#endif

#include "pagedkv/simd/constants.hpp"
