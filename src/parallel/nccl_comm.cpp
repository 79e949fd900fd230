// Compiled by the host C++ compiler: only the CUDA runtime and NCCL host APIs are called (no
// kernels), so a CUDA toolkit's headers and libraries suffice, with or without nvcc.
#include "parallel/nccl_comm.hpp"

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>
#include <type_traits>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

namespace {

// NCCL runs on CUDA devices only; a HIP build would need RCCL, which kmoe does not support.
#if defined(KOKKOS_ENABLE_CUDA)
constexpr bool kKokkosCuda = std::is_same<ExecSpace, Kokkos::Cuda>::value;
#else
constexpr bool kKokkosCuda = false;
#endif

// The stream of Kokkos's default execution space instance: kernels and NCCL collectives on it
// run in issue order, so a collective never reads a buffer before its producer has finished.
cudaStream_t kokkos_stream() {
#if defined(KOKKOS_ENABLE_CUDA)
  return Kokkos::Cuda().cuda_stream();
#else
  return nullptr;
#endif
}

// What rank 0 of the axis broadcasts: the unique id, or why it has none (so that a failure
// there is an error on every member rather than a hang in the broadcast).
struct Bootstrap {
  int rc = ncclSuccess;
  ncclUniqueId id;
};

}  // namespace

// A started operation: its completion event, recorded on its channel's stream.
struct NcclComm::NcclOp : PendingOp {
  cudaEvent_t event = nullptr;
  const char* op = "";
  int peer = -1;
  bool collective = false;
  std::int64_t mark = 0;
  ncclComm_t comm = nullptr;
  ~NcclOp() override {
    if (event) cudaEventDestroy(event);
  }
};

void NcclComm::nccl_check(int rc, const char* call) const {
  if (rc == ncclSuccess) return;
  const ncclResult_t r = static_cast<ncclResult_t>(rc);
  // ncclGetLastError (NCCL 2.13) adds the detail NCCL logged, e.g. which peer it lost.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  const char* detail = ncclGetLastError(comm_);
#else
  const char* detail = nullptr;
#endif
  KMOE_FAIL(call << " failed on the " << name_
                 << " axis (parallel.backend = nccl): " << ncclGetErrorString(r)
                 << (detail && *detail ? ": " : "") << (detail ? detail : ""));
}

void NcclComm::cuda_check(int rc, const char* call) const {
  if (rc == cudaSuccess) return;
  const cudaError_t e = static_cast<cudaError_t>(rc);
  KMOE_FAIL(call << " failed on the " << name_ << " axis (parallel.backend = nccl): "
                 << cudaGetErrorName(e) << ": " << cudaGetErrorString(e));
}

NcclComm::NcclComm(const Communicator& axis)
    : name_(axis.name()),
      watchdog_s_(axis.watchdog_seconds()),
      rank_(axis.rank()),
      size_(axis.size()) {
  // Every member throws here alike (the condition is the build's), before any collective.
  KMOE_REQUIRE(kKokkosCuda,
               "parallel.backend = nccl needs Kokkos built with CUDA as its default execution "
               "space; this Kokkos runs on "
                   << ExecSpace::name()
                   << " (NCCL is CUDA-only; CPU and HIP builds use parallel.backend = mpi)");
  KMOE_REQUIRE(axis.valid(), "NcclComm over the " << name_ << " axis, which has no members here");
  for (int r = 0; r < size_; ++r) world_ranks_.push_back(axis.world_rank(r));
  try {
    Bootstrap boot{};
    if (rank_ == 0) boot.rc = ncclGetUniqueId(&boot.id);
    mpi_check(MPI_Bcast(&boot, static_cast<int>(sizeof boot), MPI_BYTE, 0, axis.comm()),
              "MPI_Bcast(ncclUniqueId)");
    nccl_check(boot.rc, "ncclGetUniqueId (on the axis's rank 0)");
    stream_ = kokkos_stream();
    ncclComm_t comm = nullptr;
    nccl_check(ncclCommInitRank(&comm, size_, boot.id, rank_), "ncclCommInitRank");
    comm_ = comm;
  } catch (...) {
    release();
    throw;
  }
}

void NcclComm::release() noexcept {
  // At process teardown (MPI or Kokkos already finalized) the exit reclaims everything, and
  // NCCL may no longer have a CUDA context to talk to.
  int finalized = 0;
  MPI_Finalized(&finalized);
  const bool teardown = finalized || !Kokkos::is_initialized();
  if (comm_ && !teardown) ncclCommDestroy(comm_);
  comm_ = nullptr;
}

NcclComm::~NcclComm() { release(); }

