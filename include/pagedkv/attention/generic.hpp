// Deprecated: moved to pagedkv/generic/attention.hpp in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
// It also includes pagedkv/kernels.hpp, as the old header did.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/attention/generic.hpp is deprecated: include pagedkv/generic/attention.hpp")
#endif

#include "pagedkv/generic/attention.hpp"
#include "pagedkv/kernels.hpp"
