# Which Kokkos backends kmoe is built for, read from the installed KokkosCore_config.h and
# KokkosKernels_config.h (every packaging has them), and a check that the toolchain can build
# them (docs/BUILDING.md):
# - CUDA: kmoe's device lambdas need nvcc through Kokkos' nvcc_wrapper as the C++ compiler, or
#   Kokkos >= 4's launch compiler (which redirects the compiles of Kokkos users to the compiler
#   Kokkos was built with), or Clang with CUDA; Kokkos 3.x must have Kokkos_ENABLE_CUDA_LAMBDA.
# - HIP: hipcc or a ROCm Clang as the C++ compiler.
# - GEMMs: Kokkos Kernels must use cuBLAS (CUDA), rocBLAS (HIP) or a host BLAS (CPU backends) as
#   a TPL; its native GEMM is far slower, so kmoe stops rather than falls back to it, unless
#   -DKMOE_ALLOW_NATIVE_GEMM=ON asks for it (compile checks and correctness runs: a toolchain
#   without rocBLAS, such as Debian's ROCm 5.2).
# Sets KMOE_KOKKOS_BACKENDS (e.g. "CUDA;SERIAL").

# `header` in the include directories of `targets` first (the package it describes: a Kokkos
# prefix may hold another Kokkos Kernels), then of the Kokkos variables.
function(_kmoe_find_config_header out header)
  set(dirs "")
  foreach(target ${ARGN})
    if(TARGET ${target})
      get_target_property(inc ${target} INTERFACE_INCLUDE_DIRECTORIES)
      if(inc)
        list(APPEND dirs ${inc})
      endif()
    endif()
  endforeach()
  list(APPEND dirs ${Kokkos_INCLUDE_DIRS} ${KokkosKernels_INCLUDE_DIRS})
  list(FILTER dirs EXCLUDE REGEX "\\$<")
  unset(_kmoe_header_${header} CACHE)  # looked up afresh: Kokkos_ROOT may have changed
  find_file(_kmoe_header_${header} ${header} HINTS ${dirs} PATH_SUFFIXES trilinos)
  if(NOT _kmoe_header_${header})
    message(FATAL_ERROR "kmoe: ${header} not found in the include directories of Kokkos "
                        "(${dirs}); pass -DKokkos_ROOT / -DKokkosKernels_ROOT of an install")
  endif()
  set(${out} "${_kmoe_header_${header}}" PARENT_SCOPE)
endfunction()

_kmoe_find_config_header(_kmoe_core_h KokkosCore_config.h Kokkos::kokkoscore Kokkos::kokkos)
_kmoe_find_config_header(_kmoe_kk_h KokkosKernels_config.h Kokkos::kokkoskernels)
file(STRINGS "${_kmoe_core_h}" _kmoe_core_defs REGEX "^#define KOKKOS_")
# The TPL macros in effect: the header defines some only under others (MKL or ARMPL imply
# BLAS), so it goes through the C preprocessor; a bare line scan if that fails.
execute_process(COMMAND "${CMAKE_C_COMPILER}" -E -dM -x c "${_kmoe_kk_h}"
                OUTPUT_VARIABLE _kmoe_kk_macros RESULT_VARIABLE _kmoe_rc ERROR_QUIET)
if(_kmoe_rc EQUAL 0)
  string(REGEX MATCHALL "#define KOKKOSKERNELS_ENABLE_TPL_[A-Za-z0-9_]+" _kmoe_kk_defs
         "${_kmoe_kk_macros}")
else()
  file(STRINGS "${_kmoe_kk_h}" _kmoe_kk_defs REGEX "^#define KOKKOSKERNELS_ENABLE_TPL_")
endif()

set(KMOE_KOKKOS_BACKENDS "")
foreach(backend CUDA HIP SYCL OPENMP THREADS SERIAL)
  if("${_kmoe_core_defs}" MATCHES "#define KOKKOS_ENABLE_${backend}( |;|$)")
    list(APPEND KMOE_KOKKOS_BACKENDS ${backend})
  endif()
endforeach()
set(_kmoe_tpls "")
foreach(tpl CUBLAS ROCBLAS BLAS MKL)
  if("${_kmoe_kk_defs}" MATCHES "KOKKOSKERNELS_ENABLE_TPL_${tpl}( |;|$)")
    list(APPEND _kmoe_tpls ${tpl})
  endif()
endforeach()
get_filename_component(_kmoe_cxx_name "${CMAKE_CXX_COMPILER}" NAME)
get_property(_kmoe_launch GLOBAL PROPERTY RULE_LAUNCH_COMPILE)

