# Finds libtorch so that its imported targets are visible to the whole build.
#
# find_package(Torch) creates directory-scoped imported targets (torch,
# torch_cpu, c10, ...). Called from a FetchContent'd / add_subdirectory'd
# pagedkv, they would be invisible to the consumer, whose link line then
# refers to `torch` as a plain library name. So every imported target that
# the call creates is promoted to GLOBAL. A consumer that already found Torch
# keeps its own targets.
#
# Installed next to pagedkvConfig.cmake, which pins Caffe2 the same way
# before its find_dependency(Torch).

# TorchConfig finds Caffe2 with PATHS, which the default search paths beat:
# with a system libtorch installed too (Debian's libtorch-dev), a Torch_DIR
# pointing at a pip torch would mix the two (2.x headers, 1.13 libraries:
# undefined references at link time). Pins Caffe2 to the Torch_DIR's sibling.
macro(pagedkv_pin_caffe2_to_torch)
  if(Torch_DIR AND NOT Caffe2_DIR AND EXISTS "${Torch_DIR}/../Caffe2/Caffe2Config.cmake")
    get_filename_component(Caffe2_DIR "${Torch_DIR}/../Caffe2" ABSOLUTE)
    set(Caffe2_DIR "${Caffe2_DIR}" CACHE PATH "Caffe2's CMake config, next to Torch_DIR's")
  endif()
endmacro()

macro(pagedkv_find_torch)
  if(NOT TARGET torch)
    pagedkv_pin_caffe2_to_torch()
    get_directory_property(_pagedkv_before IMPORTED_TARGETS)
    find_package(Torch REQUIRED)
    get_directory_property(_pagedkv_after IMPORTED_TARGETS)
    foreach(_pagedkv_target IN LISTS _pagedkv_after)
      if(NOT _pagedkv_target IN_LIST _pagedkv_before)
        get_target_property(_pagedkv_global ${_pagedkv_target} IMPORTED_GLOBAL)
        if(NOT _pagedkv_global)
          set_target_properties(${_pagedkv_target} PROPERTIES IMPORTED_GLOBAL TRUE)
        endif()
      endif()
    endforeach()
  endif()
endmacro()
