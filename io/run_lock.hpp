// A run owns its checkpoint directory (RUNTIME.md section 4): <checkpoint.dir>/kmoe.lock names
// the run that holds it (host, pid, start time, Slurm job) and a heartbeat that a thread of
// rank 0 renews while the run lives. A second run into the same directory stops with an error
// naming the holder, unless the lock is stale: its heartbeat is older than
// checkpoint.lock_stale_seconds (any host), its process is gone (same host), or it is this
// Slurm job's own lock from before a requeue. Then the lock is taken over, with a message.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "core/config.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

class RunLock {
 public:
  // Collective over `world`: rank 0 takes the lock (creating the directory), every rank throws
  // the same SharedError when it cannot.
  RunLock(const CheckpointCfg& cfg, const Communicator& world);
  ~RunLock();  // rank 0 removes the lock file
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  const std::string& path() const { return path_; }
  // This run took over this Slurm job's own lock (a requeue): its files are its own.
  bool requeued_own() const { return requeued_own_; }
  // Rank 0: the heartbeat found the lock taken over by another run (this one stalled for
  // longer than checkpoint.lock_stale_seconds): the run must stop.
  bool lost() const { return lost_; }

 private:
  void heartbeat();
  bool still_ours() const;
  void write_lock_file(const std::string& path) const;  // the lock's content, a fresh heartbeat
  void write_lock() const;  // the same over the lock, replaced atomically

  std::string path_;
  bool holder_ = false;  // rank 0, once the lock is ours
  bool requeued_own_ = false;
  std::atomic<bool> lost_{false};
  std::string host_, started_, job_;
  long pid_ = 0;
  double interval_s_ = 60;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;
};

// The start of a run into its directories (rank 0 does the file system work, every rank gets
// the same outcome). Removes the temporaries of interrupted saves (`.stepN.h5.tmp`), printing
// what it removed. For a fresh run (nothing to resume) into a checkpoint.dir that holds
// another run's checkpoints, or an output.dir with another run's metrics.csv: an error naming
// them, unless checkpoint.overwrite = true, which removes them first (and says so).
// `own_files`: they are this run's own (a Slurm job requeued before its first checkpoint).
void prepare_run_directories(const Config& cfg, bool resuming, bool own_files,
                             const Communicator& world);

}  // namespace kmoe
