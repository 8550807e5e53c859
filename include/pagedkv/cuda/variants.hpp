// The kernels pagedkv launches, for the compile check (tests/
// test_cuda_nvrtc.cpp compiles them with NVRTC for sm_80 and sm_90 in CI,
// where there is no GPU). Every kernel but the decode kernel has a fixed
// set of instantiations, all listed. The decode kernel takes head_dim as a
// template argument: any head_dim compiles from the same text, and the
// check covers one head_dim in full and others for their load paths
// (16-, 8-, 4-byte and narrower moves, one or more moves per lane, lanes
// left idle).
#pragma once

#include <vector>

#include "pagedkv/cuda/attention.hpp"
#include "pagedkv/cuda/launch.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "pagedkv/kv_format.hpp"

namespace pagedkv {
namespace cuda {

/// The data-moving kernels: write, gather (native and every dtype x
/// format of a quantized side) and page copies.
inline std::vector<KernelKey> data_kernels() {
  std::vector<KernelKey> out{write_native_kernel(), gather_native_kernel(), kernel("copy_pages", "CopyParams",
                                                                                     kCopyThreads)};
  for (int dtype = 0; dtype < 3; ++dtype) {
    for (const KVFormat f : {KVFormat::fp8_e4m3, KVFormat::int8}) {
      out.push_back(write_quantized_kernel(dtype, f));
      out.push_back(gather_quantized_kernel(dtype, f));
    }
  }
  return out;
}

/// The decode kernels for one head_dim and the head tiles `tiles`: native
/// pages of every dtype, fp8 and int8 pages (K and V alike).
inline std::vector<KernelKey> decode_kernels(int head_dim, const std::vector<int>& tiles = {1, 2, 4, 8}) {
  std::vector<KernelKey> out;
  for (const int tile : tiles) {
    for (int dtype = 0; dtype < 3; ++dtype) out.push_back(attention_decode_kernel(dtype, KVFormat::native, head_dim, tile));
    out.push_back(attention_decode_kernel(0, KVFormat::fp8_e4m3, head_dim, tile));
    out.push_back(attention_decode_kernel(0, KVFormat::int8, head_dim, tile));
  }
  return out;
}

/// What the compile check compiles: the data kernels, prefill and merge
/// (one each: their types are run-time values), every decode kernel of
/// `head_dim`, and those of head tile 4 for each of `other_head_dims`
/// (which differ from `head_dim`'s in their loads only).
inline std::vector<KernelKey> all_kernels(int head_dim, const std::vector<int>& other_head_dims) {
  std::vector<KernelKey> out = data_kernels();
  out.push_back(attention_prefill_kernel());
  out.push_back(attention_merge_kernel());
  const std::vector<KernelKey> all_tiles = decode_kernels(head_dim);
  out.insert(out.end(), all_tiles.begin(), all_tiles.end());
  for (const int d : other_head_dims) {
    const std::vector<KernelKey> a = decode_kernels(d, {4});
    out.insert(out.end(), a.begin(), a.end());
  }
  return out;
}

}  // namespace cuda
}  // namespace pagedkv
