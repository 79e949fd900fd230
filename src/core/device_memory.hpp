// Memory discipline check (docs/BUILDING.md, "Device memory check"): a debug mode, switched on
// by KMOE_CHECK_DEVICE_MEMORY=1, that records every device allocation through Kokkos Tools'
// allocate/deallocate callbacks (kmoe allocates device memory only through Kokkos), so the code
// that hands a pointer to a host library can refuse one that lies in device memory:
// - the MPI Communicator, unless MPI was declared to take device memory (a CUDA-aware MPI
//   serving as the data plane: parallel.cuda_aware_mpi = true);
// - the HDF5 file layer and the safetensors reader and writer, always (their libraries touch
//   the bytes on the host).
// Which allocations count as device memory: on GPU builds those of a space that is not a host
// space (CUDA, UVM, HIP, SYCL device memory); on host backends, with device paths on
// (KMOE_DEVICE_PATHS=1, core/kokkos_types.hpp), every allocation whose label does not begin
// with kHostLabel, so a CPU run shows where a GPU run would hand device memory to the host. On
// host backends without device paths nothing does. Off (the default), every check is one
// branch on a flag.
#pragma once

#include <cstddef>
#include <string>

namespace kmoe {

// Labels of kmoe's host buffers (staging, host copies of device data) begin with this.
inline constexpr const char* kHostLabel = "kmoe::host ";

// Starts the check when the environment asks for it (KokkosSession calls this after Kokkos
// starts); returns whether it is on. Tools loaded through KOKKOS_TOOLS_LIBS keep their
// callbacks: the check chains to them.
bool start_device_memory_check_from_env();
// Starts it regardless of the environment (tests). Idempotent.
void start_device_memory_check();
bool device_memory_check_on();

// Whether an allocation of this Kokkos space and label counts as device memory (see above).
bool counts_as_device(const char* space, const char* label);

// The device allocation [p, p + bytes) overlaps, as "'<label>' (<space>, <n> bytes)", or ""
// when it overlaps none (or the check is off).
std::string device_allocation_at(const void* p, std::size_t bytes);

// Throws kmoe::Error when [p, p + bytes) overlaps a recorded device allocation: "<who>: the
// buffer at <p> (<bytes> bytes) lies in device allocation '<label>' ...; <why>".
void require_host_memory(const void* p, std::size_t bytes, const std::string& who, const char* why);

// MPI takes device memory in this process (a CUDA-aware MPI declared by
// parallel.cuda_aware_mpi = true): the Communicator then accepts device pointers. Process-wide:
// the property belongs to the MPI library.
void declare_mpi_device_memory(bool takes);
bool mpi_device_memory_declared();

}  // namespace kmoe
