#include "core/memory.hpp"

#include <sys/resource.h>

#include <fstream>
#include <sstream>
#include <string>

#include "core/kokkos_types.hpp"
#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#elif defined(KOKKOS_ENABLE_HIP)
#include <hip/hip_runtime.h>
#endif

namespace kmoe {

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;  // KiB on Linux
}

std::int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream ls(line.substr(13));
    std::int64_t kib = -1;
    ls >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

std::int64_t device_free_bytes() {
  std::size_t free = 0, total = 0;
#if defined(KOKKOS_ENABLE_CUDA)
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) return static_cast<std::int64_t>(free);
#elif defined(KOKKOS_ENABLE_HIP)
  if (hipMemGetInfo(&free, &total) == hipSuccess) return static_cast<std::int64_t>(free);
#endif
  (void)free;
  (void)total;
  return -1;
}

}  // namespace kmoe
