// A CPU emulation of CUDA grids, for running pagedkv's kernel sources in an
// ordinary test without a GPU (prelude.hpp is the dialect it implements).
//
// Blocks run one after another. The threads of a block are fibers
// (ucontext) on the calling thread, run in turn: each runs until it reaches
// a barrier (pkv_sync, pkv_sync_warp, a shuffle) or returns; a barrier
// opens when every thread it spans waits at it. A barrier that can never
// open (some threads at another barrier, or already returned) fails the
// launch, as do misaligned vector accesses: stricter than the hardware,
// which leaves both undefined. Shared memory starts as 0xFF bytes.
//
// EmulatedExecutor runs pagedkv::cuda::Launch objects, the same ones the
// GPU executor gets, through a registry of the kernel instantiations a
// test compiled (PKV_EMULATE / PKV_EMULATE_PLAIN): the name the host
// planner asks for must be registered, else the launch fails naming it.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emulator/prelude.hpp"
#include "pagedkv/cuda/launch.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define PKV_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PKV_EMU_ASAN 1
#endif
#endif
#ifndef PKV_EMU_ASAN
#define PKV_EMU_ASAN 0
#endif
#if PKV_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace pkv_emu {

/// A kernel instantiation compiled into the test: runs the body on the
/// calling (emulated) thread with the launch's parameter struct.
using Invoker = void (*)(const void* params);

enum class Wait : uint8_t { none, block, warp, done };

struct Fiber {
  ucontext_t context;
  void* stack = nullptr;
  ThreadState state;
  Wait wait = Wait::none;
  std::size_t shared_cursor = 0;
  uint32_t shuffles = 0;  ///< shuffles done: picks the exchange bank
  void* fake_stack = nullptr;  ///< AddressSanitizer's, while switched out
};

/// The emulator of one OS thread: its fibers (stacks reused between
/// launches) and the block being run.
class Emulation {
 public:
  static constexpr std::size_t kStackBytes = std::size_t{512} << 10;
  static constexpr std::size_t kStaticSharedBytes = std::size_t{48} << 10;  // CUDA's static limit

  static Emulation& local() {
    thread_local Emulation emulation;
    return emulation;
  }

  Emulation() = default;
  Emulation(const Emulation&) = delete;
  Emulation& operator=(const Emulation&) = delete;
  ~Emulation() {
    for (Fiber& f : fibers_) {
      if (f.stack != nullptr) munmap(f.stack, kStackBytes);
    }
  }

