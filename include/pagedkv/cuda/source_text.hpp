// A piece of CUDA kernel source held as text in a header: pagedkv stays
// header-only and compiles its kernels at run time with NVRTC
// (cuda/nvrtc.hpp, over the program cuda/program.hpp assembles). The same text is compiled as host C++ by the tests'
// CPU emulator (tests/cuda_emulator/), which extracts it from the header at
// build time: there is never a second copy of a kernel.
#pragma once

namespace pagedkv {
namespace cuda {

/// Kernel source text and where it sits, so that compiler messages (NVRTC's
/// and g++'s, in the emulator) name the header's own lines.
struct SourceText {
  const char* file;  ///< the header, relative to include/
  int line;          ///< line of `file` holding the text's first line
  const char* text;  ///< the source, in the kernel dialect (sources/prelude.hpp)
};

}  // namespace cuda
}  // namespace pagedkv
