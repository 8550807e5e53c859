# The BLAS that torch multiplies on, checked at configure time.
#
# Debian's libtorch calls sgemm_ in libblas.so.3, which Debian's alternatives
# resolve to the reference (netlib) BLAS unless an optimized one is installed:
# every matmul then runs about 25x slower than on OpenBLAS (bench/NOTES.md,
# "Debian's torch and its BLAS"), with no error anywhere. The examples warn
# at run time too (examples/blas_check.hpp); this warns before the build.
#
# pagedkv_check_torch_blas(): asks the loader (ldd) what torch_cpu's
# libblas.so.3 resolves to and prints one warning, never an error, when it is
# the reference one. Sets PAGEDKV_TORCH_BLAS to the real path of that
# library, or "" for a torch that does not link libblas.so.3 (pip's carries
# its own BLAS) or where ldd is missing.
#
# In script mode it checks the library given as PAGEDKV_TORCH_CPU, so that a
# test can run the same rule with LD_LIBRARY_PATH forcing a BLAS:
#   cmake -DPAGEDKV_TORCH_CPU=/usr/lib/x86_64-linux-gnu/libtorch_cpu.so.1.13 -P cmake/pagedkvBlasCheck.cmake
if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  cmake_minimum_required(VERSION 3.21)  # the project's policies, which a script does not inherit
endif()

# The real path of the libblas.so.3 that the loader gives torch_cpu_file, or "".
function(pagedkv_resolve_torch_blas torch_cpu_file out_var)
  set(blas "")
  find_program(PAGEDKV_LDD ldd)
  mark_as_advanced(PAGEDKV_LDD)
  if(torch_cpu_file AND PAGEDKV_LDD)
    execute_process(COMMAND "${PAGEDKV_LDD}" "${torch_cpu_file}" OUTPUT_VARIABLE deps ERROR_QUIET RESULT_VARIABLE rc)
    # "=> /path", not "=> not found" (then torch cannot load at all; nothing to warn about here).
    if(rc EQUAL 0 AND deps MATCHES "libblas\\.so\\.3 => (/[^ \t\n]+)")
      file(REAL_PATH "${CMAKE_MATCH_1}" blas)
    endif()
  endif()
  set(${out_var} "${blas}" PARENT_SCOPE)
endfunction()

# Debian's reference BLAS (package libblas3) is the one alternative kept in a
# folder named blas: /usr/lib/<triplet>/blas/libblas.so.3.*; OpenBLAS, BLIS
# and ATLAS live in openblas-pthread/, blis-openmp/, atlas/ and so on.
# The same rule as blas_check.hpp's is_reference_blas.
function(pagedkv_warn_if_reference_blas blas_file)
  get_filename_component(dir "${blas_file}" DIRECTORY)
  get_filename_component(dir_name "${dir}" NAME)
  get_filename_component(file_name "${blas_file}" NAME)
  if(dir_name STREQUAL "blas" AND file_name MATCHES "^libblas\\.so")
    message(WARNING "torch multiplies on the reference BLAS (${blas_file}), about 25x slower than OpenBLAS: "
                    "apt-get install libopenblas0-openmp")
  endif()
endfunction()

function(pagedkv_check_torch_blas)
  set(torch_cpu_file "")
  if(TARGET torch_cpu)
    # Debian's torch imports it for RelWithDebInfo, pip's for Release.
    get_target_property(configs torch_cpu IMPORTED_CONFIGURATIONS)
    if(configs)
      foreach(config IN LISTS configs)
        get_target_property(torch_cpu_file torch_cpu IMPORTED_LOCATION_${config})
        if(torch_cpu_file)
          break()
        endif()
      endforeach()
    endif()
    if(NOT torch_cpu_file)
      get_target_property(torch_cpu_file torch_cpu IMPORTED_LOCATION)
    endif()
  endif()
  pagedkv_resolve_torch_blas("${torch_cpu_file}" blas)
  pagedkv_warn_if_reference_blas("${blas}")
  set(PAGEDKV_TORCH_BLAS "${blas}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  pagedkv_resolve_torch_blas("${PAGEDKV_TORCH_CPU}" blas)
  if(NOT blas)
    message(FATAL_ERROR "${PAGEDKV_TORCH_CPU} does not link a libblas.so.3 that ldd finds")
  endif()
  message(STATUS "libblas.so.3: ${blas}")
  pagedkv_warn_if_reference_blas("${blas}")
endif()
