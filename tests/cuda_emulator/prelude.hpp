// The kernel dialect on the host: every name of
// include/pagedkv/cuda/sources/prelude.hpp, defined for the CPU emulation
// of a grid in emulator.hpp. Kernel sources compile against this unchanged
// (CMake extracts their text from the headers), so the emulator runs the
// very code NVRTC compiles, with the CUDA builtins replaced:
// - each CUDA thread of a block is a fiber; blocks run one after another;
// - pkv_sync() waits for every thread of the block, pkv_sync_warp() and
//   the shuffles for the 32 lanes of a warp (the emulator reports a
//   barrier some threads skip or reach after others exited);
// - PKV_SHARED memory is the block's, filled with 0xFF before each block;
// - loads and stores are memcpy; the arithmetic is the CPU's IEEE float32.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace pkv_emu {

/// The emulated thread now running (emulator.hpp).
struct ThreadState {
  uint32_t tid = 0;
  uint32_t block[3] = {0, 0, 0};
  uint32_t block_threads = 0;
  uint32_t grid[3] = {1, 1, 1};
};
const ThreadState& thread_state();
/// Storage for the next PKV_SHARED array of this thread's block.
void* shared_bytes(std::size_t bytes);
/// The block's dynamic shared memory.
void* dynamic_shared();
/// Barriers.
void sync_block();
void sync_warp();
/// Exchanges `bits` with the lane `lane ^ lane_mask` (xor) or `src_lane` (idx).
uint32_t shuffle_xor(uint32_t bits, int lane_mask);
uint32_t shuffle_idx(uint32_t bits, int src_lane);

/// Records a misaligned access of a `bytes`-wide load or store (the GPU
/// would fault); the launch then fails.
void misaligned(const void* p, std::size_t bytes);

template <class T>
T* shared_array(std::size_t count) {
  return static_cast<T*>(shared_bytes(count * sizeof(T)));
}

}  // namespace pkv_emu

#define PKV_DEVICE inline
#define PKV_UNROLL
#define PKV_SHARED(type, name, count) type* const name = ::pkv_emu::shared_array<type>(static_cast<std::size_t>(count))
#define PKV_DYNAMIC_SHARED(type, name) type* const name = static_cast<type*>(::pkv_emu::dynamic_shared())

typedef signed char pkv_i8;
typedef unsigned char pkv_u8;
typedef unsigned short pkv_u16;
typedef int pkv_i32;
typedef unsigned int pkv_u32;
typedef long long pkv_i64;
typedef unsigned long long pkv_u64;

struct alignas(16) pkv_v16 {
  pkv_u32 x, y, z, w;
};
struct alignas(8) pkv_v8 {
  pkv_u32 x, y;
};

inline pkv_u32 pkv_tid() { return pkv_emu::thread_state().tid; }
inline pkv_u32 pkv_ntid() { return pkv_emu::thread_state().block_threads; }
inline pkv_u32 pkv_bid_x() { return pkv_emu::thread_state().block[0]; }
inline pkv_u32 pkv_bid_y() { return pkv_emu::thread_state().block[1]; }
inline pkv_u32 pkv_bid_z() { return pkv_emu::thread_state().block[2]; }
inline pkv_u32 pkv_nbid_x() { return pkv_emu::thread_state().grid[0]; }
inline pkv_u32 pkv_nbid_y() { return pkv_emu::thread_state().grid[1]; }
inline pkv_u32 pkv_nbid_z() { return pkv_emu::thread_state().grid[2]; }

inline void pkv_sync() { pkv_emu::sync_block(); }
inline void pkv_sync_warp() { pkv_emu::sync_warp(); }

inline pkv_u32 pkv_float_bits(float f) {
  pkv_u32 u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float pkv_bits_float(pkv_u32 u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float pkv_shfl_xor(float v, int lane_mask) {
  return pkv_bits_float(pkv_emu::shuffle_xor(pkv_float_bits(v), lane_mask));
}
inline pkv_u32 pkv_shfl_xor_u32(pkv_u32 v, int lane_mask) { return pkv_emu::shuffle_xor(v, lane_mask); }
inline float pkv_shfl_idx(float v, int src_lane) { return pkv_bits_float(pkv_emu::shuffle_idx(pkv_float_bits(v), src_lane)); }

// volatile: keeps g++ from contracting a product and a sum into an FMA
// (it does not at -ffp-contract=off, the default for ISO C++, but the
// kernels promise the same on every compiler).
inline float pkv_mul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float pkv_div_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}
inline float pkv_add_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float pkv_rint(float x) { return std::nearbyint(x); }
inline float pkv_exp(float x) { return std::exp(x); }
inline float pkv_tanh(float x) { return std::tanh(x); }
inline float pkv_fabs(float x) { return std::fabs(x); }
inline pkv_u32 pkv_byte_perm(pkv_u32 a, pkv_u32 b, pkv_u32 selector) {
  const pkv_u64 bytes = (static_cast<pkv_u64>(b) << 32) | a;
  pkv_u32 r = 0;
  for (int i = 0; i < 4; ++i) {
    const pkv_u32 pick = (selector >> (4 * i)) & 7u;
    r |= static_cast<pkv_u32>((bytes >> (8 * pick)) & 0xFFu) << (8 * i);
  }
  return r;
}
inline float pkv_half_to_float_fast(pkv_u16 h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

template <class T>
inline T pkv_emu_load(const void* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % sizeof(T) != 0) pkv_emu::misaligned(p, sizeof(T));
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
inline void pkv_emu_store(void* p, const T& v) {
  if (reinterpret_cast<std::uintptr_t>(p) % sizeof(T) != 0) pkv_emu::misaligned(p, sizeof(T));
  std::memcpy(p, &v, sizeof(T));
}
inline pkv_v16 pkv_load_v16(const void* p) { return pkv_emu_load<pkv_v16>(p); }
inline pkv_v8 pkv_load_v8(const void* p) { return pkv_emu_load<pkv_v8>(p); }
inline pkv_u32 pkv_load_u32(const void* p) { return pkv_emu_load<pkv_u32>(p); }
inline pkv_u16 pkv_load_u16(const void* p) { return pkv_emu_load<pkv_u16>(p); }
inline pkv_u8 pkv_load_u8(const void* p) { return pkv_emu_load<pkv_u8>(p); }
inline pkv_u64 pkv_load_u64(const void* p) { return pkv_emu_load<pkv_u64>(p); }
inline pkv_i64 pkv_load_i64(const void* p) { return pkv_emu_load<pkv_i64>(p); }
inline pkv_i32 pkv_load_i32(const void* p) { return pkv_emu_load<pkv_i32>(p); }
inline void pkv_store_v16(void* p, pkv_v16 v) { pkv_emu_store(p, v); }
inline void pkv_store_v8(void* p, pkv_v8 v) { pkv_emu_store(p, v); }
inline void pkv_store_u32(void* p, pkv_u32 v) { pkv_emu_store(p, v); }
inline void pkv_store_u16(void* p, pkv_u16 v) { pkv_emu_store(p, v); }
inline void pkv_store_u8(void* p, pkv_u8 v) { pkv_emu_store(p, v); }
inline void pkv_store_u64(void* p, pkv_u64 v) { pkv_emu_store(p, v); }
