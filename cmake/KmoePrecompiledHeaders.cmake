# Precompiled headers for host builds (docs/BUILDING.md, "Build time"). Every translation unit of
# the library parses Kokkos_Core.hpp and MPI's headers (about 0.9 s of a GCC compile each, of
# 2-14 s); a precompiled copy of them, made once per target, is read instead. They are used with
# GCC and Clang on host backends only: a CUDA or HIP build compiles through nvcc_wrapper, hipcc
# or a device Clang, which CMake's precompiled-header flags do not fit.
#
# The headers are force-included into each unit of a target that uses them, so a missing
# include goes unnoticed in such a build: -DKMOE_PRECOMPILE_HEADERS=OFF builds without them.
option(KMOE_PRECOMPILE_HEADERS
       "Precompile Kokkos', MPI's and GoogleTest's headers (GCC or Clang, host backends)" ON)

set(KMOE_PCH_ACTIVE OFF)
if(KMOE_PRECOMPILE_HEADERS)
  set(_kmoe_device_backends ${KMOE_KOKKOS_BACKENDS})
  list(FILTER _kmoe_device_backends INCLUDE REGEX "^(CUDA|HIP|SYCL)$")
  if(_kmoe_device_backends)
    message(STATUS "kmoe: no precompiled headers with the ${_kmoe_device_backends} backend")
  elseif(NOT CMAKE_CXX_COMPILER_ID MATCHES "^(GNU|Clang)$")
    message(STATUS "kmoe: no precompiled headers with ${CMAKE_CXX_COMPILER_ID}")
  else()
    set(KMOE_PCH_ACTIVE ON)
  endif()
endif()

# The headers most units include (directly or through core/kokkos_types.hpp and core/error.hpp).
set(KMOE_PCH_HEADERS <Kokkos_Core.hpp> <mpi.h> <algorithm> <functional> <map> <memory> <sstream>
                     <string> <vector>)

# kmoe_precompile_headers(TARGET [HEADERS h...] [REUSE_FROM other]): TARGET's units read a
# precompiled copy of KMOE_PCH_HEADERS and HEADERS, or the one of `other` (whose compile flags
# must be the same).
function(kmoe_precompile_headers target)
  cmake_parse_arguments(P "" "REUSE_FROM" "HEADERS" ${ARGN})
  if(NOT KMOE_PCH_ACTIVE)
    return()
  endif()
  if(P_REUSE_FROM)
    target_precompile_headers(${target} REUSE_FROM ${P_REUSE_FROM})
  else()
    target_precompile_headers(${target} PRIVATE ${KMOE_PCH_HEADERS} ${P_HEADERS})
  endif()
endfunction()
