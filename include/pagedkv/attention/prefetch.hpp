// Deprecated: moved to pagedkv/cpu/attention/prefetch.hpp in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/attention/prefetch.hpp is deprecated: include pagedkv/cpu/attention/prefetch.hpp")
#endif

#include "pagedkv/cpu/attention/prefetch.hpp"
