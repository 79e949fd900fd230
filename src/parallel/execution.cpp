#include "parallel/execution.hpp"

#include <dlfcn.h>
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <type_traits>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#elif defined(KOKKOS_ENABLE_HIP)
#include <hip/hip_runtime_api.h>
#endif

#include "core/device_memory.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {
namespace {

#if defined(KOKKOS_ENABLE_OPENMP) || defined(KOKKOS_ENABLE_THREADS)
constexpr bool kHostThreads = true;
#else
constexpr bool kHostThreads = false;
#endif
// Kokkos' host threads are OpenMP threads (inside whose regions an OpenMP OpenBLAS runs one
// thread per call).
#if defined(KOKKOS_ENABLE_OPENMP)
constexpr bool kOpenMPHost = std::is_same_v<Kokkos::DefaultHostExecutionSpace, Kokkos::OpenMP>;
#else
constexpr bool kOpenMPHost = false;
#endif
#if defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP) || defined(KOKKOS_ENABLE_SYCL)
constexpr bool kDevice = true;
#else
constexpr bool kDevice = false;
#endif

// The value of a --kokkos-NAME=V / --kokkos-NAME V option, or "" if absent.
std::string kokkos_arg(int argc, char** argv, const char* name) {
  const std::string flag = std::string("--kokkos-") + name;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.compare(0, flag.size() + 1, flag + "=") == 0) return a.substr(flag.size() + 1);
    if (a == flag && i + 1 < argc) return argv[i + 1];
  }
  return "";
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// A positive thread count from an option or variable (OMP_NUM_THREADS may be a list: its first
// entry), or 0.
int threads_of(const std::string& text) {
  const int n = std::atoi(text.c_str());
  return n > 0 ? n : 0;
}

int device_count() {
  int n = 0;
#if defined(KOKKOS_ENABLE_CUDA)
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
#elif defined(KOKKOS_ENABLE_HIP)
  if (hipGetDeviceCount(&n) != hipSuccess) n = 0;
#endif
  return n;
}

template <class F>
F blas_symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

ExecutionPlan plan_execution(int argc, char** argv) {
  ExecutionPlan plan;
  MPI_Comm node;
  mpi_check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  MPI_Comm_rank(node, &plan.local_rank);
  MPI_Comm_size(node, &plan.local_size);
  plan.node_cpus = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));

  // The ranks of the node with exactly this rank's affinity mask share its cores.
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof mask, &mask) != 0) {
    for (int c = 0; c < plan.node_cpus && c < CPU_SETSIZE; ++c) CPU_SET(c, &mask);
  }
  std::vector<cpu_set_t> masks(plan.local_size);
  MPI_Allgather(&mask, sizeof mask, MPI_BYTE, masks.data(), sizeof mask, MPI_BYTE, node);
  int sharers = 0;
  cpu_set_t all;
  CPU_ZERO(&all);
  for (auto& m : masks) {
    if (CPU_EQUAL(&m, &mask)) ++sharers;
    CPU_OR(&all, &all, &m);
  }
  plan.rank_cpus = std::max(1, CPU_COUNT(&mask) / sharers);

  // Kokkos threads: the user's choice, else the rank's share of the cores.
  int user_threads = threads_of(kokkos_arg(argc, argv, "num-threads"));
  if (!user_threads) user_threads = threads_of(kokkos_arg(argc, argv, "threads"));  // Kokkos 3
  if (!user_threads) user_threads = threads_of(env("KOKKOS_NUM_THREADS"));
  if (!user_threads) user_threads = threads_of(env("OMP_NUM_THREADS"));
  if (kHostThreads) {
    plan.kokkos_threads = user_threads ? user_threads : plan.rank_cpus;
    if (!user_threads)
      setenv("KOKKOS_NUM_THREADS", std::to_string(plan.kokkos_threads).c_str(), 1);
    // Unset, OMP_PROC_BIND means unbound threads in the OpenMP runtime (which has read its
    // environment already); saying so keeps Kokkos from warning about it at every start.
    // (docs/CONVENTIONS.md says when binding them is worth it.)
    if (env("OMP_PROC_BIND").empty() && env("OMP_PLACES").empty())
      setenv("OMP_PROC_BIND", "false", 0);
  }

  // BLAS threads: the user's choice, else what the Kokkos threads have (they take turns).
  int user_blas = 0;
  for (const char* v : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "BLIS_NUM_THREADS",
                        "MKL_NUM_THREADS"}) {
    if (!user_blas) user_blas = threads_of(env(v));
  }
  plan.blas_threads = user_blas ? user_blas : (kHostThreads ? plan.kokkos_threads : plan.rank_cpus);

  // One GPU per rank, from the node-local rank.
  if (kDevice) {
    const bool chosen = !kokkos_arg(argc, argv, "device-id").empty() ||
                        !kokkos_arg(argc, argv, "device").empty() ||
                        !kokkos_arg(argc, argv, "map-device-id-by").empty() ||
                        !env("KOKKOS_DEVICE_ID").empty();
    const int gpus = device_count();
    if (chosen) {  // what Kokkos will take: the option (Kokkos 4 or 3 spelling), else the variable
      std::string id = kokkos_arg(argc, argv, "device-id");
      if (id.empty()) id = kokkos_arg(argc, argv, "device");
      if (id.empty()) id = env("KOKKOS_DEVICE_ID");
      plan.device_id = id.empty() ? -1 : std::atoi(id.c_str());  // -1: mapped by Kokkos
    } else if (gpus > 0) {
      plan.device_id = plan.local_rank % gpus;
      setenv("KOKKOS_DEVICE_ID", std::to_string(plan.device_id).c_str(), 1);
      if (plan.local_size > gpus && plan.local_rank == 0) {
        std::ostringstream s;
        s << plan.local_size << " ranks on this node share its " << gpus
          << " visible GPU(s); kmoe expects one rank per GPU";
        plan.notes.push_back(s.str());
      }
    }
  }

  // Oversubscription: the threads the node's ranks run at once against the cores they have.
  const int busy = std::max(plan.kokkos_threads, plan.blas_threads);
  int demand = 0;
  MPI_Allreduce(&busy, &demand, 1, MPI_INT, MPI_SUM, node);
  const int cores = CPU_COUNT(&all);
  if (demand > cores && plan.local_rank == 0) {
    std::ostringstream s;
    s << "the " << plan.local_size << " rank(s) on this node run " << demand
      << " threads at once on " << cores
      << " cores: oversubscribed (threads per rank: OMP_NUM_THREADS for Kokkos, "
         "OPENBLAS_NUM_THREADS for the BLAS; or bind ranks to disjoint cores)";
    plan.notes.push_back(s.str());
  }
  MPI_Comm_free(&node);
  return plan;
}

