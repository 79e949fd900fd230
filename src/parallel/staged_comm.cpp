#include "parallel/staged_comm.hpp"

#include <mpi.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/device_memory.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {

using DeviceIn = Kokkos::View<const float*, Layout, MemSpace, Unmanaged>;
using DeviceOut = Kokkos::View<float*, Layout, MemSpace, Unmanaged>;
using HostBuffer = StagedMpiComm::HostBuffer;

// host[0, n) <- device[0, n). deep_copy without an execution space fences before and after, so
// the kernels that wrote the buffer have finished and the copy is complete when it returns.
void to_host(const HostBuffer& host, const float* device, std::int64_t n) {
  if (n <= 0) return;
  const auto first_n = std::make_pair(std::int64_t(0), n);
  mark_host_sync("staged mpi");
  Kokkos::deep_copy(Kokkos::subview(host, first_n), DeviceIn(device, n));
}

void to_device(float* device, const HostBuffer& host, std::int64_t n) {
  if (n <= 0) return;
  const auto first_n = std::make_pair(std::int64_t(0), n);
  mark_host_sync("staged mpi");
  Kokkos::deep_copy(DeviceOut(device, n), Kokkos::subview(host, first_n));
}

// The same for n 16-bit words at the start of a float buffer (bf16 values).
using HostWords = Kokkos::View<std::uint16_t*, Layout, PinnedSpace, Unmanaged>;
using DeviceWords = Kokkos::View<std::uint16_t*, Layout, MemSpace, Unmanaged>;
void to_host(const HostBuffer& host, const std::uint16_t* device, std::int64_t n) {
  if (n <= 0) return;
  mark_host_sync("staged mpi");
  Kokkos::deep_copy(HostWords(reinterpret_cast<std::uint16_t*>(host.data()), n),
                    Kokkos::View<const std::uint16_t*, Layout, MemSpace, Unmanaged>(device, n));
}

void to_device(std::uint16_t* device, const HostBuffer& host, std::int64_t n) {
  if (n <= 0) return;
  mark_host_sync("staged mpi");
  Kokkos::deep_copy(DeviceWords(device, n),
                    HostWords(reinterpret_cast<std::uint16_t*>(host.data()), n));
}

std::int64_t total(const std::vector<std::int64_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), std::int64_t(0));
}

}  // namespace

bool mpi_takes_device_pointers(CudaAwareMpi cuda_aware_mpi) {
  // auto stages: kmoe's data plane runs nonblocking collectives (MPI_Iallreduce, the gradient
  // buckets), which Open MPI documents as unsupported on CUDA memory even where it is CUDA-aware
  // (MPIX_Query_cuda_support covers blocking collectives and point-to-point only). true is the
  // user's word that the MPI takes device pointers in every operation kmoe uses; with Open MPI
  // it is refused (mpi_needs_staging).
  return cuda_aware_mpi == CudaAwareMpi::Yes;
}

bool mpi_needs_staging(CudaAwareMpi cuda_aware_mpi) {
  // Device paths on a CPU backend stage too: the GPU form, through separate host buffers.
  if (!device_paths()) return false;
#if defined(OPEN_MPI) && OPEN_MPI
  KMOE_REQUIRE(cuda_aware_mpi != CudaAwareMpi::Yes,
               "parallel.cuda_aware_mpi = true: kmoe's data plane runs nonblocking collectives "
               "(MPI_Iallreduce, MPI_Ireduce, MPI_Ibcast, MPI_Ialltoall) on device memory, which "
               "Open MPI's CUDA support does not take (it covers point-to-point and blocking "
               "collectives); use parallel.backend = nccl, or parallel.cuda_aware_mpi = auto "
               "(through pinned host buffers)");
#endif
  return !mpi_takes_device_pointers(cuda_aware_mpi);
}

// An operation started on the host copy: the MPI request and the buffer it works on.
struct StagedMpiComm::StagedOp : PendingOp {
  Pending inner;
  HostBuffer host;
  float* result = nullptr;  // an all-reduce copies the sum back here on completion
  std::uint16_t* result_words = nullptr;  // (a gather of 16-bit words)
  std::int64_t n = 0;
};

StagedMpiComm::StagedMpiComm(const Communicator& axis) : axis_(axis) {}

MpiDataPlane::MpiDataPlane(const Communicator& axis, CudaAwareMpi cuda_aware_mpi) : axis_(axis) {
  if (mpi_needs_staging(cuda_aware_mpi)) staged_ = std::make_unique<StagedMpiComm>(axis);
}

