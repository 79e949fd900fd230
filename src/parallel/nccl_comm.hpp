// The NCCL data plane of one grid axis (parallel.backend = nccl, built with KMOE_ENABLE_NCCL):
// gradients, expert rows and pipeline activations move between GPUs without a host copy. It is
// built over the axis's MPI Communicator, which bootstraps it (rank 0 makes the NCCL unique id,
// MPI broadcasts it) and names it in errors. NCCL is CUDA-only: a CPU or HIP Kokkos build
// refuses it (kmoe::Error) and uses parallel.backend = mpi.
//
// Operations are stream-ordered. Collectives run on the Kokkos execution space's CUDA stream,
// after the kernels that produced their buffers; a started operation records a CUDA event, and
// complete() polls it under the axis's watchdog (parallel.watchdog_seconds): a rank stuck too
// long names the operation, the axis and its world ranks, aborts NCCL and then the job.
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
  // construction). p2p_streams: point-to-point transfers run on two more NCCL communicators,
  // each with its own stream: one carries sends to higher members (and their receives), the
  // other sends to lower members. A pipeline's forward sends and backward receives then never
  // queue behind each other, so an exchange that MPI completes (a rank sends downstream, then
  // waits for the upstream gradient, while its neighbour does the reverse) cannot deadlock in
  // NCCL's in-order streams. Without it transfers share the Kokkos stream with collectives and
  // must be posted in matching order on both peers. The axis must be valid.
  explicit NcclComm(const Communicator& axis, bool p2p_streams = false);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  Pending start_allreduce_sum(float* data, std::int64_t n) const override;
  Pending start_send(const float* data, std::int64_t n, int peer) const override;
  void complete(Pending& p) const override;
  void all_to_all_v(const float* send, const std::vector<std::int64_t>& send_counts, float* recv,
                    const std::vector<std::int64_t>& recv_counts) const override;
  void recv(float* data, std::int64_t n, int peer) const override;

 private:
  // An NCCL communicator and the stream its operations are enqueued on.
  struct Channel {
    ncclComm* comm = nullptr;
    CUstream_st* stream = nullptr;
    bool own_stream = false;  // created here (p2p), not Kokkos's
  };
  struct NcclOp;
  enum { kMain = 0, kUp = 1, kDown = 2, kChannels = 3 };

  // The channel of a transfer with `peer`, checked to be another member.
  const Channel& p2p(int peer, bool sending, const char* op) const;
  // Makes ch's stream wait for the work already on the Kokkos stream (the buffer's producers
  // and earlier readers); a no-op on the Kokkos stream itself.
  void follow_kokkos(const Channel& ch) const;
  // Records the completion event of the operation just enqueued on ch.
  Pending record(const Channel& ch, const char* op, int peer, bool collective) const;
  [[noreturn]] void watchdog_abort(const NcclOp& p, double waited) const;
  // ncclCommAbort on every channel (after an asynchronous NCCL error or the watchdog).
  void abort_all() const;
  void nccl_check(int rc, const char* call) const;
  void cuda_check(int rc, const char* call) const;
  void release() noexcept;

  std::string name_;
  double watchdog_s_ = 0.0;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  mutable Channel ch_[kChannels];
  mutable std::int64_t seq_ = 0;  // collectives started, for the watchdog's message
};

}  // namespace kmoe
