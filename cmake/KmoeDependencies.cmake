# Finds Kokkos, Kokkos Kernels, MPI, parallel HDF5, Boost.Program_options (and GoogleTest in
# tests/). Defines kmoe::kokkos and kmoe::kokkoskernels, which every kmoe target links.
#
# A modern Kokkos / Kokkos Kernels install (-DKokkos_ROOT=..., -DKokkosKernels_ROOT=...) exports
# Kokkos::kokkos and Kokkos::kokkoskernels and is used unchanged. Debian's Trilinos packaging
# (Kokkos 3.4) points Kokkos::kokkos at /usr/include instead of /usr/include/trilinos and defines
# no Kokkos::kokkoskernels; the shim below rebuilds both from the variables the configs do set.

find_package(Kokkos REQUIRED)
find_package(KokkosKernels REQUIRED)

add_library(kmoe_kokkos INTERFACE)
add_library(kmoe::kokkos ALIAS kmoe_kokkos)
add_library(kmoe_kokkoskernels INTERFACE)
add_library(kmoe::kokkoskernels ALIAS kmoe_kokkoskernels)

if(TARGET Kokkos::kokkoskernels)
  message(STATUS "kmoe: Kokkos ${Kokkos_VERSION} and Kokkos Kernels from their exported targets")
  target_link_libraries(kmoe_kokkos INTERFACE Kokkos::kokkos)
  target_link_libraries(kmoe_kokkoskernels INTERFACE Kokkos::kokkoskernels)
else()
  message(STATUS "kmoe: Kokkos from Trilinos packaging (${Kokkos_INCLUDE_DIRS}); applying shim")
  if(NOT Kokkos_INCLUDE_DIRS OR NOT KokkosKernels_LIBRARIES)
    message(FATAL_ERROR "kmoe: Kokkos found without Kokkos::kokkoskernels, and without the "
                        "Trilinos variables Kokkos_INCLUDE_DIRS / KokkosKernels_LIBRARIES to "
                        "rebuild it. Pass -DKokkos_ROOT and -DKokkosKernels_ROOT of an install.")
  endif()
  get_filename_component(_kmoe_kokkos_inc "${Kokkos_INCLUDE_DIRS}" REALPATH)
  target_include_directories(kmoe_kokkos SYSTEM INTERFACE ${_kmoe_kokkos_inc})
  target_link_directories(kmoe_kokkos INTERFACE ${Kokkos_LIBRARY_DIRS})
  target_link_libraries(kmoe_kokkos INTERFACE ${Kokkos_LIBRARIES} ${Kokkos_TPL_LIBRARIES})
  target_link_libraries(kmoe_kokkoskernels INTERFACE kmoe_kokkos ${KokkosKernels_LIBRARIES}
                                                      ${KokkosKernels_TPL_LIBRARIES})
endif()
# The language standard comes from the Kokkos target (Kokkos 5 asks for C++20); at least 17.
target_compile_features(kmoe_kokkos INTERFACE cxx_std_17)
include(KmoeBackendChecks)

find_package(MPI REQUIRED COMPONENTS C)