StagedMpiComm::HostBuffer StagedMpiComm::take(std::int64_t n) const {
  // The smallest pooled buffer that fits; a new one when none does, with a quarter of headroom
  // (the expert rows' transfers vary from step to step), replacing the largest pooled buffer
  // that is too small, so the pool holds no more buffers than were ever in use at once.
  auto best = pool_.end(), small = pool_.end();
  for (auto it = pool_.begin(); it != pool_.end(); ++it) {
    if (static_cast<std::int64_t>(it->extent(0)) >= n) {
      if (best == pool_.end() || it->extent(0) < best->extent(0)) best = it;
    } else if (small == pool_.end() || it->extent(0) > small->extent(0)) {
      small = it;
    }
  }
  if (best == pool_.end()) {
    if (small != pool_.end()) pool_.erase(small);
    return HostBuffer(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(kHostLabel) + "staged mpi"),
        std::max<std::int64_t>(n + n / 4, 1));
  }
  HostBuffer b = std::move(*best);
  pool_.erase(best);
  return b;
}

void StagedMpiComm::give_back(HostBuffer b) const { pool_.push_back(std::move(b)); }

Pending StagedMpiComm::start_allreduce_sum(float* data, std::int64_t n) const {
  if (axis_.size() == 1) return nullptr;
  auto op = std::make_unique<StagedOp>();
  op->host = take(n);
  op->result = data;
  op->n = n;
  to_host(op->host, data, n);
  op->inner = axis_.start_allreduce_sum(op->host.data(), n);
  return Pending(std::move(op));
}

// The whole buffer travels to the host and back: a member's block is its result (reduce) or
// every block is (gather).
Pending StagedMpiComm::start_blocks(float* data, const std::vector<std::int64_t>& counts,
                                    bool reduce) const {
  if (axis_.size() == 1) return nullptr;
  auto op = std::make_unique<StagedOp>();
  op->n = total(counts);
  op->host = take(op->n);
  op->result = data;
  to_host(op->host, data, op->n);
  op->inner = reduce ? axis_.start_reduce_scatter_sum(op->host.data(), counts)
                     : axis_.start_allgather(op->host.data(), counts);
  return Pending(std::move(op));
}

Pending StagedMpiComm::start_reduce_scatter_sum(float* data,
                                                const std::vector<std::int64_t>& counts) const {
  return start_blocks(data, counts, true);
}

Pending StagedMpiComm::start_allgather(float* data, const std::vector<std::int64_t>& counts) const {
  return start_blocks(data, counts, false);
}

Pending StagedMpiComm::start_allgather(std::uint16_t* data,
                                       const std::vector<std::int64_t>& counts) const {
  if (axis_.size() == 1) return nullptr;
  auto op = std::make_unique<StagedOp>();
  op->n = total(counts);
  op->host = take((op->n + 1) / 2);  // two words a float
  op->result_words = data;
  to_host(op->host, data, op->n);
  op->inner = axis_.start_allgather(reinterpret_cast<std::uint16_t*>(op->host.data()), counts);
  return Pending(std::move(op));
}

Pending StagedMpiComm::start_send(const float* data, std::int64_t n, int peer) const {
  auto op = std::make_unique<StagedOp>();
  op->host = take(n);
  to_host(op->host, data, n);
  op->inner = axis_.start_send(op->host.data(), n, peer);
  return Pending(std::move(op));
}

Pending StagedMpiComm::start_send_recv(const float* send, std::int64_t n_send, int to, float* recv,
                                       std::int64_t n_recv, int from) const {
  auto op = std::make_unique<StagedOp>();
  op->host = take(n_send);
  to_host(op->host, send, n_send);
  HostBuffer host_recv = take(n_recv);
  op->inner = axis_.start_send_recv(op->host.data(), n_send, to, host_recv.data(), n_recv, from);
  to_device(recv, host_recv, n_recv);
  give_back(std::move(host_recv));
  return Pending(std::move(op));
}

void StagedMpiComm::complete(Pending& pending) const {
  if (!pending) return;
  StagedOp& op = static_cast<StagedOp&>(*pending);
  axis_.complete(op.inner);
  if (op.result) to_device(op.result, op.host, op.n);
  if (op.result_words) to_device(op.result_words, op.host, op.n);
  give_back(std::move(op.host));
  pending.reset();
}

void StagedMpiComm::all_to_all_v(const float* send, const std::vector<std::int64_t>& send_counts,
                                 float* recv, const std::vector<std::int64_t>& recv_counts) const {
  const std::int64_t n_send = total(send_counts), n_recv = total(recv_counts);
  HostBuffer host_send = take(n_send), host_recv = take(n_recv);
  to_host(host_send, send, n_send);
  axis_.all_to_all_v(host_send.data(), send_counts, host_recv.data(), recv_counts);
  to_device(recv, host_recv, n_recv);
  give_back(std::move(host_send));
  give_back(std::move(host_recv));
}

void StagedMpiComm::recv(float* data, std::int64_t n, int peer) const {
  HostBuffer host = take(n);
  axis_.recv(host.data(), n, peer);
  to_device(data, host, n);
  give_back(std::move(host));
}

}  // namespace kmoe
