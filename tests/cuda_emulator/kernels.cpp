// The kernel sources of include/pagedkv/cuda/sources/, extracted by CMake
// and compiled as host C++ against the emulator's prelude, and the
// instantiations the tests launch.
#include "cuda_emulator/kernels.hpp"

#include "pagedkv/cuda/params.hpp"

namespace pkv {
PAGEDKV_CUDA_USING_KERNEL_PARAMS
}
#include "cuda_sources/common.inc"
#include "cuda_sources/write_gather.inc"
#include "cuda_sources/page_copy.inc"
#include "cuda_sources/quant.inc"
#include "cuda_sources/attention.inc"

namespace pkv_emu {

EmulatedExecutor kernels() {
  EmulatedExecutor e;
  e.add(PKV_EMULATE_PLAIN(write_native, WriteParams));
  e.add(PKV_EMULATE_PLAIN(gather_native, GatherParams));
  e.add(PKV_EMULATE_PLAIN(copy_pages, CopyParams));
  e.add(PKV_EMULATE(write_quantized, WriteParams, 0, 1));
  e.add(PKV_EMULATE(write_quantized, WriteParams, 0, 2));
  e.add(PKV_EMULATE(write_quantized, WriteParams, 1, 1));
  e.add(PKV_EMULATE(write_quantized, WriteParams, 1, 2));
  e.add(PKV_EMULATE(write_quantized, WriteParams, 2, 1));
  e.add(PKV_EMULATE(write_quantized, WriteParams, 2, 2));
  e.add(PKV_EMULATE(gather_quantized, GatherParams, 0, 1));
  e.add(PKV_EMULATE(gather_quantized, GatherParams, 0, 2));
  e.add(PKV_EMULATE(gather_quantized, GatherParams, 1, 1));
  e.add(PKV_EMULATE(gather_quantized, GatherParams, 1, 2));
  e.add(PKV_EMULATE(gather_quantized, GatherParams, 2, 1));
  e.add(PKV_EMULATE(gather_quantized, GatherParams, 2, 2));
  e.add(PKV_EMULATE_PLAIN(attention_prefill, AttentionParams));
  e.add(PKV_EMULATE_PLAIN(attention_merge, AttentionParams));
  // Decode: every element kind (fp32, fp16, bf16 pages; fp8 and int8 codes,
  // whose kernel serves every dtype), head tile and load path (head_dim 16;
  // 3: narrow moves; 64: several lanes a row). Tests keep to these.
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 0, 16, 1));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 1, 16, 2));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 2, 16, 2));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 2, 16, 4));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 1, 0, 16, 8));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 1, 16, 8));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 2, 0, 16, 4));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 1, 0, 16, 4));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 1, 16, 4));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 0, 3, 4));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 1, 3, 2));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 2, 64, 8));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 1, 0, 64, 4));
  e.add(PKV_EMULATE(attention_decode, AttentionParams, 0, 2, 64, 1));
  return e;
}

}  // namespace pkv_emu
