// What the host hands a kernel launch: which kernel (its body in the
// sources and its template arguments), the grid, the block, dynamic shared
// memory and the parameter struct. An Executor runs launches: on a GPU the
// one in cuda/device_executor.hpp (NVRTC + the driver API, on the current
// stream), in the tests the CPU emulator (tests/cuda_emulator/). Everything
// that decides a launch (planners in cuda/write_gather.hpp, page_copy.hpp,
// attention.hpp) is device-agnostic host code, shared by both.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace pagedkv {
namespace cuda {

/// A kernel: the function `pkv::<body>` of the sources, with template
/// arguments `args` (empty for a plain function), run by blocks of
/// `block_threads` threads (its __launch_bounds__).
struct KernelKey {
  const char* body = "";          ///< the function in namespace pkv
  const char* params = "";        ///< its parameter struct (kernel_params)
  std::array<int, 6> args{};      ///< template arguments
  int n_args = 0;                 ///< how many of `args` are used
  int block_threads = 0;          ///< threads per block

  /// The call expression after "pkv::": body<arg, arg, ...>.
  std::string name() const {
    std::string s = body;
    if (n_args == 0) return s;
    s += '<';
    for (int i = 0; i < n_args; ++i) s += (i > 0 ? ", " : "") + std::to_string(args[static_cast<size_t>(i)]);
    return s + '>';
  }
  /// The extern "C" entry point that runs it: pkv_<body>_<arg>_<arg>...
  std::string entry() const {
    std::string s = std::string("pkv_") + body;
    for (int i = 0; i < n_args; ++i) s += '_' + std::to_string(args[static_cast<size_t>(i)]);
    return s;
  }
  bool operator==(const KernelKey& o) const { return name() == o.name() && block_threads == o.block_threads; }
};

/// A kernel key with template arguments.
inline KernelKey kernel(const char* body, const char* params, int block_threads, std::initializer_list<int> args = {}) {
  KernelKey k;
  k.body = body;
  k.params = params;
  k.block_threads = block_threads;
  TORCH_CHECK(args.size() <= k.args.size(), "pagedkv::cuda::kernel: too many template arguments for ", body);
  for (const int a : args) k.args[static_cast<size_t>(k.n_args++)] = a;
  return k;
}

struct Dim3 {
  uint32_t x = 1;
  uint32_t y = 1;
  uint32_t z = 1;
};

/// One kernel launch.
struct Launch {
  KernelKey kernel;
  Dim3 grid;
  uint32_t shared_bytes = 0;  ///< dynamic shared memory
  const void* params = nullptr;
  size_t params_bytes = 0;
};

/// Runs launches, in order, on one device (the GPU's current stream, or
/// the emulator's CPU).
class Executor {
 public:
  virtual ~Executor() = default;
  /// Enqueues `launch` (the GPU) or runs it (the emulator). `params` is
  /// copied before this returns.
  virtual void launch(const Launch& launch) = 0;
  /// Streaming multiprocessors: how many blocks make the device busy.
  virtual int sm_count() const = 0;
  /// The most dynamic shared memory one block may use.
  virtual int max_shared_bytes() const = 0;
};

template <class Params>
Launch make_launch(const KernelKey& kernel, Dim3 grid, const Params& params, uint32_t shared_bytes = 0) {
  Launch l;
  l.kernel = kernel;
  l.grid = grid;
  l.shared_bytes = shared_bytes;
  l.params = &params;
  l.params_bytes = sizeof(Params);
  return l;
}

/// Blocks a grid-stride kernel needs for `items` items at `per_block` a
/// block, capped (the kernels loop over the rest): at least 1.
inline uint32_t blocks_for(int64_t items, int64_t per_block) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<uint32_t>(std::max<int64_t>(1, std::min(blocks, kMaxBlocks)));
}

/// The widest move (16, 8, 4, 2 or 1 bytes) that every one of `values`
/// (sizes, strides, addresses) is a multiple of.
inline int64_t widest_move(std::initializer_list<uint64_t> values) {
  uint64_t all = 16;
  for (const uint64_t v : values) all |= v;
  return static_cast<int64_t>(all & (~all + 1));  // lowest set bit: 1 .. 16
}

/// Threads per item: a power of two <= 32 with at most one idle round
/// for `moves` moves.
inline int64_t lanes_for(int64_t moves) {
  int64_t lanes = 1;
  while (lanes < 32 && lanes < moves) lanes *= 2;
  return lanes;
}

/// log2(page_size) for a power of two, else -1.
inline int64_t page_shift(int64_t page_size) {
  if ((page_size & (page_size - 1)) != 0) return -1;
  int64_t shift = 0;
  while ((int64_t{1} << shift) < page_size) ++shift;
  return shift;
}

}  // namespace cuda
}  // namespace pagedkv
