# The reference-BLAS warning's test driver (examples/blas_check.hpp at run
# time, cmake/pagedkvBlasCheck.cmake at configure time):
#
#   cmake -DPROGRAM=... "-DARGS=--steps 1" -DBLAS_DIR=/usr/lib/<triplet>/blas -DEXPECT=warn
#         [-DEXIT_CODE=0] -P check_blas_warning.cmake
#
# Runs PROGRAM ARGS with LD_LIBRARY_PATH=BLAS_DIR, which the loader searches
# before Debian's alternatives, so torch gets that folder's libblas.so.3.
# EXPECT=warn: the output must hold the warning with its fix exactly once;
# EXPECT=quiet: no warning. Either way the exit code must be EXIT_CODE.
foreach(var PROGRAM BLAS_DIR EXPECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_blas_warning.cmake: -D${var}= is required")
  endif()
endforeach()
if(NOT DEFINED EXIT_CODE)
  set(EXIT_CODE 0)
endif()
# A missing folder would leave the alternatives' BLAS in place: a quiet run
# would then prove nothing.
if(NOT EXISTS "${BLAS_DIR}/libblas.so.3")
  message(FATAL_ERROR "${BLAS_DIR}/libblas.so.3 is missing; this test forces it "
                      "(Debian: apt-get install libblas3 libopenblas0-openmp, as `make deps` does)")
endif()
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND "${CMAKE_COMMAND}" -E env "LD_LIBRARY_PATH=${BLAS_DIR}" "${PROGRAM}" ${args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
# [ \n]+: CMake wraps its warnings' lines.
string(REGEX MATCHALL "reference[ \n]+BLAS" warnings "${all}")
list(LENGTH warnings n_warnings)
if(NOT rc STREQUAL EXIT_CODE)
  message(FATAL_ERROR "${PROGRAM} ${ARGS} with LD_LIBRARY_PATH=${BLAS_DIR}: exit ${rc}, expected ${EXIT_CODE}:\n${all}")
endif()
if(EXPECT STREQUAL "warn")
  if(NOT n_warnings EQUAL 1 OR NOT all MATCHES "apt-get[ \n]+install[ \n]+libopenblas0-openmp")
    message(FATAL_ERROR "with LD_LIBRARY_PATH=${BLAS_DIR}, expected one reference-BLAS warning naming "
                        "`apt-get install libopenblas0-openmp`, got ${n_warnings}:\n${all}")
  endif()
elseif(EXPECT STREQUAL "quiet")
  if(NOT n_warnings EQUAL 0)
    message(FATAL_ERROR "with LD_LIBRARY_PATH=${BLAS_DIR}, expected no reference-BLAS warning:\n${all}")
  endif()
else()
  message(FATAL_ERROR "check_blas_warning.cmake: EXPECT is warn or quiet, not '${EXPECT}'")
endif()
