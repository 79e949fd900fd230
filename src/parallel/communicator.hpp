// A duplicated MPI communicator owned by RAII: one per grid axis and purpose (RUNTIME.md
// section 1). It runs the collectives kmoe uses on contiguous host-accessible buffers (the
// control plane: metrics, counts; on CPU builds, or with a CUDA-aware MPI, the data plane too,
// as a DataComm). Every collective and point-to-point transfer is nonblocking underneath and
// waited on by the watchdog: a rank stuck longer than `watchdog_seconds` names the operation,
// the axis and the ranks that did not arrive, then aborts the job. Under the device memory
// check (core/device_memory.hpp) it refuses a buffer in device memory unless MPI was declared
// to take it.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kmoe {

// MPI_Init for every kmoe program. Open MPI's file layer asks each shared-file-pointer
// component whether it can serve a file at every open, and its "lockedfile" component
// overflows a fixed buffer on a path longer than about 240 characters, which deep scratch
// directories reach; kmoe never uses shared file pointers, so that component is left out
// (OMPI_MCA_sharedfp=^lockedfile) unless the environment already chooses.
void init_mpi(int* argc, char*** argv);

// Wraps an MPI call so a failure names the call instead of aborting silently.
void mpi_check(int rc, const char* call);

// Seconds this process has spent waiting for communication to complete (every backend adds
// its waits): with the step time, the communication vs compute split of bench/ and metrics.
double comm_wait_seconds();
void add_comm_wait(double seconds);

// Every backend's all_to_all_v argument check: one count per member, the block to self the
// same size both ways.
void check_all_to_all_counts(const std::string& axis, int size, int rank,
                             const std::vector<std::int64_t>& send_counts,
                             const std::vector<std::int64_t>& recv_counts);
// Every backend's reduce-scatter / all-gather argument check: one block count per member.
void check_block_counts(const std::string& axis, int size, const std::vector<std::int64_t>& counts);

// A started nonblocking operation; the communicator that started it completes it. Its buffers
// must stay untouched until then.
struct PendingOp {
  virtual ~PendingOp() = default;
};
using Pending = std::unique_ptr<PendingOp>;

// The data plane of one grid axis: the collectives on MemSpace buffers (device memory on GPUs)
// that carry gradients, expert rows and pipeline activations. The MPI Communicator is one
// (host-accessible memory); an NCCL communicator is another (KMOE_ENABLE_NCCL).
class DataComm {
 public:
  virtual ~DataComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;
  // Nonblocking: a sum in place over the members (a gradient bucket), a send of n floats.
  virtual Pending start_allreduce_sum(float* data, std::int64_t n) const = 0;
  // Nonblocking, in place over data[0, sum(counts)) split into member blocks (member q's
  // counts[q] floats, in member order): the sum of each block kept by its member only (the
  // other blocks' contents afterwards are unspecified), and every member's block sent to all
  // (optimizer.shard: gradients reduce-scattered, updated parameters all-gathered). On every
  // backend one rooted operation per member, so each block's result stays where it is.
  virtual Pending start_reduce_scatter_sum(float* data,
                                           const std::vector<std::int64_t>& counts) const = 0;
  virtual Pending start_allgather(float* data, const std::vector<std::int64_t>& counts) const = 0;
  // The same gather of 16-bit words (bf16 values, bit for bit; counts in words): the
  // parameters' bf16 compute copies under optimizer.shard.
  virtual Pending start_allgather(std::uint16_t* data,
                                  const std::vector<std::int64_t>& counts) const = 0;
  virtual Pending start_send(const float* data, std::int64_t n, int peer) const = 0;
  // A send started together with a receive that returns complete (the pipeline's send and the
  // receive that follows it): on NCCL one group, so neither waits for the other; on MPI the
  // send is nonblocking anyway. The send completes with complete() on the result.
  virtual Pending start_send_recv(const float* send, std::int64_t n_send, int to, float* recv,
                                  std::int64_t n_recv, int from) const {
    Pending p = start_send(send, n_send, to);
    this->recv(recv, n_recv, from);
    return p;
  }
  virtual void complete(Pending& p) const = 0;
  // Blocking: variable all-to-all (counts in floats, blocks in member order) and a receive.
  virtual void all_to_all_v(const float* send, const std::vector<std::int64_t>& send_counts,
                            float* recv, const std::vector<std::int64_t>& recv_counts) const = 0;
  virtual void recv(float* data, std::int64_t n, int peer) const = 0;
};

class Communicator : public DataComm {
 public:
  Communicator() = default;
  // Duplicates `parent` (so tags never collide with other users); `name` (the axis) appears in
  // errors. watchdog_seconds <= 0 waits forever. A wait polls its transfer for spin_seconds,
  // then sleeps kWaitSleep between polls (parallel.spin_microseconds; < 0: polls only).
  Communicator(MPI_Comm parent, std::string name, double watchdog_seconds = 0.0,
               double spin_seconds = -1.0);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  Communicator(Communicator&& o) noexcept;
  Communicator& operator=(Communicator&& o) noexcept;

