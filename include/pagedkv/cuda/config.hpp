// PAGEDKV_WITH_CUDA: 1 when the program is built against a CUDA build of
// libtorch, 0 (the default) otherwise. pagedkv's CMake target sets it from
// what find_package(Torch) found (a CUDA build has the c10_cuda target); a
// program built without CMake defines it itself (-DPAGEDKV_WITH_CUDA=1),
// with the CUDA headers TorchConfig would add on the include path. It must
// have the same value in every translation unit of a program: it decides
// which headers are included, never two bodies of one inline function
// (with 0, caches on CUDA devices take the device-agnostic ATen path).
// It is a macro rather than a __has_include test: a CPU-only libtorch
// (Debian's 1.13) ships ATen/cuda headers too.
#pragma once

#ifndef PAGEDKV_WITH_CUDA
#define PAGEDKV_WITH_CUDA 0
#endif
