// The text of an NVRTC program: the dialect's device prelude, the
// parameter structs (rendered from params.hpp, with the host's sizes
// asserted), every kernel source, and one extern "C" __global__ entry
// point per kernel asked for, which calls the kernel's body with the
// parameter struct (its only argument, by value).
#pragma once

#include <string>
#include <vector>

#include "pagedkv/cuda/launch.hpp"
#include "pagedkv/cuda/params.hpp"
#include "pagedkv/cuda/source_text.hpp"
#include "pagedkv/cuda/sources/attention.hpp"
#include "pagedkv/cuda/sources/common.hpp"
#include "pagedkv/cuda/sources/page_copy.hpp"
#include "pagedkv/cuda/sources/prelude.hpp"
#include "pagedkv/cuda/sources/write_gather.hpp"
#include "pagedkv/cuda/sources/quant.hpp"

namespace pagedkv {
namespace cuda {

/// `text` behind a #line directive naming its header's lines.
inline std::string with_line(const SourceText& text) {
  return "#line " + std::to_string(text.line) + " \"" + text.file + "\"\n" + text.text + "\n";
}

/// The entry point of `k`: extern "C", bounded to its block size.
inline std::string entry_source(const KernelKey& k) {
  return "extern \"C\" __global__ void __launch_bounds__(" + std::to_string(k.block_threads) + ") " + k.entry() +
         "(const pkv::" + k.params + " p) { pkv::" + k.name() + "(p); }\n";
}

/// A program defining the entry points of `kernels`.
inline std::string program_source(const std::vector<KernelKey>& kernels) {
  std::string s = with_line(sources::kPrelude);
  s += "#line 1 \"pagedkv/cuda/params.hpp (rendered)\"\n" + params::params_source();
  for (const SourceText* text : {&sources::kCommon, &sources::kWriteGather, &sources::kPageCopy, &sources::kQuant,
                                    &sources::kAttention}) {
    s += with_line(*text);
  }
  s += "#line 1 \"pagedkv entry points\"\n";
  for (const KernelKey& k : kernels) s += entry_source(k);
  return s;
}

}  // namespace cuda
}  // namespace pagedkv
