#include "parallel/communicator.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

#include "core/device_memory.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/fault_injection.hpp"
#include "core/process_phase.hpp"

namespace kmoe {

namespace {
// An MPI error on any communicator (they inherit world's handler): named with the rank, the
// node and the phase instead of the library's anonymous abort. In start-up it is transient
// (exit 75, core/process_phase.hpp); later the job is aborted with exit code 1.
extern "C" void on_mpi_error(MPI_Comm*, int* code, ...) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(*code, msg, &len);
  const std::string what = "MPI error during " + current_phase() + ": " + std::string(msg, len);
  if (in_startup()) fail_process(what, kStartupFailed);
  std::fprintf(stderr, "kmoe: %s: %s\n", process_identity().c_str(), what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

// Bounds the ranks' joining: MPI_Init, then a first barrier over every rank (the first traffic
// between the nodes), each phase `seconds` from its start. A rank that never starts, or a
// connection that cannot be made, would otherwise leave the others waiting forever; here they
// end, named, with exit code 75.
class StartupWatchdog {
 public:
  explicit StartupWatchdog(double seconds) : seconds_(seconds) {
    if (seconds_ > 0) thread_ = std::thread([this] { watch(); });
  }
  ~StartupWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // Enters the next phase of start-up, with its own `seconds`.
  void phase(const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    set_phase(what);
    ++phase_;
    cv_.notify_all();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      const int seen = phase_;
      if (cv_.wait_for(lock, std::chrono::duration<double>(seconds_),
                       [&] { return done_ || phase_ != seen; })) {
        if (done_) return;
        continue;  // a new phase: its own time
      }
      break;
    }
    std::ostringstream os;
    os << current_phase() << " did not finish in " << seconds_
       << " s (KMOE_STARTUP_TIMEOUT): a rank that never started or died while joining, or a "
          "connection between nodes that could not be made";
    fail_process(os.str(), kStartupFailed);
  }
  double seconds_;
  bool done_ = false;
  int phase_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

double startup_timeout_seconds() {
  const char* v = std::getenv("KMOE_STARTUP_TIMEOUT");
  if (!v || !*v) return 300.0;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end != '\0' || s < 0) {
    std::fprintf(stderr, "kmoe: KMOE_STARTUP_TIMEOUT=%s: expected seconds >= 0 (0: no bound)\n", v);
    std::exit(2);
  }
  return s;
}
}  // namespace

void init_mpi(int* argc, char*** argv) {
  setenv("OMPI_MCA_sharedfp", "^lockedfile", /*overwrite=*/0);
  install_crash_report();
  set_phase("start-up: MPI_Init");
  StartupWatchdog watchdog(startup_timeout_seconds());
  // Only the main thread calls MPI (the I/O watchdog and the lock heartbeat never do), and
  // OpenMP builds run Kokkos threads next to it: FUNNELED is the level kmoe needs.
  int provided = MPI_THREAD_SINGLE;
  MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  set_world_identity(rank, size);
  install_crash_report();  // in front of the MPI library's handler, which it then calls
  MPI_Errhandler handler;
  MPI_Comm_create_errhandler(on_mpi_error, &handler);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, handler);
  MPI_Errhandler_free(&handler);
  if (provided < MPI_THREAD_FUNNELED && rank == 0)
    std::cerr << "kmoe: note: this MPI provides thread level " << provided
              << " < MPI_THREAD_FUNNELED; multi-threaded (OpenMP) ranks rely on it" << std::endl;
  watchdog.phase("start-up: the first barrier");
  startup_fault_if_requested(rank);
  MPI_Barrier(MPI_COMM_WORLD);
  set_phase("start-up");
}

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  KMOE_FAIL(call << " failed: " << std::string(msg, len));
}

