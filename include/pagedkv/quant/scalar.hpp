// Deprecated: moved to pagedkv/cpu/quant/scalar.hpp in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/quant/scalar.hpp is deprecated: include pagedkv/cpu/quant/scalar.hpp")
#endif

#include "pagedkv/cpu/quant/scalar.hpp"
