// The CPU attention kernel for float outputs (attention_kernel.hpp).
#include "attention_kernel.hpp"

PAGEDKV_PY_ATTENTION_KERNEL(, float)