set(HDF5_PREFER_PARALLEL TRUE)
find_package(HDF5 QUIET COMPONENTS C)
if(NOT HDF5_FOUND)
  # FindHDF5 first asks the h5pcc wrapper to compile a test program, which fails in a build
  # directory whose path holds spaces (and then, with REQUIRED, gives up); QUIET lets it read
  # the wrapper's flags instead, and pkg-config is the fallback where that fails too.
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    foreach(module hdf5-mpi hdf5-openmpi hdf5-mpich hdf5)
      pkg_check_modules(KMOE_PC_HDF5 QUIET ${module})
      if(KMOE_PC_HDF5_FOUND)
        break()
      endif()
    endforeach()
  endif()
  if(NOT KMOE_PC_HDF5_FOUND)
    message(FATAL_ERROR "kmoe: no HDF5 found (neither FindHDF5 nor pkg-config); install a "
                        "parallel HDF5 (Debian: libhdf5-openmpi-dev) or set HDF5_ROOT")
  endif()
  set(HDF5_INCLUDE_DIRS ${KMOE_PC_HDF5_INCLUDE_DIRS})
  set(HDF5_LIBRARIES ${KMOE_PC_HDF5_LINK_LIBRARIES})
  set(HDF5_DEFINITIONS ${KMOE_PC_HDF5_CFLAGS_OTHER})
  set(HDF5_VERSION ${KMOE_PC_HDF5_VERSION})
  set(HDF5_IS_PARALLEL FALSE)
  foreach(dir ${HDF5_INCLUDE_DIRS})
    if(EXISTS "${dir}/H5pubconf.h")
      file(STRINGS "${dir}/H5pubconf.h" parallel REGEX "^#define H5_HAVE_PARALLEL 1")
      if(parallel)
        set(HDF5_IS_PARALLEL TRUE)
      endif()
    endif()
  endforeach()
  message(STATUS "kmoe: HDF5 ${HDF5_VERSION} from pkg-config (${HDF5_INCLUDE_DIRS})")
endif()
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "kmoe: HDF5 ${HDF5_VERSION} at ${HDF5_INCLUDE_DIRS} is not built with MPI; "
                      "install a parallel HDF5 (Debian: libhdf5-openmpi-dev)")
endif()
add_library(kmoe_hdf5 INTERFACE)
add_library(kmoe::hdf5 ALIAS kmoe_hdf5)
target_include_directories(kmoe_hdf5 SYSTEM INTERFACE ${HDF5_INCLUDE_DIRS})
target_link_libraries(kmoe_hdf5 INTERFACE ${HDF5_LIBRARIES} MPI::MPI_C)
target_compile_definitions(kmoe_hdf5 INTERFACE ${HDF5_DEFINITIONS})

find_package(Boost REQUIRED COMPONENTS program_options)
# JSON for the Hugging Face files (config.json, safetensors headers): header-only, Debian's
# nlohmann-json3-dev or any nlohmann_json >= 3.9 on CMAKE_PREFIX_PATH.
find_package(nlohmann_json 3.9 REQUIRED)

# SentencePiece (kmoe-prep --sentencepiece / --train-sentencepiece, data.tokenizer =
# sentencepiece): Debian's libsentencepiece-dev through pkg-config, or SENTENCEPIECE_ROOT.
# KMOE_ENABLE_SENTENCEPIECE = AUTO uses it when found; ON requires it; OFF builds without (the
# options then say that this build has none).
set(KMOE_ENABLE_SENTENCEPIECE AUTO CACHE STRING "SentencePiece tokenizers: AUTO, ON or OFF")
if(NOT KMOE_ENABLE_SENTENCEPIECE STREQUAL "OFF")
  find_path(SENTENCEPIECE_INCLUDE_DIR sentencepiece_processor.h
            HINTS ${SENTENCEPIECE_ROOT} $ENV{SENTENCEPIECE_ROOT} PATH_SUFFIXES include)
  find_library(SENTENCEPIECE_LIBRARY sentencepiece
               HINTS ${SENTENCEPIECE_ROOT} $ENV{SENTENCEPIECE_ROOT} PATH_SUFFIXES lib lib64)
  find_library(SENTENCEPIECE_TRAIN_LIBRARY sentencepiece_train
               HINTS ${SENTENCEPIECE_ROOT} $ENV{SENTENCEPIECE_ROOT} PATH_SUFFIXES lib lib64)
  if(SENTENCEPIECE_INCLUDE_DIR AND SENTENCEPIECE_LIBRARY AND SENTENCEPIECE_TRAIN_LIBRARY)
    add_library(kmoe_sentencepiece INTERFACE)
    add_library(kmoe::sentencepiece ALIAS kmoe_sentencepiece)
    target_include_directories(kmoe_sentencepiece SYSTEM INTERFACE ${SENTENCEPIECE_INCLUDE_DIR})
    target_link_libraries(kmoe_sentencepiece INTERFACE ${SENTENCEPIECE_TRAIN_LIBRARY}
                                                       ${SENTENCEPIECE_LIBRARY})
    message(STATUS "kmoe: SentencePiece (${SENTENCEPIECE_LIBRARY})")
  elseif(KMOE_ENABLE_SENTENCEPIECE STREQUAL "ON")
    message(FATAL_ERROR "kmoe: KMOE_ENABLE_SENTENCEPIECE=ON but sentencepiece_processor.h / "
                        "libsentencepiece(_train) were not found; install libsentencepiece-dev or "
                        "set SENTENCEPIECE_ROOT")
  else()
    message(STATUS "kmoe: no SentencePiece (data.tokenizer = sentencepiece unavailable)")
  endif()
