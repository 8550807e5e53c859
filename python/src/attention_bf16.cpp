// The CPU attention kernel for c10::BFloat16 outputs (attention_kernel.hpp).
#include "attention_kernel.hpp"

PAGEDKV_PY_ATTENTION_KERNEL(, c10::BFloat16)
