// The CPU attention kernel's three instances (float32, float16 and bfloat16
// outputs), each compiled in a file of its own (attention_f32.cpp,
// attention_f16.cpp, attention_bf16.cpp): the heaviest code of the library
// (every instruction set, native and quantized pages), about 170 CPU-seconds
// in one file with g++ -O3, so split the build runs it on both cores.
// attention.cpp, which calls them, declares them extern.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#include "pagedkv/attention.hpp"

/// `PREFIX template` of paged_attention_cpu_impl<T>: PREFIX extern declares
/// the instance, an empty PREFIX defines it.
#define PAGEDKV_PY_ATTENTION_KERNEL(PREFIX, T)                                                                 \
  PREFIX template void pagedkv::cpu::attention::paged_attention_cpu_impl<T>(                               \
      const pagedkv::AnyPageTableRef&, const std::vector<int64_t>&, const float*, const T*, float, T*,       \
      const pagedkv::cpu::attention::KVSide&, const pagedkv::cpu::attention::KVSide&,                    \
      const pagedkv::PageGeometry&, int64_t, int64_t, const pagedkv::cpu::attention::RawOptions&);
