# Warnings are errors in pagedkv's own targets (tests, benchmarks, examples).
# libtorch's headers come in as system headers, so their warnings are not ours.
function(pagedkv_project_target target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Werror)
  target_link_libraries(${target} PRIVATE pagedkv::pagedkv)
endfunction()