// An MPI operation in flight: its requests and, for a collective, the arrival notices.
struct Communicator::MpiOp : PendingOp {
  std::vector<MPI_Request> reqs;
  const char* op = "";
  bool collective = false;
  int peer = -1;
  std::int64_t mark = 0;  // the collective's number on its communicator
  // What this rank announces: (number, kind, element count or -1 where members differ).
  std::int64_t sig[3] = {0, 0, -1};
  std::size_t first_notice = 0;       // reqs[first_notice..]: arrival notices (recv, send)
  std::vector<std::int64_t> notices;  // the members' announcements, 3 each
};

namespace {
double g_comm_wait = 0.0;
}  // namespace

double comm_wait_seconds() { return g_comm_wait; }

void Communicator::require_host(const void* data, std::int64_t n, int bytes, const char* op) const {
  if (!device_memory_check_on() || n <= 0 || mpi_device_memory_declared()) return;
  require_host_memory(data, static_cast<std::size_t>(n) * bytes,
                      "Communicator " + name_ + " axis, " + op,
                      "this MPI is not declared to take device memory (parallel.cuda_aware_mpi): "
                      "device buffers go through the data plane's staging (StagedMpiComm)");
}
void add_comm_wait(double seconds) { g_comm_wait += seconds; }

void check_all_to_all_counts(const std::string& axis, int size, int rank,
                             const std::vector<std::int64_t>& send_counts,
                             const std::vector<std::int64_t>& recv_counts) {
  KMOE_REQUIRE(
      static_cast<int>(send_counts.size()) == size && static_cast<int>(recv_counts.size()) == size,
      "all_to_all_v on the " << axis << " axis: counts for " << send_counts.size() << "/"
                             << recv_counts.size() << " members, the axis has " << size);
  KMOE_REQUIRE(send_counts[rank] == recv_counts[rank],
               "all_to_all_v on the " << axis << " axis: " << send_counts[rank]
                                      << " floats to self, " << recv_counts[rank] << " expected");
}

void check_block_counts(const std::string& axis, int size,
                        const std::vector<std::int64_t>& counts) {
  KMOE_REQUIRE(static_cast<int>(counts.size()) == size,
               axis << " axis: " << counts.size() << " block counts for " << size << " members");
}

namespace {
constexpr int kNoticeTag = 7, kDataTag = 11;
constexpr std::int64_t kChunk = INT_MAX / 2;  // MPI counts are int: larger buffers are split
// Between the polls of a wait past its spin time: long enough that a waiting rank leaves its core
// to the ranks and threads that work (a core shared with another rank, an OpenMP team, a test
// run beside it), short against a step.
constexpr auto kWaitSleep = std::chrono::microseconds(50);
}  // namespace

