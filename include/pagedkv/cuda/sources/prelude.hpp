// The kernel dialect on the device: every CUDA builtin the kernels use,
// under a pagedkv name. Kernel sources (sources/*.hpp) call only these,
// never threadIdx, __syncthreads, __shfl_xor_sync and the like directly, so
// that the same text also compiles as host C++ against the emulator's
// prelude (tests/cuda_emulator/prelude.hpp), which defines every name below
// for a CPU emulation of the grid. Anything added here must be added there.
//
// Rules of the dialect (the emulator enforces what it can):
// - PKV_SHARED only at the top of a kernel body, executed by every thread
//   in the same order; no __shared__ in helpers.
// - pkv_sync() is reached by every thread of the block, pkv_sync_warp()
//   and the shuffles by all 32 lanes of a warp (full mask), never in code
//   that some lanes skip.
// - Global memory is read and written through pkv_load_* / pkv_store_*
//   (typed accesses to untyped buffers: the host side uses memcpy), except
//   float buffers that hold floats (scales, partial results).
// - Arithmetic whose bits must equal the CPU's uses pkv_mul_rn /
//   pkv_div_rn / pkv_add_rn (never contracted into an FMA) and pkv_rint.
// - No headers: NVRTC compiles the program with no include path.
#pragma once

#include "pagedkv/cuda/source_text.hpp"

namespace pagedkv {
namespace cuda {
namespace sources {

// clang-format off
inline constexpr SourceText kPrelude{"pagedkv/cuda/sources/prelude.hpp", __LINE__, R"PAGEDKV(
#define PKV_DEVICE __device__ __forceinline__
#define PKV_UNROLL _Pragma("unroll")
#define PKV_SHARED(type, name, count) __shared__ __align__(16) type name[count]
#define PKV_DYNAMIC_SHARED(type, name) \
  extern __shared__ __align__(16) unsigned char pkv_dynamic_shared_bytes[]; \
  type* const name = reinterpret_cast<type*>(pkv_dynamic_shared_bytes)

typedef signed char pkv_i8;
typedef unsigned char pkv_u8;
typedef unsigned short pkv_u16;
typedef int pkv_i32;
typedef unsigned int pkv_u32;
typedef long long pkv_i64;
typedef unsigned long long pkv_u64;

/// 16 bytes moved by one load or store.
struct __align__(16) pkv_v16 { pkv_u32 x, y, z, w; };
/// 8 bytes moved by one load or store.
struct __align__(8) pkv_v8 { pkv_u32 x, y; };

// ---- the grid ----
PKV_DEVICE pkv_u32 pkv_tid() { return threadIdx.x; }
PKV_DEVICE pkv_u32 pkv_ntid() { return blockDim.x; }
PKV_DEVICE pkv_u32 pkv_bid_x() { return blockIdx.x; }
PKV_DEVICE pkv_u32 pkv_bid_y() { return blockIdx.y; }
PKV_DEVICE pkv_u32 pkv_bid_z() { return blockIdx.z; }
PKV_DEVICE pkv_u32 pkv_nbid_x() { return gridDim.x; }
PKV_DEVICE pkv_u32 pkv_nbid_y() { return gridDim.y; }
PKV_DEVICE pkv_u32 pkv_nbid_z() { return gridDim.z; }

// ---- synchronisation and warp exchange ----
PKV_DEVICE void pkv_sync() { __syncthreads(); }
PKV_DEVICE void pkv_sync_warp() { __syncwarp(0xffffffffu); }
PKV_DEVICE float pkv_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
PKV_DEVICE pkv_u32 pkv_shfl_xor_u32(pkv_u32 v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
PKV_DEVICE float pkv_shfl_idx(float v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }

// ---- bits and exactly rounded arithmetic ----
PKV_DEVICE pkv_u32 pkv_float_bits(float f) { return __float_as_uint(f); }
PKV_DEVICE float pkv_bits_float(pkv_u32 u) { return __uint_as_float(u); }
PKV_DEVICE float pkv_mul_rn(float a, float b) { return __fmul_rn(a, b); }
PKV_DEVICE float pkv_div_rn(float a, float b) { return __fdiv_rn(a, b); }
PKV_DEVICE float pkv_add_rn(float a, float b) { return __fadd_rn(a, b); }
/// Round to the nearest integer, ties to even.
PKV_DEVICE float pkv_rint(float x) { return rintf(x); }
PKV_DEVICE float pkv_exp(float x) { return expf(x); }
PKV_DEVICE float pkv_tanh(float x) { return tanhf(x); }
PKV_DEVICE float pkv_fabs(float x) { return fabsf(x); }
/// Bytes of {b, a} selected by the 4 nibbles of `selector` (CUDA's __byte_perm).
PKV_DEVICE pkv_u32 pkv_byte_perm(pkv_u32 a, pkv_u32 b, pkv_u32 selector) { return __byte_perm(a, b, selector); }
/// An fp16 (bits) as float32: exact. NaN payloads are not kept (see
/// half_to_float in common.hpp for the bit-exact conversion).
PKV_DEVICE float pkv_half_to_float_fast(pkv_u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// ---- global memory through untyped pointers ----
PKV_DEVICE pkv_v16 pkv_load_v16(const void* p) { return *static_cast<const pkv_v16*>(p); }
PKV_DEVICE pkv_v8 pkv_load_v8(const void* p) { return *static_cast<const pkv_v8*>(p); }
PKV_DEVICE pkv_u32 pkv_load_u32(const void* p) { return *static_cast<const pkv_u32*>(p); }
PKV_DEVICE pkv_u16 pkv_load_u16(const void* p) { return *static_cast<const pkv_u16*>(p); }
PKV_DEVICE pkv_u8 pkv_load_u8(const void* p) { return *static_cast<const pkv_u8*>(p); }
PKV_DEVICE pkv_u64 pkv_load_u64(const void* p) { return *static_cast<const pkv_u64*>(p); }
PKV_DEVICE pkv_i64 pkv_load_i64(const void* p) { return *static_cast<const pkv_i64*>(p); }
PKV_DEVICE pkv_i32 pkv_load_i32(const void* p) { return *static_cast<const pkv_i32*>(p); }
PKV_DEVICE void pkv_store_v16(void* p, pkv_v16 v) { *static_cast<pkv_v16*>(p) = v; }
PKV_DEVICE void pkv_store_v8(void* p, pkv_v8 v) { *static_cast<pkv_v8*>(p) = v; }
PKV_DEVICE void pkv_store_u32(void* p, pkv_u32 v) { *static_cast<pkv_u32*>(p) = v; }
PKV_DEVICE void pkv_store_u16(void* p, pkv_u16 v) { *static_cast<pkv_u16*>(p) = v; }
PKV_DEVICE void pkv_store_u8(void* p, pkv_u8 v) { *static_cast<pkv_u8*>(p) = v; }
PKV_DEVICE void pkv_store_u64(void* p, pkv_u64 v) { *static_cast<pkv_u64*>(p) = v; }
)PAGEDKV"};
// clang-format on

}  // namespace sources
}  // namespace cuda
}  // namespace pagedkv