  MPI_Comm comm() const { return comm_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }
  const std::string& name() const { return name_; }
  bool valid() const { return comm_ != MPI_COMM_NULL; }
  // MPI_COMM_WORLD rank of member r.
  int world_rank(int r) const { return world_ranks_[r]; }

  void allreduce_sum(float* data, std::int64_t n) const;         // in place
  // The same on host memory that only the host wrote (a table kept in host memory): no wait
  // for the device first.
  void allreduce_sum_host_data(float* data, std::int64_t n) const;
  void allreduce_sum(double* data, std::int64_t n) const;        // in place
  void allreduce_sum(std::int32_t* data, std::int64_t n) const;  // in place
  double allreduce_max(double v) const;
  void barrier() const;

  // Every member's string, in member order.
  std::vector<std::string> all_gather(const std::string& mine) const;
  // The first non-empty `mine` in member order, "" when every member passes "": after each
  // member tried something, the one error every member reports.
  std::string first_message(const std::string& mine) const;
  // Runs `action` on member 0 only; an exception there is thrown again on every member as a
  // kmoe::SharedError, so all members leave together (file system work one rank does for
  // all).
  void on_root(const std::function<void()>& action) const;

  // send: size() * per_peer values, block p to member p; recv the same shape.
  void all_to_all(const std::int64_t* send, std::int64_t* recv, int per_peer) const;
  // Variable all-to-all of floats: send_counts[p] floats to member p taken in member order from
  // `send`, recv_counts[p] from member p stored in member order into `recv`.
  void all_to_all_v(const float* send, const std::vector<std::int64_t>& send_counts, float* recv,
                    const std::vector<std::int64_t>& recv_counts) const override;
  // Nonblocking: starts a sum in place over the members (a gradient bucket) or a send of n
  // floats to `peer`; complete() waits for it.
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

  // Test-only: with KMOE_P2P_RENDEZVOUS=1 in the environment a point-to-point send completes
  // only when its receive is posted and blocks until then (MPI_Issend, waited at once), one
  // transfer at a time in issue order: how NCCL's transfers behave on one in-order stream. A
  // transfer order that would deadlock there deadlocks here too, where the watchdog names it.
  // Collectives stay nonblocking.

  // A blocking receive of n floats from member `peer` (sends: start_send + complete).
  void recv(float* data, std::int64_t n, int peer) const override;
  // Both at once (no deadlock when two members exchange): n_send floats to `to` and n_recv
  // from `from`; a peer of -1 skips that half.
  void send_recv(const float* send, std::int64_t n_send, int to, float* recv, std::int64_t n_recv,
                 int from) const;

  // Test-only: the seconds this rank waits before giving up (0: forever).
  double watchdog_seconds() const { return watchdog_s_; }

 private:
  // A pending operation of kind `op`; a collective also posts this rank's arrival notice
  // (collective number, kind, element count) to every member and the receives of theirs:
  // notices still outstanding when the watchdog fires name the ranks that never arrived, and
  // notices that disagree are a clear error instead of a mismatched collective.
  struct MpiOp;
  // count: the elements every member must pass (-1: members differ, e.g. all_to_all_v).
  std::unique_ptr<MpiOp> begin(const char* op, bool collective, int peer,
                               std::int64_t count = -1) const;
  void post_notices(MpiOp& p) const;
  // Under the device memory check (core/device_memory.hpp), refuses n elements of `bytes` at
  // `data` that lie in device memory, unless MPI was declared to take it.
  void require_host(const void* data, std::int64_t n, int bytes, const char* op) const;
  // Runs a blocking operation: the requests are already in p.
  void run(std::unique_ptr<MpiOp> p) const;
  // Starts one rooted operation per member block of `counts` elements of `type` (`bytes` each),
  // in place, split into int-sized chunks: reduce (floats), each member's block summed to it;
  // else broadcast from it (the collectives above).
  Pending start_rooted(void* data, const std::vector<std::int64_t>& counts, bool reduce,
                       MPI_Datatype type, int bytes, const char* op) const;
  template <class T>
  Pending start_reduce(T* data, std::int64_t n, MPI_Datatype type, MPI_Op mpi_op,
                       const char* op, bool device_wait = true) const;
  void free_comms();

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm notice_ = MPI_COMM_NULL;  // arrival notices, a separate duplicate
  int rank_ = 0, size_ = 1;
  std::string name_;
  double watchdog_s_ = 0.0;
  double spin_s_ = -1.0;
  bool rendezvous_ = false;
  std::vector<int> world_ranks_{0};
  mutable std::int64_t seq_ = 0;  // collectives started on this communicator
};

}  // namespace kmoe