Communicator::Communicator(MPI_Comm parent, std::string name, double watchdog_seconds,
                           double spin_seconds)
    : name_(std::move(name)), watchdog_s_(watchdog_seconds), spin_s_(spin_seconds) {
  const char* rendezvous = std::getenv("KMOE_P2P_RENDEZVOUS");
  rendezvous_ = rendezvous && std::string(rendezvous) == "1";
  mpi_check(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
  mpi_check(MPI_Comm_dup(parent, &notice_), "MPI_Comm_dup");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Group mine, world;
  MPI_Comm_group(comm_, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> local(size_);
  for (int r = 0; r < size_; ++r) local[r] = r;
  world_ranks_.resize(size_);
  MPI_Group_translate_ranks(mine, size_, local.data(), world, world_ranks_.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
}

void Communicator::free_comms() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  if (notice_ != MPI_COMM_NULL) MPI_Comm_free(&notice_);
}

Communicator::~Communicator() { free_comms(); }

Communicator::Communicator(Communicator&& o) noexcept
    : comm_(std::exchange(o.comm_, MPI_COMM_NULL)),
      notice_(std::exchange(o.notice_, MPI_COMM_NULL)),
      rank_(o.rank_),
      size_(o.size_),
      name_(std::move(o.name_)),
      watchdog_s_(o.watchdog_s_),
      spin_s_(o.spin_s_),
      rendezvous_(o.rendezvous_),
      world_ranks_(std::move(o.world_ranks_)),
      seq_(o.seq_) {}

Communicator& Communicator::operator=(Communicator&& o) noexcept {
  std::swap(comm_, o.comm_);
  std::swap(notice_, o.notice_);
  std::swap(rank_, o.rank_);
  std::swap(size_, o.size_);
  std::swap(name_, o.name_);
  std::swap(watchdog_s_, o.watchdog_s_);
  std::swap(spin_s_, o.spin_s_);
  std::swap(rendezvous_, o.rendezvous_);
  std::swap(world_ranks_, o.world_ranks_);
  std::swap(seq_, o.seq_);
  return *this;
}

std::unique_ptr<Communicator::MpiOp> Communicator::begin(const char* op, bool collective, int peer,
                                                         std::int64_t count) const {
  auto p = std::make_unique<MpiOp>();
  p->op = op;
  p->collective = collective;
  p->peer = peer;
  std::int64_t code = 0;  // the operation's name as a number: members compare kinds
  for (const char* c = op; *c; ++c) code = code * 131 + static_cast<unsigned char>(*c);
  p->sig[1] = code;
  p->sig[2] = count;
  return p;
}

void Communicator::run(std::unique_ptr<MpiOp> p) const {
  Pending base(std::move(p));
  complete(base);
}

void Communicator::post_notices(MpiOp& p) const {
  p.mark = ++seq_;
  p.sig[0] = p.mark;
  p.first_notice = p.reqs.size();
  p.notices.assign(3 * std::size_t(size_), -1);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    p.reqs.emplace_back();
    mpi_check(MPI_Irecv(&p.notices[3 * q], 3, MPI_INT64_T, q, kNoticeTag, notice_, &p.reqs.back()),
              "MPI_Irecv(arrival notice)");
    p.reqs.emplace_back();
    mpi_check(MPI_Isend(p.sig, 3, MPI_INT64_T, q, kNoticeTag, notice_, &p.reqs.back()),
              "MPI_Isend(arrival notice)");
  }
}

void Communicator::complete(Pending& pending) const {
  if (!pending) return;
  MpiOp& p = static_cast<MpiOp&>(*pending);
  auto& reqs = p.reqs;
  const auto started = std::chrono::steady_clock::now();
  if (watchdog_s_ <= 0 && spin_s_ < 0) {
    mpi_check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), p.op);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      int done = 0;
      mpi_check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE),
                p.op);
      if (done) break;
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (watchdog_s_ > 0 && waited > watchdog_s_) {
        // The members whose arrival notice never came: their receives are still pending.
        std::ostringstream missing;
        int n_missing = 0;
        if (p.collective)
          for (std::size_t i = p.first_notice; i < reqs.size(); i += 2) {
            int got = 0;
            MPI_Test(&reqs[i], &got, MPI_STATUS_IGNORE);
            if (got) continue;
            const int j = static_cast<int>((i - p.first_notice) / 2);
            missing << (n_missing++ ? ", " : "") << world_ranks_[j < rank_ ? j : j + 1];
          }
        std::string what;
        if (!p.collective)
          what = "world rank " + std::to_string(world_ranks_[p.peer]) + " did not take part";
        else if (n_missing)
          what = "world rank(s) " + missing.str() + " did not arrive";
        else
          what = "every rank arrived but the transfer did not complete";
        const std::string which =
            p.collective ? ", collective #" + std::to_string(p.mark) : std::string();
        std::fprintf(stderr,
                     "kmoe: watchdog: world rank %d waited %.0f s (parallel.watchdog_seconds) "
                     "in %s on the %s axis (%d ranks%s); %s; aborting the job\n",
                     world_ranks_[rank_], waited, p.op, name_.c_str(), size_, which.c_str(),
                     what.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      // Spinning here (MPI progresses only inside MPI calls) answers fastest while the wait is
      // short; past spin_s_ the rank sleeps between polls instead of holding a core that an
      // oversubscribed node's other ranks need: under two busy processes on 2 cores, 2 ranks
      // of the Slurm test deck ran 100 steps in 47-48 s spinning, 28 s sleeping; 2.9 s
      // either way on idle cores (docs/OPERATIONS.md).
      if (spin_s_ >= 0 && waited > spin_s_)
        std::this_thread::sleep_for(kWaitSleep);
      else
        std::this_thread::yield();
    }
  }
  add_comm_wait(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  if (p.collective)
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const std::int64_t* n = &p.notices[3 * q];
      const bool counts_differ = n[2] >= 0 && p.sig[2] >= 0 && n[2] != p.sig[2];
      KMOE_REQUIRE(
          n[0] == p.mark && n[1] == p.sig[1] && !counts_differ,
          "collectives out of step on the "
              << name_ << " axis: world rank " << world_ranks_[q] << " is at collective #" << n[0]
              << (n[1] == p.sig[1] ? "" : " of another kind")
              << (counts_differ ? " with " + std::to_string(n[2]) + " elements" : "")
              << " while world rank " << world_ranks_[rank_] << " is at #" << p.mark << " (" << p.op
              << (p.sig[2] >= 0 ? ", " + std::to_string(p.sig[2]) + " elements" : "") << ")");
    }
  pending.reset();
}

