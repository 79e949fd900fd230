// Memory of this process and of the machine it runs on.
#pragma once

#include <cstdint>

namespace kmoe {

// Host memory high-water mark of this process (Linux ru_maxrss), MiB.
double peak_rss_mib();

// Bytes of host memory available to new allocations: Linux MemAvailable, or less under a cgroup
// memory limit (a Slurm --mem, a container); -1 if unknown.
std::int64_t host_available_bytes();

// Free bytes on the Kokkos device this process uses (CUDA, HIP), -1 on host-memory builds or
// when unknown.
std::int64_t device_free_bytes();

}  // namespace kmoe