  /// Runs every block of a grid of `grid` blocks of `threads` threads.
  void run(Invoker invoker, const void* params, const pagedkv::cuda::Dim3& grid, uint32_t threads,
           std::size_t dynamic_bytes) {
    if (threads == 0 || threads % 32 != 0 || threads > 1024) {
      throw std::runtime_error("emulator: blocks of " + std::to_string(threads) +
                               " threads (expected a multiple of 32, at most 1024)");
    }
    invoker_ = invoker;
    params_ = params;
    error_.clear();
    while (fibers_.size() < threads) {
      fibers_.emplace_back();
      void* stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                         -1, 0);
      if (stack == MAP_FAILED) throw std::runtime_error("emulator: cannot map a fiber stack");
      fibers_.back().stack = stack;
    }
    shared_.assign(kStaticSharedBytes, 0);
    dynamic_.assign(dynamic_bytes, 0);
    exchange_.assign(threads / 32, {});
    for (uint32_t z = 0; z < grid.z; ++z)
      for (uint32_t y = 0; y < grid.y; ++y)
        for (uint32_t x = 0; x < grid.x; ++x) {
          run_block({x, y, z}, grid, threads);
          if (!error_.empty()) {
            throw std::runtime_error("emulator: block (" + std::to_string(x) + ", " + std::to_string(y) + ", " +
                                     std::to_string(z) + "): " + error_);
          }
        }
  }

  Fiber& running() { return *running_; }
  void* shared_bytes(std::size_t bytes) {
    Fiber& f = running();
    const std::size_t at = (f.shared_cursor + 15) & ~std::size_t{15};
    if (at + bytes > shared_.size()) {
      fail("static shared memory over " + std::to_string(shared_.size()) + " bytes");
      return shared_.data();
    }
    f.shared_cursor = at + bytes;
    return shared_.data() + at;
  }
  void* dynamic_shared() { return dynamic_.data(); }

  void barrier(Wait kind) {
    Fiber& f = running();
    f.wait = kind;
    switch_to_scheduler(f, /*finished=*/false);
  }

  uint32_t shuffle(uint32_t bits, int partner_lane) {
    Fiber& f = running();
    const uint32_t lane = f.state.tid % 32;
    auto& banks = exchange_[f.state.tid / 32];
    const uint32_t bank = (f.shuffles++ & 1u) * 32;
    banks[bank + lane] = bits;
    barrier(Wait::warp);
    if (partner_lane < 0 || partner_lane >= 32) {
      fail("shuffle from lane " + std::to_string(partner_lane));
      return bits;
    }
    return banks[bank + static_cast<uint32_t>(partner_lane)];
  }

  void fail(const std::string& message) {
    if (error_.empty()) error_ = message;
  }

 private:
  static void fiber_main() {
    Emulation& e = local();
#if PKV_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &e.scheduler_stack_, &e.scheduler_stack_size_);
#endif
    e.invoker_(e.params_);
    e.switch_to_scheduler(e.running(), /*finished=*/true);
  }

  void switch_to_scheduler(Fiber& f, bool finished) {
    if (finished) f.wait = Wait::done;
#if PKV_EMU_ASAN
    __sanitizer_start_switch_fiber(finished ? nullptr : &f.fake_stack, scheduler_stack_, scheduler_stack_size_);
#endif
    swapcontext(&f.context, &scheduler_);
#if PKV_EMU_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, &scheduler_stack_, &scheduler_stack_size_);
#endif
  }

  void resume(Fiber& f) {
    running_ = &f;
#if PKV_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
    swapcontext(&scheduler_, &f.context);
#if PKV_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    running_ = nullptr;
  }

  void run_block(const pagedkv::cuda::Dim3& block, const pagedkv::cuda::Dim3& grid, uint32_t threads) {
    std::memset(shared_.data(), 0xFF, shared_.size());
    if (!dynamic_.empty()) std::memset(dynamic_.data(), 0xFF, dynamic_.size());
    for (uint32_t t = 0; t < threads; ++t) {
      Fiber& f = fibers_[t];
      f.state.tid = t;
      f.state.block[0] = block.x;
      f.state.block[1] = block.y;
      f.state.block[2] = block.z;
      f.state.block_threads = threads;
      f.state.grid[0] = grid.x;
      f.state.grid[1] = grid.y;
      f.state.grid[2] = grid.z;
      f.wait = Wait::none;
      f.shared_cursor = 0;
      f.shuffles = 0;
      f.fake_stack = nullptr;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = &scheduler_;
      makecontext(&f.context, &Emulation::fiber_main, 0);
    }
    uint32_t remaining = threads;
    while (remaining > 0) {
      for (uint32_t t = 0; t < threads; ++t) {
        Fiber& f = fibers_[t];
        if (f.wait != Wait::none) continue;
        resume(f);
        if (f.wait == Wait::done) --remaining;
      }
      if (remaining == 0 || !error_.empty()) return;
      if (!open_barriers(threads, remaining)) return;
    }
  }

  /// Opens the barriers every thread they span waits at; false (and an
  /// error) when none can open.
  bool open_barriers(uint32_t threads, uint32_t remaining) {
    bool opened = false;
    for (uint32_t w = 0; w < threads / 32; ++w) {
      uint32_t at_warp = 0, done = 0;
      for (uint32_t l = 0; l < 32; ++l) {
        const Wait wait = fibers_[w * 32 + l].wait;
        at_warp += wait == Wait::warp ? 1 : 0;
        done += wait == Wait::done ? 1 : 0;
      }
      if (at_warp == 32) {
        for (uint32_t l = 0; l < 32; ++l) fibers_[w * 32 + l].wait = Wait::none;
        opened = true;
      } else if (at_warp > 0 && done > 0) {
        fail("warp " + std::to_string(w) + ": " + std::to_string(at_warp) + " lanes at a warp barrier or shuffle, " +
             std::to_string(done) + " lanes already returned");
        return false;
      }
    }
    if (opened) return true;
    uint32_t at_block = 0;
    for (uint32_t t = 0; t < threads; ++t) at_block += fibers_[t].wait == Wait::block ? 1 : 0;
    if (at_block == threads) {
      for (uint32_t t = 0; t < threads; ++t) fibers_[t].wait = Wait::none;
      return true;
    }
    std::ostringstream os;
    os << "deadlock: " << at_block << " threads at pkv_sync, " << remaining - at_block
       << " at warp barriers or shuffles that cannot open, " << threads - remaining << " returned";
    fail(os.str());
    return false;
  }

  std::vector<Fiber> fibers_;
  ucontext_t scheduler_{};
  Fiber* running_ = nullptr;
  Invoker invoker_ = nullptr;
  const void* params_ = nullptr;
  std::vector<unsigned char> shared_;
  std::vector<unsigned char> dynamic_;
  std::vector<std::array<uint32_t, 64>> exchange_;  // per warp: two banks of 32 lanes
  std::string error_;
  const void* scheduler_stack_ = nullptr;
  std::size_t scheduler_stack_size_ = 0;
};