void NcclComm::abort_all() const {
  if (comm_) {
    ncclCommAbort(comm_);  // its result is of no use: the job stops either way
    comm_ = nullptr;
  }
}

void NcclComm::check_peer(int peer, const char* op) const {
  KMOE_REQUIRE(peer >= 0 && peer < size_ && peer != rank_,
               op << " on the " << name_ << " axis (parallel.backend = nccl): peer " << peer
                  << " is not another member of the axis's " << size_);
}

Pending NcclComm::record(const char* op, int peer, bool collective) const {
  auto p = std::make_unique<NcclOp>();
  p->op = op;
  p->peer = peer;
  p->collective = collective;
  p->mark = collective ? ++seq_ : 0;
  p->comm = comm_;
  cuda_check(cudaEventCreateWithFlags(&p->event, cudaEventDisableTiming),
             "cudaEventCreateWithFlags");
  cuda_check(cudaEventRecord(p->event, stream_), "cudaEventRecord");
  return Pending(std::move(p));
}

void NcclComm::complete(Pending& pending) const {
  if (!pending) return;
  const NcclOp& p = static_cast<const NcclOp&>(*pending);
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaEventQuery(p.event);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) cuda_check(q, "cudaEventQuery");
    // A failed peer or network shows up here, not in the event: the kernel would spin forever.
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(p.comm, &async), "ncclCommGetAsyncError");
    if (async != ncclSuccess) {
      std::ostringstream what;
      what << p.op << " failed on the " << name_
           << " axis (parallel.backend = nccl): " << ncclGetErrorString(async)
           << "; the NCCL communicators of the axis are aborted";
      abort_all();
      KMOE_FAIL(what.str());
    }
    if (watchdog_s_ > 0) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (waited > watchdog_s_) watchdog_abort(p, waited);
    }
    std::this_thread::yield();
  }
  add_comm_wait(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  pending.reset();
}

void NcclComm::watchdog_abort(const NcclOp& p, double waited) const {
  // NCCL cannot tell which member is missing (there are no arrival notices as on the MPI
  // axes): name the peer of a transfer, or every member of a collective.
  std::ostringstream what;
  if (!p.collective) {
    what << "the transfer with world rank " << world_ranks_[p.peer] << " did not complete";
  } else {
    what << "one of world ranks ";
    for (int r = 0; r < size_; ++r) what << (r ? ", " : "") << world_ranks_[r];
    what << " did not arrive or the transfer did not complete";
  }
  const std::string which =
      p.collective ? ", collective #" + std::to_string(p.mark) : std::string();
  std::fprintf(stderr,
               "kmoe: watchdog: world rank %d waited %.0f s (parallel.watchdog_seconds) in %s on "
               "the %s axis (NCCL, %d ranks%s); %s; aborting the job\n",
               world_ranks_[rank_], waited, p.op, name_.c_str(), size_, which.c_str(),
               what.str().c_str());
  std::fflush(stderr);
  // Abort NCCL first: its kernels and proxy threads would otherwise keep the GPU busy.
  abort_all();
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return; the compiler does not know that
}

Pending NcclComm::start_allreduce_sum(float* data, std::int64_t n) const {
  if (size_ == 1 || n == 0) return nullptr;
  nccl_check(
      ncclAllReduce(data, data, static_cast<std::size_t>(n), ncclFloat, ncclSum, comm_, stream_),
      "ncclAllReduce");
  return record("allreduce_sum(float)", -1, true);
}

Pending NcclComm::start_reduce_scatter_sum(float* data,
                                           const std::vector<std::int64_t>& counts) const {
  return start_rooted(data, counts, true, 4, "reduce_scatter_sum(float)");
}

Pending NcclComm::start_allgather(float* data, const std::vector<std::int64_t>& counts) const {
  return start_rooted(data, counts, false, 4, "allgather(float)");
}

Pending NcclComm::start_allgather(std::uint16_t* data,
                                  const std::vector<std::int64_t>& counts) const {
  return start_rooted(data, counts, false, 2, "allgather(bf16)");
}

