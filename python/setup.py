"""Builds pagedkv._C with torch.utils.cpp_extension against the installed torch.

The C++ library is header-only; the extension compiles it from the
repository's include/ folder (this file's ../include), so the package builds
from a checkout: `pip install --no-build-isolation ./python` (pip builds a
local folder in place). PAGEDKV_INCLUDE names another folder holding
pagedkv/pagedkv.hpp. PAGEDKV_WERROR=1 turns warnings in pagedkv's own
sources into errors (the project's make targets set it). PAGEDKV_OPT
replaces the optimisation flag (default -O3; CI builds the tests at -O1,
bench/NOTES.md "CI time": the same code paths, a third of the compile time).

Against a CUDA build of torch, with the CUDA toolkit's headers found
(torch's CUDA_HOME), the extension defines PAGEDKV_WITH_CUDA=1 and links
torch's CUDA libraries, as pagedkv's CMake target does: CUDA tensors then run
the CUDA kernels (compiled at run time by NVRTC; no nvcc is used here).
PAGEDKV_PY_CUDA=0 builds without them (CUDA tensors take the ATen path).
"""
import os
import sys
import sysconfig

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension, include_paths
except ImportError:
    sys.exit(
        "pagedkv: building the extension needs torch importable in this environment, and it is not.\n"
        "The extension must be compiled against the torch it will run with, so build without pip's\n"
        "isolated build environment:  pip install --no-build-isolation ./python"
    )

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.environ.get("PAGEDKV_INCLUDE", os.path.join(HERE, "..", "include"))
if not os.path.isfile(os.path.join(INCLUDE, "pagedkv", "pagedkv.hpp")):
    sys.exit(
        "pagedkv: no pagedkv/pagedkv.hpp under %s. Build from a checkout of the repository "
        "(pip install --no-build-isolation ./python), or set PAGEDKV_INCLUDE to pagedkv's include/ folder." % INCLUDE
    )

TORCH_MAJOR = int(torch.__version__.split(".")[0])

OPT = os.environ.get("PAGEDKV_OPT", "-O3")
if OPT not in ("-O0", "-O1", "-O2", "-O3", "-Os"):
    sys.exit("pagedkv: PAGEDKV_OPT must be one of -O0 -O1 -O2 -O3 -Os, got %r" % OPT)

cxx_flags = [
    OPT,
    "-g0",  # Python's own CFLAGS bring -g: debug info triples the object size and slows the build
    "-DNDEBUG",
    # at::parallel_for with ATen's OpenMP backend is an inline template: the
    # kernels run in parallel only in code compiled with OpenMP.
    "-fopenmp",
    "-Wall",
    "-Wextra",
    "-Wpedantic",
]
if TORCH_MAJOR < 2:
    cxx_flags.append("-std=c++17")  # torch 1.x's default is C++14; 2.x sets its own (C++17 or later)
# torch's and Python's headers are system headers: their warnings are not pagedkv's.
for path in include_paths() + [sysconfig.get_paths()["include"]]:
    cxx_flags += ["-isystem", path]
if os.environ.get("PAGEDKV_WERROR") == "1":
    cxx_flags.append("-Werror")

WITH_CUDA = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("PAGEDKV_PY_CUDA") != "0"
if WITH_CUDA:
    cxx_flags.append("-DPAGEDKV_WITH_CUDA=1")
    try:
        cuda_paths = include_paths(device_type="cuda")  # torch >= 2.6
    except TypeError:
        cuda_paths = include_paths(cuda=True)
    for path in cuda_paths:
        cxx_flags += ["-isystem", path]
Extension = CUDAExtension if WITH_CUDA else CppExtension

# The attention kernel's instances first: they take longest (ninja starts them first).
SOURCES = ["attention_f32.cpp", "attention_f16.cpp", "attention_bf16.cpp", "module.cpp", "cache.cpp",
           "attention.cpp", "sequences.cpp"]

setup(
    ext_modules=[
        Extension(
            "pagedkv._C",
            [os.path.join("src", s) for s in SOURCES],
            include_dirs=[os.path.abspath(INCLUDE)],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
            depends=[os.path.join("src", h) for h in ("attention_kernel.hpp", "handles.hpp", "op_checks.hpp",
                                                      "stateless.hpp")],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    # One build folder per torch: switching torches rebuilds nothing the other one built.
    options={"build": {"build_base": os.path.join("build", "torch-" + torch.__version__)}},
)
