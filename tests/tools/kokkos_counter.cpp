// A Kokkos Tools library that counts, per kmoe training step, what the step asks of the device
// and how often the host waits for it: kernel launches, fences (explicit ones and those Kokkos
// issues inside deep_copy or a reduction to a host value), deep copies by direction, and the
// host synchronizations kmoe names (core/device_sync.hpp: the event "kmoe::sync <what>"), and
// memory allocations and deallocations with their bytes (every Kokkos memory space: on a CPU
// build the device's memory is host memory), and kmoe's GEMM calls (the event "kmoe::gemm
// <kind>" of core/gemm.cpp: one cuBLAS call each on CUDA builds, whose kernels Kokkos does not
// see), and the fp32 operand elements bf16 products rounded at their entry (the event
// "kmoe::rounded <n>": operands no producing kernel wrote as bf16), and the kernels launched on a
// single index, one thread (the event "kmoe::one_thread" of core/kokkos_types.hpp's ranges just
// before the launch). A step is the profile region "kmoe::step" that the trainer opens around
// each optimizer step.
//
// Loaded with KOKKOS_TOOLS_LIBS=<path> (Kokkos 4) or KOKKOS_PROFILE_LIBRARY=<path> (Kokkos 3).
// At exit it writes one CSV row per step to $KMOE_KOKKOS_COUNTS (".<rank>" appended on ranks
// other than 0 of an MPI launch), or to stderr; and the one-thread kernels of the steps by name
// with their launches to the same path with ".one_thread" appended. Which events a build reports
// differs: Kokkos 3.4 reports no Serial fences and skips host-to-host copies; a GPU build reports
// all of them. Only the C interface of Kokkos Tools is used; it links no Kokkos.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

// The C interface's structs, at namespace scope with external linkage: in an anonymous
// namespace they give the extern "C" callbacks that take them internal linkage under nvcc, whose
// front end then leaves kokkosp_request_tool_settings and kokkosp_begin_deep_copy out of the
// library (seen on the first GPU run: Kokkos kept its global fencing, four fences per kernel,
// and no deep copy was counted).
struct SpaceHandle {  // Kokkos_Profiling_SpaceHandle
  char name[64];
};

struct ToolSettings {  // Kokkos_Tools_ToolSettings
  bool requires_global_fencing;
  bool padding[255];
};

namespace {

struct Counts {
  long kernels = 0, fences = 0, copies = 0, to_host = 0, from_host = 0, on_device = 0,
       kmoe_syncs = 0, allocations = 0, deallocations = 0, gemm_calls = 0;
  std::uint64_t bytes_to_host = 0, bytes_from_host = 0, bytes_allocated = 0;
  long long rounded_elements = 0;  // fp32 operand elements bf16 products rounded at entry
  long one_thread = 0;             // kernels launched on a single index
};

std::vector<Counts> g_steps;
Counts g_current;
int g_step_depth = 0;  // > 0 inside "kmoe::step"
std::vector<bool> g_regions;
std::uint64_t g_next_id = 1;
// KMOE_KOKKOS_COUNTS_NAMES=1: the fences inside steps by name with the kernel launched before
// each, kmoe's named waits and the allocations by label, most frequent first, on stderr at
// exit.
bool g_names = false;
std::map<std::string, long> g_fence_names;
bool g_one_thread_next = false;                  // "kmoe::one_thread" seen: the next launch is one
std::map<std::string, long> g_one_thread_names;  // inside steps

bool host_space(const char* name) {
  // "Host", "HostSpace", "CudaHostPinned", "HIPHostPinned", "SYCLHostUSM" ...
  return std::strstr(name, "Host") != nullptr;
}

std::string g_last_kernel;  // names mode: the kernel launched last, which a fence follows

void launched(const char* name, std::uint64_t* id) {
  if (g_names) g_last_kernel = name;
  *id = g_next_id++;
  const bool one = g_one_thread_next;
  g_one_thread_next = false;
  if (g_step_depth == 0) return;
  ++g_current.kernels;
  if (one) {
    ++g_current.one_thread;
    ++g_one_thread_names[name];
  }
}

}  // namespace