inline const ThreadState& thread_state() { return Emulation::local().running().state; }
inline void* shared_bytes(std::size_t bytes) { return Emulation::local().shared_bytes(bytes); }
inline void* dynamic_shared() { return Emulation::local().dynamic_shared(); }
inline void sync_block() { Emulation::local().barrier(Wait::block); }
inline void sync_warp() { Emulation::local().barrier(Wait::warp); }
inline uint32_t shuffle_xor(uint32_t bits, int lane_mask) {
  return Emulation::local().shuffle(bits, static_cast<int>(thread_state().tid % 32) ^ lane_mask);
}
inline uint32_t shuffle_idx(uint32_t bits, int src_lane) { return Emulation::local().shuffle(bits, src_lane); }
inline void misaligned(const void* p, std::size_t bytes) {
  std::ostringstream os;
  os << "misaligned " << bytes << "-byte access at " << p << " (thread " << thread_state().tid << ")";
  Emulation::local().fail(os.str());
}

/// One registered kernel instantiation.
struct Registration {
  std::string name;  ///< KernelKey::name()
  Invoker invoker;
};

/// A pagedkv::cuda::Executor on the CPU: runs each launch's kernel, by
/// name, from the instantiations registered with add().
class EmulatedExecutor : public pagedkv::cuda::Executor {
 public:
  explicit EmulatedExecutor(int sm_count = 4) : sm_count_(sm_count) {}

  void add(const Registration& r) { kernels_[r.name] = r.invoker; }

  void launch(const pagedkv::cuda::Launch& l) override {
    const std::string name = l.kernel.name();
    const auto it = kernels_.find(name);
    if (it == kernels_.end()) throw std::runtime_error("emulator: kernel " + name + " is not registered (PKV_EMULATE)");
    if (l.params_bytes > sizeof(params_)) throw std::runtime_error("emulator: parameters over 4 KiB");
    if (static_cast<int>(l.shared_bytes) > max_shared_bytes()) {
      throw std::runtime_error("emulator: " + std::to_string(l.shared_bytes) + " bytes of dynamic shared memory");
    }
    std::memcpy(params_, l.params, l.params_bytes);
    launched.push_back(name + " grid " + std::to_string(l.grid.x) + "x" + std::to_string(l.grid.y) + "x" +
                       std::to_string(l.grid.z) + " shared " + std::to_string(l.shared_bytes));
    Emulation::local().run(it->second, params_, l.grid, static_cast<uint32_t>(l.kernel.block_threads), l.shared_bytes);
  }
  int sm_count() const override { return sm_count_; }
  int max_shared_bytes() const override { return 227 << 10; }
  void set_sm_count(int n) { sm_count_ = n; }

  std::vector<std::string> launched;  ///< the kernels run, in order: "name grid XxYxZ shared N"

 private:
  std::map<std::string, Invoker> kernels_;
  int sm_count_;
  alignas(16) unsigned char params_[4096] = {};
};

}  // namespace pkv_emu

/// A Registration of pkv::body<args...> taking a `Params`.
#define PKV_EMULATE(body, Params, ...)                                                                    \
  ::pkv_emu::Registration {                                                                               \
    ::pagedkv::cuda::kernel(#body, #Params, 0, {__VA_ARGS__}).name(),                                    \
        [](const void* p) { ::pkv::body<__VA_ARGS__>(*static_cast<const ::pkv::Params*>(p)); }           \
  }
/// A Registration of the plain function pkv::body taking a `Params`.
#define PKV_EMULATE_PLAIN(body, Params) \
  ::pkv_emu::Registration { #body, [](const void* p) { ::pkv::body(*static_cast<const ::pkv::Params*>(p)); } }
