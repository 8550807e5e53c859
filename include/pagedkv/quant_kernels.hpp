// Deprecated: moved to pagedkv/cpu/quant/kernels.hpp (CPU) and
// pagedkv/generic/quant_kernels.hpp (ATen) in 0.2 (include/pagedkv/README.md
// maps every header); this forwarding header goes in the next release.
// It also includes pagedkv/kernels.hpp, as the old header did.
#pragma once

#if defined(PAGEDKV_WARN_DEPRECATED_HEADERS)
#pragma message("pagedkv/quant_kernels.hpp is deprecated: include the two headers it names")
#endif

#include "pagedkv/cpu/quant/kernels.hpp"
#include "pagedkv/generic/quant_kernels.hpp"
#include "pagedkv/kernels.hpp"
