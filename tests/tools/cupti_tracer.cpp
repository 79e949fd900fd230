// A CUPTI activity tracer for the GPU window (scripts/gpu_profile.sh): what the GPU ran per
// training step, kernel by kernel, with its idle time and copies, where no Nsight report can be
// had (CUPTI's activity API works wherever PyTorch's profiler does).
//
// Loaded into a CUDA process with CUDA_INJECTION64_PATH=<this library> (the driver calls
// InitializeInjection at its start), and into kmoe as its Kokkos Tools library too
// (KOKKOS_TOOLS_LIBS=<the same path>), which adds the names: every Kokkos launch pushes its id
// as CUPTI's external correlation, so its kernels carry the Kokkos label ("attn::split_heads");
// other kernels (cuBLAS, cuDNN) keep their own names. Kokkos' step region "kmoe::step" marks the
// steps (timestamps from cuptiGetTimestamp, CUPTI's clock). Without the Kokkos half it traces
// the whole process as one step (a PyTorch peer).
//
// At exit (Kokkos' finalize, or the process's exit; a run a signal kills writes nothing) it
// writes ($KMOE_CUPTI_OUT.<rank> on MPI ranks other than 0), for the steps after the first
// $KMOE_CUPTI_SKIP steps (default 2; all when there are not more):
//   $KMOE_CUPTI_OUT.kernels.csv  name,calls,total_us  per step (mean over the steps), busiest first
//   $KMOE_CUPTI_OUT.steps.csv    step,wall_us,busy_us,idle_us,kernel_us,copy_us,kernels,copies
// where busy is the union of the step's kernel and copy intervals on the GPU and idle the rest
// of the step's wall time. $KMOE_CUPTI_OUT defaults to "cupti".
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

struct ToolSettings {  // Kokkos_Tools_ToolSettings (external linkage: see kokkos_counter.cpp)
  bool requires_global_fencing;
  bool padding[255];
};

namespace {

struct Interval {
  std::uint64_t start, end;
  std::uint32_t correlation;  // kernels: CUPTI's correlation id
  int name;                   // kernels: index into g_names (CUPTI's name)
  bool copy;
};

std::mutex g_mutex;
std::vector<Interval> g_work;                         // kernels, copies and sets
std::map<std::uint32_t, std::uint64_t> g_external;    // correlation -> Kokkos launch id
std::map<std::uint64_t, std::string> g_launch_names;  // Kokkos launch id -> label
std::vector<std::string> g_names;                     // CUPTI kernel names
std::map<std::string, int> g_name_index;
std::vector<std::pair<std::uint64_t, std::uint64_t>> g_steps;  // [begin, end) CUPTI clock
std::vector<int> g_regions;                                    // 1: a "kmoe::step" region
std::uint64_t g_step_begin = 0, g_next_id = 1;
int g_step_depth = 0;
bool g_started = false, g_written = false;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "cupti_tracer: %s: %s\n", what, msg ? msg : "?");
}

std::string demangled(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  if (out.size() > 160) out = out.substr(0, 157) + "...";
  for (char& c : out)
    if (c == ',' || c == '\n') c = ';';  // one CSV field
  return out;
}

int name_index(const char* name) {
  auto it = g_name_index.find(name);
  if (it != g_name_index.end()) return it->second;
  g_names.push_back(demangled(name));
  return g_name_index[name] = static_cast<int>(g_names.size()) - 1;
}

constexpr std::size_t kBuffer = 8 << 20;

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, kBuffer));
  *size = kBuffer;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t,
                               std::size_t valid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUpti_Activity* record = nullptr;
  // Records a forced flush left incomplete carry no end time: not counted.
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        if (k->end > k->start)
          g_work.push_back({k->start, k->end, k->correlationId, name_index(k->name), false});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        if (m->end > m->start) g_work.push_back({m->start, m->end, m->correlationId, -1, true});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        if (m->end > m->start) g_work.push_back({m->start, m->end, m->correlationId, -1, true});
        break;
      }
      case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
        const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
        g_external[e->correlationId] = e->externalId;
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void write_tables();

void start() {
  if (g_started) return;
  g_started = true;
  std::atexit(write_tables);  // also where Kokkos' finalize never comes (an exit from a failed run)
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable copies");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable sets");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION), "enable correlation");
  // External correlation records come only with the API records they refer to (runtime
  // launches; driver ones for libraries that launch through the driver): enabled, not kept.
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime API records");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "enable driver API records");
}

// The length of the union of intervals (sorted by start).
std::uint64_t union_length(std::vector<std::pair<std::uint64_t, std::uint64_t>>& v) {
  std::sort(v.begin(), v.end());
  std::uint64_t total = 0, lo = 0, hi = 0;
  bool open = false;
  for (const auto& [s, e] : v) {
    if (!open || s > hi) {
      if (open) total += hi - lo;
      lo = s;
      hi = e;
      open = true;
    } else {
      hi = std::max(hi, e);
    }
  }
  return open ? total + hi - lo : total;
}

