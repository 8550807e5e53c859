// warn_if_reference_blas: one line on stderr when torch multiplies on the
// reference (netlib) BLAS.
//
// Debian's libtorch calls sgemm_ in libblas.so.3, which Debian's alternatives
// resolve to the reference BLAS unless an optimized one is installed: every
// matmul then runs about 25x slower than on OpenBLAS (bench/NOTES.md,
// "Debian's torch and its BLAS"), with no error anywhere. The build warns at
// configure time (cmake/pagedkvBlasCheck.cmake), but a binary may run where
// the alternatives (or LD_LIBRARY_PATH) differ, so the examples that run
// models check the library actually loaded. Examples only: pagedkv itself
// never multiplies matrices.
#pragma once

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace examples {

// The real path of the library whose sgemm_ this process binds, as torch's
// calls do (the global lookup scope: RTLD_DEFAULT), or "" when none defines
// it (pip's torch carries its own BLAS, linked in and not exported).
inline std::string loaded_blas_path() {
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (sgemm == nullptr || dladdr(sgemm, &info) == 0 || info.dli_fname == nullptr) return "";
  // dli_fname is the name the loader opened: /lib/<triplet>/libblas.so.3, the
  // alternatives' link, whose target says which BLAS it is.
  char* real = realpath(info.dli_fname, nullptr);
  if (real == nullptr) return info.dli_fname;
  std::string path(real);
  std::free(real);
  return path;
}

// Debian's reference BLAS (package libblas3) is the one alternative kept in a
// folder named blas: /usr/lib/<triplet>/blas/libblas.so.3.*; OpenBLAS, BLIS
// and ATLAS live in openblas-pthread/, blis-openmp/, atlas/ and so on. The
// same rule as cmake/pagedkvBlasCheck.cmake's.
inline bool is_reference_blas(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos || slash < 5) return false;
  return path.compare(slash - 5, 6, "/blas/") == 0 && path.compare(slash + 1, 10, "libblas.so") == 0;
}

// Call once, before the first matmul; `program` prefixes the line.
inline void warn_if_reference_blas(const char* program) {
  const std::string blas = loaded_blas_path();
  if (is_reference_blas(blas)) {
    std::fprintf(stderr,
                 "%s: warning: torch multiplies on the reference BLAS (%s), about 25x slower than OpenBLAS: "
                 "apt-get install libopenblas0-openmp\n",
                 program, blas.c_str());
  }
}

}  // namespace examples
