// MPI on device memory without a CUDA-aware MPI: the data plane of an axis copies each device
// buffer to a page-locked host buffer, runs the MPI Communicator's operation on it and copies
// the result back. Slower than a device-aware transport (two extra copies per transfer), but it
// works with any MPI. ProcessGrid installs it (parallel.backend = mpi) when MemSpace is not
// host-accessible and parallel.cuda_aware_mpi is not true (which Open MPI builds refuse).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/kokkos_types.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

// parallel.cuda_aware_mpi resolved: true only when the user says so ("true": the MPI takes
// device pointers in every operation kmoe uses, the nonblocking collectives of the gradient
// buckets included); auto and false stage. kmoe does not query the MPI: Open MPI's
// MPIX_Query_cuda_support covers blocking collectives and point-to-point only, and its CUDA
// support documents no nonblocking collectives on device memory.
bool mpi_takes_device_pointers(CudaAwareMpi cuda_aware_mpi);

// Whether the MPI data plane must stage: MemSpace is not host-accessible and MPI cannot take
// device pointers. Throws kmoe::Error for cuda_aware_mpi = true on device memory under Open MPI,
// whose CUDA support takes no nonblocking collectives.
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

// One axis' data plane for the MPI backend as ProcessGrid builds it: the axis itself where MPI
// reads the memory (host-accessible MemSpace, or a CUDA-aware MPI the user vouches for), else
// a StagedMpiComm over it. For code that holds an axis of its own (the unit tests). `axis` must
// outlive it.
class MpiDataPlane {
 public:
  explicit MpiDataPlane(const Communicator& axis,
                        CudaAwareMpi cuda_aware_mpi = CudaAwareMpi::Auto);
  const DataComm& get() const {
    if (staged_) return *staged_;
    return axis_;
  }

 private:
  const Communicator& axis_;
  std::unique_ptr<StagedMpiComm> staged_;
};

}  // namespace kmoe