void apply_execution(ExecutionPlan& plan, const std::string& program) {
  using SetThreads = void (*)(int);
  using GetParallel = int (*)();
  const bool user_blas = !env("OPENBLAS_NUM_THREADS").empty() ||
                         !env("GOTO_NUM_THREADS").empty() || !env("BLIS_NUM_THREADS").empty() ||
                         !env("MKL_NUM_THREADS").empty();
  if (auto set = blas_symbol<SetThreads>("openblas_set_num_threads")) {
    const auto parallel = blas_symbol<GetParallel>("openblas_get_parallel");
    const int kind = parallel ? parallel() : -1;  // 0 sequential, 1 pthreads, 2 OpenMP
    // OpenBLAS's own threads next to Kokkos' OpenMP threads: after each kernel the OpenMP
    // threads keep spinning for a while and take the cores from the BLAS threads (on the main
    // deck, one rank on 2 cores: 1,161 tokens/s with 2 BLAS threads, 2,132 with 1; 2,585 with
    // OMP_WAIT_POLICY=passive; 2,786 with the OpenMP OpenBLAS, which shares Kokkos' pool).
    if (kHostThreads && kind == 1 && plan.kokkos_threads > 1 && !user_blas) {
      const std::string wait = env("OMP_WAIT_POLICY");
      const bool passive = wait == "passive" || wait == "PASSIVE";
      if (!passive) {
        plan.blas_threads = 1;
        if (plan.local_rank == 0)
          plan.notes.push_back(
              "OpenBLAS (pthreads) runs on 1 thread next to " +
              std::to_string(plan.kokkos_threads) +
              " OpenMP threads, whose spinning would take the cores from its own; an OpenMP "
              "build of OpenBLAS (Debian: libopenblas0-openmp) shares Kokkos' threads and is "
              "faster, or set OMP_WAIT_POLICY=passive and OPENBLAS_NUM_THREADS");
      }
    }
    if (!user_blas) set(plan.blas_threads);
    // A strided batch's products (and the MoE experts) side by side on the Kokkos threads
    // where each BLAS call then runs on one thread: a sequential OpenBLAS, the OpenMP one inside
    // an OpenMP region (Kokkos' OpenMP backend, not its Threads one), or one BLAS thread.
    if (kHostThreads && !kDevice && plan.kokkos_threads > 1 &&
        (kind == 0 || (kind == 2 && kOpenMPHost) || plan.blas_threads == 1))
      plan.batch_threads = plan.kokkos_threads;
  } else if (auto set_blis = blas_symbol<SetThreads>("bli_thread_set_num_threads")) {
    if (!user_blas) set_blis(plan.blas_threads);
  } else if (auto set_mkl = blas_symbol<SetThreads>("MKL_Set_Num_Threads")) {
    if (!user_blas) set_mkl(plan.blas_threads);
  }
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  if (world_rank == 0)
    for (const auto& n : plan.notes) std::cerr << program << ": note: " << n << std::endl;
}

KokkosSession::KokkosSession(int& argc, char** argv, const std::string& program)
    : plan_(plan_execution(argc, argv)) {
  Kokkos::initialize(argc, argv);  // consumes --kokkos-* arguments
  if (start_device_memory_check_from_env())
    plan_.notes.push_back(
        Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible && !device_paths()
            ? "KMOE_CHECK_DEVICE_MEMORY=1 records nothing on a host backend without "
              "KMOE_DEVICE_PATHS=1"
            : "device allocations recorded (KMOE_CHECK_DEVICE_MEMORY=1): MPI, HDF5 and "
              "safetensors refuse device pointers");
  apply_execution(plan_, program);
}

KokkosSession::~KokkosSession() { Kokkos::finalize(); }

}  // namespace kmoe