void write_tables() {
  if (!g_started || g_written) return;
  g_written = true;
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flush");
  std::lock_guard<std::mutex> lock(g_mutex);
  const char* base_env = std::getenv("KMOE_CUPTI_OUT");
  std::string base = base_env && *base_env ? base_env : "cupti";
  const char* rank = nullptr;  // ranks other than 0 of an MPI launch: ".<rank>" appended
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"})
    if (!rank) rank = std::getenv(v);
  if (rank && std::strcmp(rank, "0") != 0) base += std::string(".") + rank;
  const char* skip_env = std::getenv("KMOE_CUPTI_SKIP");
  std::size_t skip = skip_env ? std::strtoul(skip_env, nullptr, 10) : 2;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> steps = g_steps;
  if (steps.empty() && !g_work.empty()) {  // no steps marked: the whole run
    std::uint64_t lo = UINT64_MAX, hi = 0;
    for (const Interval& w : g_work) lo = std::min(lo, w.start), hi = std::max(hi, w.end);
    steps.emplace_back(lo, hi);
  }
  if (skip >= steps.size()) skip = 0;
  std::map<std::string, std::pair<long, double>> per_name;  // calls, us
  FILE* sf = std::fopen((base + ".steps.csv").c_str(), "w");
  if (sf) std::fprintf(sf, "step,wall_us,busy_us,idle_us,kernel_us,copy_us,kernels,copies\n");
  std::sort(g_work.begin(), g_work.end(),
            [](const Interval& a, const Interval& b) { return a.start < b.start; });
  const std::size_t measured = steps.size() - skip;
  for (std::size_t s = skip; s < steps.size(); ++s) {
    const auto [b, e] = steps[s];
    std::vector<std::pair<std::uint64_t, std::uint64_t>> busy;
    double kernel_us = 0, copy_us = 0;
    long kernels = 0, copies = 0;
    auto it = std::lower_bound(g_work.begin(), g_work.end(), b,
                               [](const Interval& w, std::uint64_t t) { return w.start < t; });
    for (; it != g_work.end() && it->start < e; ++it) {
      const double us = (it->end - it->start) / 1e3;
      busy.emplace_back(it->start, std::min(it->end, e));
      if (it->copy) {
        copy_us += us;
        ++copies;
        continue;
      }
      kernel_us += us;
      ++kernels;
      auto ext = g_external.find(it->correlation);
      const auto label =
          ext == g_external.end() ? g_launch_names.end() : g_launch_names.find(ext->second);
      auto& n = per_name[label == g_launch_names.end() ? g_names[it->name] : label->second];
      ++n.first;
      n.second += us;
    }
    const double wall = (e - b) / 1e3, busy_us = union_length(busy) / 1e3;
    if (sf)
      std::fprintf(sf, "%zu,%.1f,%.1f,%.1f,%.1f,%.1f,%ld,%ld\n", s + 1, wall, busy_us,
                   wall - busy_us, kernel_us, copy_us, kernels, copies);
  }
  if (sf) std::fclose(sf);
  std::vector<std::pair<double, std::string>> order;
  for (const auto& [name, n] : per_name) order.emplace_back(n.second, name);
  std::sort(order.rbegin(), order.rend());
  FILE* kf = std::fopen((base + ".kernels.csv").c_str(), "w");
  if (kf) {
    std::fprintf(kf, "name,calls,total_us\n");
    for (const auto& [us, name] : order)
      std::fprintf(kf, "%s,%.2f,%.1f\n", name.c_str(), double(per_name[name].first) / measured,
                   us / measured);
    std::fclose(kf);
  }
  std::fprintf(stderr, "cupti_tracer: %zu steps measured (of %zu), %zu kernel names -> %s.*.csv\n",
               measured, steps.size(), order.size(), base.c_str());
}

void launched(const char* name, std::uint64_t* id) {
  *id = g_next_id++;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_launch_names[*id] = name;
  }
  cuptiActivityPushExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, *id);
}

void finished() {
  std::uint64_t last = 0;
  cuptiActivityPopExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &last);
}

}  // namespace

extern "C" {

// The CUDA driver's entry for CUDA_INJECTION64_PATH.
int InitializeInjection() {
  start();
  return 1;
}

// Kokkos Tools.
void kokkosp_init_library(int, std::uint64_t, std::uint32_t, void*) { start(); }
void kokkosp_request_tool_settings(std::uint32_t, ToolSettings* settings) {
  settings->requires_global_fencing = false;
}
void kokkosp_finalize_library() { write_tables(); }
void kokkosp_begin_parallel_for(const char* name, std::uint32_t, std::uint64_t* id) {
  launched(name, id);
}
void kokkosp_end_parallel_for(std::uint64_t) { finished(); }
void kokkosp_begin_parallel_reduce(const char* name, std::uint32_t, std::uint64_t* id) {
  launched(name, id);
}
void kokkosp_end_parallel_reduce(std::uint64_t) { finished(); }
void kokkosp_begin_parallel_scan(const char* name, std::uint32_t, std::uint64_t* id) {
  launched(name, id);
}
void kokkosp_end_parallel_scan(std::uint64_t) { finished(); }
void kokkosp_push_profile_region(const char* name) {
  const bool step = std::strcmp(name, "kmoe::step") == 0;
  g_regions.push_back(step ? 1 : 0);
  if (step && g_step_depth++ == 0) cuptiGetTimestamp(&g_step_begin);
}
void kokkosp_pop_profile_region() {
  if (g_regions.empty()) return;
  const bool step = g_regions.back() == 1;
  g_regions.pop_back();
  if (!step || --g_step_depth != 0) return;
  std::uint64_t now = 0;
  cuptiGetTimestamp(&now);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_steps.emplace_back(g_step_begin, now);
}

}  // extern "C"