set(_kmoe_docs "see docs/BUILDING.md for the Kokkos and Kokkos Kernels configure options")
# A backend's GEMM library is missing: an error, or with KMOE_ALLOW_NATIVE_GEMM a warning.
function(_kmoe_gemm_missing what rebuild)
  if(KMOE_ALLOW_NATIVE_GEMM)
    message(WARNING "kmoe: Kokkos Kernels (${_kmoe_kk_h}) was built without ${what}; "
                    "KMOE_ALLOW_NATIVE_GEMM=ON: its native GEMM is used, for compile checks and "
                    "correctness runs only (many times slower)")
  else()
    message(FATAL_ERROR "kmoe: Kokkos Kernels (${_kmoe_kk_h}) was built without ${what}; its "
                        "native GEMM is far slower. Rebuild it with ${rebuild}, or configure "
                        "kmoe with -DKMOE_ALLOW_NATIVE_GEMM=ON for compile checks and "
                        "correctness runs only; ${_kmoe_docs}")
  endif()
endfunction()
if(CUDA IN_LIST KMOE_KOKKOS_BACKENDS)
  if(Kokkos_COMPILE_LANGUAGE STREQUAL "CUDA")
    message(FATAL_ERROR "kmoe: this Kokkos compiles as the CMake CUDA language "
                        "(Kokkos_ENABLE_COMPILE_AS_CMAKE_LANGUAGE), which kmoe's build does not "
                        "use; configure kmoe with -DCMAKE_CXX_COMPILER=<kokkos>/bin/nvcc_wrapper "
                        "against a Kokkos built the default way; ${_kmoe_docs}")
  endif()
  if(_kmoe_cxx_name MATCHES "nvcc_wrapper")
    set(_kmoe_how "nvcc_wrapper")
  elseif(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(_kmoe_how "Clang CUDA")
  elseif(_kmoe_launch MATCHES "kokkos_launch_compiler")
    set(_kmoe_how "Kokkos' launch compiler (C++ compiles of Kokkos users go to nvcc_wrapper)")
  else()
    message(FATAL_ERROR "kmoe: Kokkos ${Kokkos_VERSION} has the CUDA backend, but the C++ "
                        "compiler is ${CMAKE_CXX_COMPILER}, which cannot compile device "
                        "lambdas, and Kokkos' launch compiler is off; configure with "
                        "-DCMAKE_CXX_COMPILER=<kokkos>/bin/nvcc_wrapper; ${_kmoe_docs}")
  endif()
  if(Kokkos_VERSION VERSION_LESS 4.0 AND NOT "${_kmoe_core_defs}" MATCHES "KOKKOS_ENABLE_CUDA_LAMBDA")
    message(FATAL_ERROR "kmoe: Kokkos ${Kokkos_VERSION} was built without "
                        "Kokkos_ENABLE_CUDA_LAMBDA=ON, which kmoe's device lambdas need; "
                        "${_kmoe_docs}")
  endif()
  if(NOT CUBLAS IN_LIST _kmoe_tpls)
    _kmoe_gemm_missing(cuBLAS -DKokkosKernels_ENABLE_TPL_CUBLAS=ON)
  endif()
elseif(HIP IN_LIST KMOE_KOKKOS_BACKENDS)
  if(NOT (_kmoe_cxx_name MATCHES "hipcc" OR CMAKE_CXX_COMPILER_ID MATCHES "Clang"))
    message(FATAL_ERROR "kmoe: Kokkos ${Kokkos_VERSION} has the HIP backend; the C++ compiler "
                        "must be hipcc or ROCm's amdclang++, not ${CMAKE_CXX_COMPILER}; "
                        "${_kmoe_docs}")
  endif()
  if(NOT ROCBLAS IN_LIST _kmoe_tpls)
    _kmoe_gemm_missing(rocBLAS -DKokkosKernels_ENABLE_TPL_ROCBLAS=ON)
  endif()
  set(_kmoe_how "${_kmoe_cxx_name}")
elseif(SYCL IN_LIST KMOE_KOKKOS_BACKENDS)
  message(FATAL_ERROR "kmoe: the SYCL backend of Kokkos is not supported; ${_kmoe_docs}")
else()
  if(NOT (BLAS IN_LIST _kmoe_tpls OR MKL IN_LIST _kmoe_tpls))
    _kmoe_gemm_missing("a host BLAS" "-DKokkosKernels_ENABLE_TPL_BLAS=ON (OpenBLAS, BLIS or MKL)")
  endif()
  set(_kmoe_how "${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}")
endif()
string(REPLACE ";" ", " _kmoe_b "${KMOE_KOKKOS_BACKENDS}")
string(REPLACE ";" ", " _kmoe_t "${_kmoe_tpls}")
if(NOT _kmoe_t)
  set(_kmoe_t "none")
endif()
message(STATUS "kmoe: Kokkos ${Kokkos_VERSION} backends ${_kmoe_b}; Kokkos Kernels TPLs "
               "${_kmoe_t}; compiled by ${_kmoe_how}")
