// The NCCL data plane of one grid axis (parallel.backend = nccl, built with KMOE_ENABLE_NCCL):
// gradients, expert rows and pipeline activations move between GPUs without a host copy. It is
// built over the axis's MPI Communicator, which bootstraps it (rank 0 makes the NCCL unique id,
// MPI broadcasts it) and names it in errors. NCCL is CUDA-only: a CPU or HIP Kokkos build
// refuses it (kmoe::Error) and uses parallel.backend = mpi.
//
// Operations are stream-ordered: every operation of every axis runs on the one CUDA stream of
// the Kokkos execution space, after the kernels that produced its buffers, in the order the
// rank issues them. NCCL documents that operations of several communicators in flight at once
// on different streams can deadlock; on one stream they cannot overlap, and every rank of a
// stage issues the same sequence (the step's program), so the members of each operation reach
// it in the same order. Transfers that depend on each other go as one NCCL group
// (start_send_recv: the pipeline's send with the receive that follows it). A started operation
// records a CUDA event, and complete() polls it under the axis's watchdog
// (parallel.watchdog_seconds): a rank stuck too long names the operation, the axis and its
// world ranks, aborts NCCL and then the job.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/communicator.hpp"

// The handles of nccl.h and cuda_runtime.h (ncclComm_t, cudaStream_t), declared here so that
// users of this header do not need the CUDA include paths.
struct ncclComm;
struct CUstream_st;

namespace kmoe {

class NcclComm : public DataComm {
 public:
  // Collective over `axis` (every member calls it, in the same order as every other axis's
  // construction). The axis must be valid.
  explicit NcclComm(const Communicator& axis);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  Pending start_allreduce_sum(float* data, std::int64_t n) const override;
  Pending start_reduce_scatter_sum(float* data,
                                   const std::vector<std::int64_t>& counts) const override;
  Pending start_allgather(float* data, const std::vector<std::int64_t>& counts) const override;
  Pending start_allgather(std::uint16_t* data,
                          const std::vector<std::int64_t>& counts) const override;
  Pending start_send(const float* data, std::int64_t n, int peer) const override;
  Pending start_send_recv(const float* send, std::int64_t n_send, int to, float* recv,
                          std::int64_t n_recv, int from) const override;
  void complete(Pending& p) const override;
  void all_to_all_v(const float* send, const std::vector<std::int64_t>& send_counts, float* recv,
                    const std::vector<std::int64_t>& recv_counts) const override;
  void recv(float* data, std::int64_t n, int peer) const override;

 private:
  struct NcclOp;
  // One ncclReduce to (reduce, floats) or ncclBroadcast from each member's block of `counts`
  // elements of `bytes` bytes (4: fp32, 2: bf16 words), in place, in one group.
  Pending start_rooted(void* data, const std::vector<std::int64_t>& counts, bool reduce,
                       int bytes, const char* op) const;

  // Checks that `peer` is another member (op names the transfer in the error).
  void check_peer(int peer, const char* op) const;
  // Records the completion event of the operation just enqueued.
  Pending record(const char* op, int peer, bool collective) const;
  [[noreturn]] void watchdog_abort(const NcclOp& p, double waited) const;
  // ncclCommAbort (after an asynchronous NCCL error or the watchdog).
  void abort_all() const;
  void nccl_check(int rc, const char* call) const;
  void cuda_check(int rc, const char* call) const;
  void release() noexcept;

  std::string name_;
  double watchdog_s_ = 0.0;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  mutable ncclComm* comm_ = nullptr;
  CUstream_st* stream_ = nullptr;  // the Kokkos execution space's
  mutable std::int64_t seq_ = 0;   // collectives started, for the watchdog's message
};

}  // namespace kmoe
