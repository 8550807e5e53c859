// The CPU attention kernel for c10::Half outputs (attention_kernel.hpp).
#include "attention_kernel.hpp"

PAGEDKV_PY_ATTENTION_KERNEL(, c10::Half)
