// The CUDA kernels compiled for the CPU emulator, once for every test that
// runs them (cuda_emulator/kernels.cpp, a library of the test build: each
// kernel template takes g++ seconds to instantiate).
#pragma once

#include "cuda_emulator/emulator.hpp"

namespace pkv_emu {

/// An emulator with every kernel instantiation the tests launch: write,
/// gather and page copies (every dtype and format), prefill and merge, and
/// the decode kernels listed in kernels.cpp. Each call returns a new one
/// (its own SM count and launch record).
EmulatedExecutor kernels();

}  // namespace pkv_emu
