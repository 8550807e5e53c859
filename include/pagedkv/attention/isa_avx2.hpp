// Deprecated: moved to pagedkv/simd/isa_avx2.hpp in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/attention/isa_avx2.hpp is deprecated: include pagedkv/simd/isa_avx2.hpp")
#endif

#include "pagedkv/simd/isa_avx2.hpp"
