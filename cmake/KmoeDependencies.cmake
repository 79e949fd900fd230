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

find_package(MPI REQUIRED COMPONENTS C)

set(HDF5_PREFER_PARALLEL TRUE)
find_package(HDF5 REQUIRED COMPONENTS C)
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

if(KMOE_ENABLE_NCCL)
  find_package(CUDAToolkit REQUIRED)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME
            PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME
               PATH_SUFFIXES lib lib64)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(FATAL_ERROR "kmoe: KMOE_ENABLE_NCCL=ON but nccl.h / libnccl were not found; "
                        "set NCCL_HOME or CMAKE_PREFIX_PATH")
  endif()
  message(STATUS "kmoe: NCCL ${NCCL_LIBRARY}")
endif()