template <class T>
Pending Communicator::start_reduce(T* data, std::int64_t n, MPI_Datatype type, MPI_Op mpi_op,
                                   const char* op, bool device_wait) const {
  require_host(data, n, sizeof(T), op);
  if (size_ == 1) return nullptr;
  if (device_wait) host_sync("mpi allreduce");
  auto p = begin(op, true, -1, n);
  for (std::int64_t off = 0; off < n; off += kChunk) {
    p->reqs.emplace_back();
    mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data + off, static_cast<int>(std::min(kChunk, n - off)),
                             type, mpi_op, comm_, &p->reqs.back()),
              "MPI_Iallreduce");
  }
  post_notices(*p);
  return Pending(std::move(p));
}

Pending Communicator::start_allreduce_sum(float* data, std::int64_t n) const {
  return start_reduce(data, n, MPI_FLOAT, MPI_SUM, "allreduce_sum(float)");
}

Pending Communicator::start_reduce_scatter_sum(float* data,
                                               const std::vector<std::int64_t>& counts) const {
  return start_rooted(data, counts, true, MPI_FLOAT, 4, "reduce_scatter_sum(float)");
}

Pending Communicator::start_allgather(float* data, const std::vector<std::int64_t>& counts) const {
  return start_rooted(data, counts, false, MPI_FLOAT, 4, "allgather(float)");
}

Pending Communicator::start_allgather(std::uint16_t* data,
                                      const std::vector<std::int64_t>& counts) const {
  return start_rooted(data, counts, false, MPI_UINT16_T, 2, "allgather(bf16)");
}

Pending Communicator::start_rooted(void* data, const std::vector<std::int64_t>& counts,
                                   bool reduce, MPI_Datatype type, int bytes,
                                   const char* op) const {
  check_block_counts(name_, size_, counts);
  std::int64_t n = 0;
  for (std::int64_t c : counts) n += c;
  require_host(data, n, bytes, op);
  if (size_ == 1) return nullptr;
  host_sync(reduce ? "mpi reduce_scatter" : "mpi allgather");
  auto p = begin(op, true, -1, n);
  // Member q's block: a reduction to q (MPI_Ireduce_scatter would leave each result at the
  // start of the buffer, not in its block) or a broadcast from q, in place.
  std::int64_t at = 0;
  for (int q = 0; q < size_; ++q) {
    for (std::int64_t off = 0; off < counts[q]; off += kChunk) {
      void* block = static_cast<char*>(data) + (at + off) * bytes;
      const int len = static_cast<int>(std::min(kChunk, counts[q] - off));
      p->reqs.emplace_back();
      if (reduce)
        mpi_check(MPI_Ireduce(q == rank_ ? MPI_IN_PLACE : block, block, len, type, MPI_SUM, q,
                              comm_, &p->reqs.back()),
                  "MPI_Ireduce");
      else
        mpi_check(MPI_Ibcast(block, len, type, q, comm_, &p->reqs.back()), "MPI_Ibcast");
    }
    at += counts[q];
  }
  post_notices(*p);
  return Pending(std::move(p));
}

