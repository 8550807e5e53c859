// Deprecated: moved to pagedkv/cpu/attention/kernel.hpp in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
// It also includes pagedkv/kernels.hpp, as the old header did.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/attention/cpu_kernel.hpp is deprecated: include pagedkv/cpu/attention/kernel.hpp")
#endif

#include "pagedkv/cpu/attention/kernel.hpp"
#include "pagedkv/kernels.hpp"