endif()

# The NCCL backend (KMOE_ENABLE_NCCL): nccl.h and libnccl from NCCL_ROOT, NCCL_HOME, the CUDA
# toolkit or CMAKE_PREFIX_PATH, and the CUDA runtime. parallel/nccl_comm.cpp calls only host
# APIs, so the host C++ compiler builds it; no CUDA language, nvcc or GPU is needed to compile
# and link it. kmoe::nccl carries the include path (as a system path: the CUDA headers are not
# -Wall clean everywhere) and both libraries.
if(KMOE_ENABLE_NCCL)
  if(CMAKE_VERSION VERSION_LESS 3.17)
    message(FATAL_ERROR "kmoe: KMOE_ENABLE_NCCL=ON needs CMake >= 3.17 (FindCUDAToolkit)")
  endif()
  find_package(CUDAToolkit REQUIRED)
  find_path(NCCL_INCLUDE_DIR nccl.h
            HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_INCLUDE_DIRS}
                  ${CUDAToolkit_LIBRARY_ROOT}
            PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY nccl
               HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_LIBRARY_DIR}
                     ${CUDAToolkit_LIBRARY_ROOT}
               PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(FATAL_ERROR "kmoe: KMOE_ENABLE_NCCL=ON but nccl.h / libnccl were not found; "
                        "set NCCL_ROOT (or NCCL_HOME, CMAKE_PREFIX_PATH)")
  endif()
  # ncclSend/ncclRecv (point-to-point, used by every transfer) arrived in NCCL 2.7.
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _kmoe_nccl_version
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  string(REGEX REPLACE ".*NCCL_MAJOR +([0-9]+).*" "\\1" _kmoe_nccl_major "${_kmoe_nccl_version}")
  string(REGEX REPLACE ".*NCCL_MINOR +([0-9]+).*" "\\1" _kmoe_nccl_minor "${_kmoe_nccl_version}")
  string(REGEX REPLACE ".*NCCL_PATCH +([0-9]+).*" "\\1" _kmoe_nccl_patch "${_kmoe_nccl_version}")
  set(KMOE_NCCL_VERSION "${_kmoe_nccl_major}.${_kmoe_nccl_minor}.${_kmoe_nccl_patch}")
  if(KMOE_NCCL_VERSION VERSION_LESS 2.7)
    message(FATAL_ERROR "kmoe: NCCL ${KMOE_NCCL_VERSION} at ${NCCL_INCLUDE_DIR} is too old; "
                        "the NCCL backend needs NCCL >= 2.7 (ncclSend/ncclRecv)")
  endif()
  add_library(kmoe_nccl INTERFACE)
  add_library(kmoe::nccl ALIAS kmoe_nccl)
  target_include_directories(kmoe_nccl SYSTEM INTERFACE ${NCCL_INCLUDE_DIR})
  target_link_libraries(kmoe_nccl INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
  message(STATUS "kmoe: NCCL ${KMOE_NCCL_VERSION} (${NCCL_LIBRARY}), CUDA runtime "
                 "${CUDAToolkit_VERSION}")
endif()