extern "C" {

void kokkosp_init_library(int, std::uint64_t, std::uint32_t, void*) {
  g_names = std::getenv("KMOE_KOKKOS_COUNTS_NAMES") != nullptr;
}

// Kokkos fences around every kernel for a tool unless it says it needs no such fences; those
// would be counted as the step's own.
void kokkosp_request_tool_settings(std::uint32_t, ToolSettings* settings) {
  settings->requires_global_fencing = false;
}

void kokkosp_finalize_library() {
  const char* path = std::getenv("KMOE_KOKKOS_COUNTS");
  std::string file = path ? path : "";
  const char* rank = nullptr;
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"})
    if (!rank) rank = std::getenv(v);
  if (!file.empty() && rank && std::strcmp(rank, "0") != 0) file += std::string(".") + rank;
  FILE* out = file.empty() ? stderr : std::fopen(file.c_str(), "w");
  if (!out) {
    std::fprintf(stderr, "kokkos_counter: cannot write %s\n", file.c_str());
    return;
  }
  std::fprintf(out,
               "step,kernels,fences,deep_copies,copies_to_host,copies_from_host,"
               "copies_on_device,bytes_to_host,kmoe_syncs,bytes_from_host,allocations,"
               "bytes_allocated,deallocations,gemm_calls,rounded_elements,one_thread_kernels\n");
  for (std::size_t s = 0; s < g_steps.size(); ++s) {
    const Counts& c = g_steps[s];
    std::fprintf(out, "%zu,%ld,%ld,%ld,%ld,%ld,%ld,%llu,%ld,%llu,%ld,%llu,%ld,%ld,%lld,%ld\n",
                 s + 1, c.kernels, c.fences, c.copies, c.to_host, c.from_host, c.on_device,
                 static_cast<unsigned long long>(c.bytes_to_host), c.kmoe_syncs,
                 static_cast<unsigned long long>(c.bytes_from_host), c.allocations,
                 static_cast<unsigned long long>(c.bytes_allocated), c.deallocations, c.gemm_calls,
                 c.rounded_elements, c.one_thread);
  }
  if (out != stderr) std::fclose(out);
  FILE* names = file.empty() ? stderr : std::fopen((file + ".one_thread").c_str(), "w");
  if (names) {
    for (const auto& [name, n] : g_one_thread_names)
      std::fprintf(names, "%ld %s\n", n, name.c_str());
    if (names != stderr) std::fclose(names);
  }
  if (g_names) {
    std::vector<std::pair<long, std::string>> by_count;
    for (const auto& [name, n] : g_fence_names) by_count.emplace_back(n, name);
    std::sort(by_count.rbegin(), by_count.rend());
    for (const auto& [n, name] : by_count) std::fprintf(stderr, "%8ld %s\n", n, name.c_str());
  }
}

void kokkosp_begin_parallel_for(const char* name, std::uint32_t, std::uint64_t* id) {
  launched(name, id);
}
void kokkosp_end_parallel_for(std::uint64_t) {}
void kokkosp_begin_parallel_reduce(const char* name, std::uint32_t, std::uint64_t* id) {
  launched(name, id);
}
void kokkosp_end_parallel_reduce(std::uint64_t) {}
void kokkosp_begin_parallel_scan(const char* name, std::uint32_t, std::uint64_t* id) {
  launched(name, id);
}
void kokkosp_end_parallel_scan(std::uint64_t) {}

void kokkosp_begin_fence(const char* name, std::uint32_t, std::uint64_t* id) {
  *id = g_next_id++;
  if (g_step_depth == 0) return;
  ++g_current.fences;
  if (g_names) ++g_fence_names[std::string(name) + "  (after " + g_last_kernel + ")"];
}
void kokkosp_end_fence(std::uint64_t) {}

void kokkosp_begin_deep_copy(SpaceHandle dst, const char*, const void*, SpaceHandle src,
                             const char*, const void*, std::uint64_t size) {
  if (g_step_depth == 0) return;
  ++g_current.copies;
  const bool dst_host = host_space(dst.name), src_host = host_space(src.name);
  if (dst_host && !src_host) {
    ++g_current.to_host;
    g_current.bytes_to_host += size;
  } else if (!dst_host && src_host) {
    ++g_current.from_host;
    g_current.bytes_from_host += size;
  } else if (!dst_host && !src_host) {
    ++g_current.on_device;
  }
}
void kokkosp_end_deep_copy() {}

void kokkosp_allocate_data(SpaceHandle space, const char* label, const void*, std::uint64_t size) {
  if (g_step_depth == 0) return;
  ++g_current.allocations;
  g_current.bytes_allocated += size;
  if (g_names) ++g_fence_names[std::string("alloc ") + space.name + " " + label];
}

void kokkosp_deallocate_data(SpaceHandle, const char*, const void*, std::uint64_t) {
  if (g_step_depth > 0) ++g_current.deallocations;
}

void kokkosp_profile_event(const char* name) {
  if (g_step_depth > 0 && std::strncmp(name, "kmoe::gemm", 10) == 0) {
    ++g_current.gemm_calls;
    return;
  }
  if (std::strcmp(name, "kmoe::one_thread") == 0) {
    g_one_thread_next = true;
    return;
  }
  if (std::strncmp(name, "kmoe::rounded ", 14) == 0) {
    if (g_step_depth > 0) g_current.rounded_elements += std::strtoll(name + 14, nullptr, 10);
    return;
  }
  if (g_step_depth == 0 || std::strncmp(name, "kmoe::sync", 10) != 0) return;
  ++g_current.kmoe_syncs;
  if (g_names) ++g_fence_names[name];
}

void kokkosp_push_profile_region(const char* name) {
  const bool step = std::strcmp(name, "kmoe::step") == 0;
  g_regions.push_back(step);
  if (step && g_step_depth++ == 0) g_current = Counts();
}

void kokkosp_pop_profile_region() {
  if (g_regions.empty()) return;
  const bool step = g_regions.back();
  g_regions.pop_back();
  if (step && --g_step_depth == 0) g_steps.push_back(g_current);
}

}  // extern "C"