void Communicator::allreduce_sum(float* data, std::int64_t n) const {
  Pending p = start_allreduce_sum(data, n);
  complete(p);
}

void Communicator::allreduce_sum_host_data(float* data, std::int64_t n) const {
  Pending p = start_reduce(data, n, MPI_FLOAT, MPI_SUM, "allreduce_sum(float)", false);
  complete(p);
}

void Communicator::allreduce_sum(double* data, std::int64_t n) const {
  Pending p = start_reduce(data, n, MPI_DOUBLE, MPI_SUM, "allreduce_sum(double)");
  complete(p);
}

void Communicator::allreduce_sum(std::int32_t* data, std::int64_t n) const {
  Pending p = start_reduce(data, n, MPI_INT32_T, MPI_SUM, "allreduce_sum(int32)");
  complete(p);
}

double Communicator::allreduce_max(double v) const {
  Pending p = start_reduce(&v, 1, MPI_DOUBLE, MPI_MAX, "allreduce_max");
  complete(p);
  return v;
}

void Communicator::barrier() const {
  if (size_ == 1) return;
  auto p = begin("barrier", true, -1, 0);
  p->reqs.emplace_back();
  mpi_check(MPI_Ibarrier(comm_, &p->reqs.back()), "MPI_Ibarrier");
  post_notices(*p);
  run(std::move(p));
}

std::vector<std::string> Communicator::all_gather(const std::string& mine) const {
  if (size_ == 1) return {mine};
  std::vector<int> lens(size_), displs(size_, 0);
  int len = static_cast<int>(mine.size());
  auto p = begin("all_gather(lengths)", true, -1, 1);
  p->reqs.emplace_back();
  mpi_check(MPI_Iallgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm_, &p->reqs.back()),
            "MPI_Iallgather");
  post_notices(*p);
  run(std::move(p));
  for (int p = 1; p < size_; ++p) displs[p] = displs[p - 1] + lens[p - 1];
  std::string all(std::size_t(displs[size_ - 1]) + lens[size_ - 1], '\0');
  p = begin("all_gather", true, -1);
  p->reqs.emplace_back();
  mpi_check(MPI_Iallgatherv(mine.data(), len, MPI_CHAR, &all[0], lens.data(), displs.data(),
                            MPI_CHAR, comm_, &p->reqs.back()),
            "MPI_Iallgatherv");
  post_notices(*p);
  run(std::move(p));
  std::vector<std::string> out(size_);
  for (int p = 0; p < size_; ++p) out[p] = all.substr(displs[p], lens[p]);
  return out;
}

std::string Communicator::first_message(const std::string& mine) const {
  for (const std::string& m : all_gather(mine))
    if (!m.empty()) return m;
  return "";
}

void Communicator::on_root(const std::function<void()>& action) const {
  std::string error;
  if (rank_ == 0) {
    try {
      action();
    } catch (const std::exception& e) {  // kmoe::Error, or a std::filesystem error
      error = e.what();
    }
  }
  error = first_message(error);
  if (!error.empty()) throw SharedError(error);
}

void Communicator::all_to_all(const std::int64_t* send, std::int64_t* recv, int per_peer) const {
  require_host(send, std::int64_t(size_) * per_peer, sizeof(std::int64_t), "all_to_all(counts)");
  require_host(recv, std::int64_t(size_) * per_peer, sizeof(std::int64_t), "all_to_all(counts)");
  if (size_ == 1) {
    std::copy(send, send + per_peer, recv);
    return;
  }
  auto p = begin("all_to_all(counts)", true, -1, per_peer);
  p->reqs.emplace_back();
  mpi_check(MPI_Ialltoall(send, per_peer, MPI_INT64_T, recv, per_peer, MPI_INT64_T, comm_,
                          &p->reqs.back()),
            "MPI_Ialltoall");
  post_notices(*p);
  run(std::move(p));
}

