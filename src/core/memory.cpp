#include "core/memory.hpp"

#include <sys/resource.h>

#include <algorithm>
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

namespace {
// The first number in a file ("max" or a missing file: -1).
std::int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::int64_t v = -1;
  if (!(in >> v)) return -1;
  return v;
}

// Room left under this process's cgroup memory limit (a Slurm --mem, a container), -1 if none.
std::int64_t cgroup_room() {
  std::ifstream self("/proc/self/cgroup");
  std::string line, v2, v1;
  while (std::getline(self, line)) {
    if (line.rfind("0::", 0) == 0) v2 = line.substr(3);
    const auto memory = line.find(":memory:");
    if (memory != std::string::npos) v1 = line.substr(memory + 8);
  }
  std::int64_t limit = -1, used = -1;
  if (!v2.empty()) {
    limit = read_number("/sys/fs/cgroup" + v2 + "/memory.max");
    used = read_number("/sys/fs/cgroup" + v2 + "/memory.current");
  }
  if (limit < 0 && !v1.empty()) {
    limit = read_number("/sys/fs/cgroup/memory" + v1 + "/memory.limit_in_bytes");
    used = read_number("/sys/fs/cgroup/memory" + v1 + "/memory.usage_in_bytes");
    if (limit >= (std::int64_t(1) << 60)) limit = -1;  // v1's "no limit"
  }
  return limit < 0 || used < 0 ? -1 : std::max<std::int64_t>(0, limit - used);
}
}  // namespace

std::int64_t host_available_bytes() {
  std::int64_t available = -1;
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream ls(line.substr(13));
    std::int64_t kib = -1;
    ls >> kib;
    available = kib < 0 ? -1 : kib * 1024;
  }
  const std::int64_t room = cgroup_room();
  if (room >= 0 && (available < 0 || room < available)) available = room;
  return available;
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
