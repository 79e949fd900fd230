// MPI on device memory without a CUDA-aware MPI: the data plane of an axis copies each device
// buffer to a page-locked host buffer, runs the MPI Communicator's operation on it and copies
// the result back. Slower than a device-aware transport (two extra copies per transfer), but it
// works with any MPI. ProcessGrid installs it (parallel.backend = mpi) when MemSpace is not
// host-accessible and parallel.cuda_aware_mpi does not resolve to true.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/kokkos_types.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

// parallel.cuda_aware_mpi resolved: true / false as given; auto asks Open MPI
// (MPIX_Query_cuda_support, when <mpi-ext.h> declares it) and is false for every other MPI and
// for Kokkos builds without CUDA (a HIP build stages unless told "true").
bool mpi_takes_device_pointers(CudaAwareMpi cuda_aware_mpi);

// Whether the MPI data plane must stage: MemSpace is not host-accessible and MPI cannot take
// device pointers.
bool mpi_needs_staging(CudaAwareMpi cuda_aware_mpi);

class StagedMpiComm : public DataComm {
 public:
  // `axis` must outlive this object (ProcessGrid owns both and destroys this one first).
  explicit StagedMpiComm(const Communicator& axis);
  StagedMpiComm(const StagedMpiComm&) = delete;
  StagedMpiComm& operator=(const StagedMpiComm&) = delete;

  int rank() const override { return axis_.rank(); }
  int size() const override { return axis_.size(); }
  const char* backend() const override { return "mpi-staged"; }

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

  using HostBuffer = Kokkos::View<float*, Layout, PinnedSpace>;

 private:
  struct StagedOp;
  Pending start_blocks(float* data, const std::vector<std::int64_t>& counts, bool reduce) const;
  // A pinned buffer of at least n floats from the pool (pinned allocations are slow, and a
  // step issues the same transfer sizes every time), returned to it by give_back.
  HostBuffer take(std::int64_t n) const;
  void give_back(HostBuffer b) const;

  const Communicator& axis_;
  mutable std::vector<HostBuffer> pool_;
};

}  // namespace kmoe
