// How a rank uses its node (parallel/execution, RUNTIME.md section 6), on 1, 2 and 4 ranks of
// one node: node-local ranks, the rank's share of the cores, thread counts chosen or taken from
// the user, GPU choice, and the oversubscription note.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "core/gemm.hpp"
#include "core/run_context.hpp"
#include "parallel/execution.hpp"

namespace kmoe {
namespace {

// Sets (or unsets, value nullptr) a variable for the test's lifetime.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

ExecutionPlan plan_with(std::vector<std::string> args) {
  args.insert(args.begin(), "test_execution");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return plan_execution(static_cast<int>(argv.size()), argv.data());
}

bool host_threads() {
#if defined(KOKKOS_ENABLE_OPENMP) || defined(KOKKOS_ENABLE_THREADS)
  return true;
#else
  return false;
#endif
}

TEST(Execution, NodeLocalRanksAndCoreShares) {
  ScopedEnv blas("OPENBLAS_NUM_THREADS", nullptr), omp("OMP_NUM_THREADS", nullptr),
      kokkos("KOKKOS_NUM_THREADS", nullptr);
  const ExecutionPlan p = plan_with({});
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  EXPECT_EQ(p.local_size, world);  // one node
  std::vector<int> locals(world);
  MPI_Allgather(&p.local_rank, 1, MPI_INT, locals.data(), 1, MPI_INT, MPI_COMM_WORLD);
  EXPECT_EQ(std::set<int>(locals.begin(), locals.end()).size(), std::size_t(world));
  EXPECT_GE(p.rank_cpus, 1);
  EXPECT_LE(p.rank_cpus, p.node_cpus);
  EXPECT_EQ(p.kokkos_threads, host_threads() ? p.rank_cpus : 1);
  EXPECT_EQ(p.blas_threads, p.rank_cpus);
#if defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP)
  EXPECT_GE(p.device_id, 0);
#else
  EXPECT_EQ(p.device_id, -1);
#endif
}

TEST(Execution, TheUsersThreadCountsWin) {
  ScopedEnv blas("OPENBLAS_NUM_THREADS", "3"), omp("OMP_NUM_THREADS", nullptr),
      kokkos("KOKKOS_NUM_THREADS", nullptr);
  const ExecutionPlan p = plan_with({"--kokkos-num-threads=5"});
  EXPECT_EQ(p.blas_threads, 3);
  EXPECT_EQ(p.kokkos_threads, host_threads() ? 5 : 1);
  ScopedEnv omp2("OMP_NUM_THREADS", "2,1");  // a nested list: its first level
  EXPECT_EQ(plan_with({}).kokkos_threads, host_threads() ? 2 : 1);
}

TEST(Execution, OversubscriptionIsNoted) {
  ScopedEnv omp("OMP_NUM_THREADS", nullptr), kokkos("KOKKOS_NUM_THREADS", nullptr);
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  {
    // Each rank's share of the cores: oversubscribed only with more ranks than cores.
    ScopedEnv blas("OPENBLAS_NUM_THREADS", nullptr);
    const ExecutionPlan p = plan_with({});
    bool noted = false;
    for (const auto& n : p.notes) noted = noted || n.find("oversubscribed") != std::string::npos;
    if (world <= p.node_cpus) {
      EXPECT_FALSE(noted);
    }
  }
  const ExecutionPlan fair = plan_with({});
  const std::string too_many = std::to_string(fair.node_cpus + 1);
  ScopedEnv blas("OPENBLAS_NUM_THREADS", too_many.c_str());
  const ExecutionPlan p = plan_with({});
  bool noted = false;
  for (const auto& n : p.notes) noted = noted || n.find("oversubscribed") != std::string::npos;
  EXPECT_EQ(noted, p.local_rank == 0);
}

// A strided batch's products go side by side on the Kokkos threads only where each BLAS call
// then runs on one thread: a sequential or OpenMP OpenBLAS, or one BLAS thread (a pthreads
// OpenBLAS next to OpenMP threads gets one unless the user says otherwise). Never on Serial.
TEST(Execution, BatchesSideBySideOnlyWithOneThreadPerBlasCall) {
  ScopedEnv omp("OMP_NUM_THREADS", nullptr), kokkos("KOKKOS_NUM_THREADS", nullptr),
      wait("OMP_WAIT_POLICY", nullptr);
  using GetParallel = int (*)();
  const auto parallel = reinterpret_cast<GetParallel>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  const int kind = parallel ? parallel() : -1;  // 0 sequential, 1 pthreads, 2 OpenMP
  for (const char* user : {static_cast<const char*>(nullptr), "1", "2"}) {
    ScopedEnv blas("OPENBLAS_NUM_THREADS", user);
    ExecutionPlan p = plan_with({});
    p.kokkos_threads = host_threads() ? 2 : 1;  // as if the rank had 2 cores
    if (!user) p.blas_threads = p.kokkos_threads;
    apply_execution(p, "test_execution");
    int want = 1;
    const bool openblas = dlsym(RTLD_DEFAULT, "openblas_set_num_threads") != nullptr;
    if (host_threads() && openblas && (kind == 0 || kind == 2 || p.blas_threads == 1)) want = 2;
#if defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP) || defined(KOKKOS_ENABLE_SYCL)
    want = 1;
#endif
    EXPECT_EQ(p.batch_threads, want) << "OPENBLAS_NUM_THREADS " << (user ? user : "unset");
    // A run context takes the plan's threads; with device paths one GEMM at a time, as on GPUs.
    EXPECT_EQ(make_run_context(Precision::Fp32, p.batch_threads).batch_threads,
              device_paths() ? 1 : want)
        << "a run context takes the plan's threads";
  }
}

}  // namespace
}  // namespace kmoe
