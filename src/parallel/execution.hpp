// How a rank uses its node, decided once between MPI_Init and Kokkos' start (RUNTIME.md
// section 6): which GPU it drives, how many Kokkos threads and BLAS threads it runs, and
// whether the ranks of its node oversubscribe the cores.
//
// - GPU builds (CUDA, HIP, SYCL): one rank per GPU, chosen from the node-local rank (an
//   MPI_COMM_TYPE_SHARED split) modulo the GPUs this process sees, on every Kokkos version
//   (Kokkos 3.x would otherwise give every rank of a node GPU 0). --kokkos-device-id or
//   KOKKOS_DEVICE_ID, and CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES set per rank by the
//   launcher, take precedence.
// - Threads: the cores this rank may use are its affinity mask, shared with the other ranks of
//   the node whose mask is the same (no binding: everyone sees every core). Unless the user
//   says (--kokkos-num-threads, KOKKOS_NUM_THREADS, OMP_NUM_THREADS), an OpenMP Kokkos runs
//   that many threads; the BLAS gets the same number (OPENBLAS_NUM_THREADS etc. take
//   precedence), since Kokkos kernels and BLAS calls take turns on the same cores; see
//   apply_execution for a pthreads BLAS next to OpenMP threads.
// - Notes (world rank 0) name what oversubscribes the cores or shares a GPU.
#pragma once

#include <string>
#include <vector>

namespace kmoe {

struct ExecutionPlan {
  int local_rank = 0, local_size = 1;  // this rank on its node
  int node_cpus = 1;                   // processors online on the node
  int rank_cpus = 1;                   // the cores this rank may use (see above)
  int kokkos_threads = 1;              // 1 on Serial and GPU backends
  int blas_threads = 1;                // the host BLAS's threads per call
  int batch_threads = 1;               // products of a strided batch run at once (gemm.hpp)
  int device_id = -1;                  // the GPU this rank drives; -1 on CPU backends
  std::vector<std::string> notes;      // oversubscription, GPU sharing, BLAS threading
};

// Collective over MPI_COMM_WORLD, before Kokkos starts: reads the environment and argv
// (--kokkos-* options, not consumed), and sets the environment variables Kokkos reads
// (KOKKOS_DEVICE_ID, KOKKOS_NUM_THREADS) where the user left them unset.
ExecutionPlan plan_execution(int argc, char** argv);

// After Kokkos starts: gives the BLAS its thread count (OpenBLAS, BLIS or MKL, whichever is
// linked; a pthreads OpenBLAS next to OpenMP Kokkos threads gets 1 unless the OpenMP threads
// wait passively), lets strided GEMM batches run their products side by side on the Kokkos
// threads where each OpenBLAS call then takes one thread (plan.batch_threads, which the run
// context takes: core/run_context.hpp), and prints
// the plan's notes on world rank 0 (`program: note: ...`).
void apply_execution(ExecutionPlan& plan, const std::string& program);

// Kokkos started by the plan above, finalized on scope exit: what every kmoe program uses.
class KokkosSession {
 public:
  KokkosSession(int& argc, char** argv, const std::string& program);
  ~KokkosSession();
  KokkosSession(const KokkosSession&) = delete;
  KokkosSession& operator=(const KokkosSession&) = delete;
  const ExecutionPlan& plan() const { return plan_; }

 private:
  ExecutionPlan plan_;
};

}  // namespace kmoe