Pending NcclComm::start_rooted(void* data, const std::vector<std::int64_t>& counts, bool reduce,
                               int bytes, const char* op) const {
  check_block_counts(name_, size_, counts);
  if (size_ == 1) return nullptr;
  // ncclReduceScatter and ncclAllGather take equal blocks: one ncclReduce to (ncclBroadcast
  // from) each member in one group, in place. A broadcast moves the bits as they are, so bf16
  // words travel as ncclFloat16.
  const ncclDataType_t type = bytes == 4 ? ncclFloat : ncclFloat16;
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t rc = ncclSuccess;
  std::int64_t at = 0;
  for (int q = 0; q < size_ && rc == ncclSuccess; ++q) {
    void* block = static_cast<char*>(data) + at * bytes;
    const std::size_t n = static_cast<std::size_t>(counts[q]);
    if (n > 0)
      rc = reduce ? ncclReduce(block, block, n, type, ncclSum, q, comm_, stream_)
                  : ncclBroadcast(block, block, n, type, q, comm_, stream_);
    at += counts[q];
  }
  const ncclResult_t end = ncclGroupEnd();  // closed even after a failure
  nccl_check(rc, reduce ? "ncclReduce" : "ncclBroadcast");
  nccl_check(end, "ncclGroupEnd");
  return record(op, -1, true);
}

Pending NcclComm::start_send(const float* data, std::int64_t n, int peer) const {
  check_peer(peer, "send");
  if (n == 0) return nullptr;  // both peers know n: nothing to match
  nccl_check(ncclSend(data, static_cast<std::size_t>(n), ncclFloat, peer, comm_, stream_),
             "ncclSend");
  return record("send", peer, false);
}

Pending NcclComm::start_send_recv(const float* send, std::int64_t n_send, int to, float* recv,
                                  std::int64_t n_recv, int from) const {
  check_peer(to, "send_recv");
  check_peer(from, "send_recv");
  // One group: NCCL progresses both transfers together, so a send whose peer first sends to
  // us cannot block our receive.
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t rc = ncclSuccess;
  const char* failed = "";
  if (n_send > 0) {
    rc = ncclSend(send, static_cast<std::size_t>(n_send), ncclFloat, to, comm_, stream_);
    failed = "ncclSend";
  }
  if (rc == ncclSuccess && n_recv > 0) {
    rc = ncclRecv(recv, static_cast<std::size_t>(n_recv), ncclFloat, from, comm_, stream_);
    failed = "ncclRecv";
  }
  const ncclResult_t end = ncclGroupEnd();  // closed even after a failure
  nccl_check(rc, failed);
  nccl_check(end, "ncclGroupEnd");
  // The receive is complete once the group is: later kernels on the stream see the data, and
  // the host waits here (as in recv) under the watchdog.
  Pending p = record("send_recv", from, false);
  complete(p);
  return nullptr;
}

void NcclComm::recv(float* data, std::int64_t n, int peer) const {
  check_peer(peer, "recv");
  if (n == 0) return;
  // Stream order: the buffer's earlier readers finish before NCCL overwrites it, and later
  // kernels see the data; the host waits for it under the watchdog.
  nccl_check(ncclRecv(data, static_cast<std::size_t>(n), ncclFloat, peer, comm_, stream_),
             "ncclRecv");
  Pending p = record("recv", peer, false);
  complete(p);
}

void NcclComm::all_to_all_v(const float* send, const std::vector<std::int64_t>& send_counts,
                            float* recv, const std::vector<std::int64_t>& recv_counts) const {
  check_all_to_all_counts(name_, size_, rank_, send_counts, recv_counts);
  std::int64_t soff = 0, roff = 0;
  // Every transfer of the exchange in one group, so NCCL runs them concurrently (posted one
  // by one they would serialize and could deadlock); the block to self is a device copy.
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t rc = ncclSuccess;
  const char* failed = "";
  cudaError_t self_rc = cudaSuccess;
  for (int p = 0; p < size_; ++p) {
    const std::size_t ns = static_cast<std::size_t>(send_counts[p]);
    const std::size_t nr = static_cast<std::size_t>(recv_counts[p]);
    if (p == rank_) {
      if (ns > 0)
        self_rc = cudaMemcpyAsync(recv + roff, send + soff, sizeof(float) * ns,
                                  cudaMemcpyDeviceToDevice, stream_);
    } else {
      if (rc == ncclSuccess && ns > 0) {
        rc = ncclSend(send + soff, ns, ncclFloat, p, comm_, stream_);
        failed = "ncclSend";
      }
      if (rc == ncclSuccess && nr > 0) {
        rc = ncclRecv(recv + roff, nr, ncclFloat, p, comm_, stream_);
        failed = "ncclRecv";
      }
    }
    soff += send_counts[p];
    roff += recv_counts[p];
  }
  // The group is closed even after a failure, so NCCL's per-thread group state stays sane.
  const ncclResult_t end = ncclGroupEnd();
  nccl_check(rc, failed);
  nccl_check(end, "ncclGroupEnd");
  cuda_check(self_rc, "cudaMemcpyAsync(all_to_all_v, to self)");
  Pending p = record("all_to_all_v", -1, true);
  complete(p);
}

}  // namespace kmoe