namespace {
// synchronous: a send completes only once its receive has started (MPI_Issend).
void post(std::vector<MPI_Request>& reqs, bool is_send, const float* data, std::int64_t n, int peer,
          MPI_Comm comm, bool synchronous = false) {
  for (std::int64_t off = 0; off < n; off += kChunk) {
    reqs.emplace_back();
    const int count = static_cast<int>(std::min(kChunk, n - off));
    if (is_send && synchronous)
      mpi_check(MPI_Issend(data + off, count, MPI_FLOAT, peer, kDataTag, comm, &reqs.back()),
                "MPI_Issend");
    else if (is_send)
      mpi_check(MPI_Isend(data + off, count, MPI_FLOAT, peer, kDataTag, comm, &reqs.back()),
                "MPI_Isend");
    else
      mpi_check(MPI_Irecv(const_cast<float*>(data) + off, count, MPI_FLOAT, peer, kDataTag, comm,
                          &reqs.back()),
                "MPI_Irecv");
  }
}
}  // namespace

void Communicator::all_to_all_v(const float* send, const std::vector<std::int64_t>& send_counts,
                                float* recv, const std::vector<std::int64_t>& recv_counts) const {
  check_all_to_all_counts(name_, size_, rank_, send_counts, recv_counts);
  std::int64_t n_send = 0, n_recv = 0;
  for (int p = 0; p < size_; ++p) n_send += send_counts[p], n_recv += recv_counts[p];
  require_host(send, n_send, sizeof(float), "all_to_all_v (send)");
  require_host(recv, n_recv, sizeof(float), "all_to_all_v (receive)");
  host_sync("mpi all_to_all_v");
  auto pend = begin("all_to_all_v", true, -1);
  auto& reqs = pend->reqs;
  std::int64_t soff = 0, roff = 0;
  for (int p = 0; p < size_; ++p) {
    // The block to self goes through MPI too: with a CUDA-aware MPI the buffers may be
    // device memory that a host copy cannot touch.
    post(reqs, false, recv + roff, recv_counts[p], p, comm_);
    post(reqs, true, send + soff, send_counts[p], p, comm_);
    soff += send_counts[p];
    roff += recv_counts[p];
  }
  post_notices(*pend);
  run(std::move(pend));
}

Pending Communicator::start_send(const float* data, std::int64_t n, int peer) const {
  if (rendezvous_) {  // blocks until matched, as on an in-order stream
    send_recv(data, n, peer, nullptr, 0, -1);
    return nullptr;
  }
  require_host(data, n, sizeof(float), "send");
  host_sync("mpi send");
  auto p = begin("send", false, peer);
  post(p->reqs, true, data, n, peer, comm_);
  return Pending(std::move(p));
}

Pending Communicator::start_send_recv(const float* send, std::int64_t n_send, int to, float* recv,
                                      std::int64_t n_recv, int from) const {
  if (rendezvous_) {  // both posted together, as one NCCL group
    send_recv(send, n_send, to, recv, n_recv, from);
    return nullptr;
  }
  Pending p = start_send(send, n_send, to);
  this->recv(recv, n_recv, from);
  return p;
}

void Communicator::recv(float* data, std::int64_t n, int peer) const {
  send_recv(nullptr, 0, -1, data, n, peer);
}

void Communicator::send_recv(const float* send, std::int64_t n_send, int to, float* recv,
                             std::int64_t n_recv, int from) const {
  if (to < 0 && from < 0) return;
  const char* op = to >= 0 && from >= 0 ? "send_recv" : (to >= 0 ? "send" : "recv");
  if (to >= 0) require_host(send, n_send, sizeof(float), op);
  if (from >= 0) require_host(recv, n_recv, sizeof(float), op);
  host_sync("mpi send_recv");
  auto p = begin(op, false, from >= 0 ? from : to);
  if (from >= 0) post(p->reqs, false, recv, n_recv, from, comm_);
  if (to >= 0) post(p->reqs, true, send, n_send, to, comm_, rendezvous_);
  run(std::move(p));
}

}  // namespace kmoe
