#include "parallel/io_watchdog.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace kmoe {

IoWatchdog::IoWatchdog(double seconds, std::string what)
    : seconds_(seconds), what_(std::move(what)), last_(std::chrono::steady_clock::now()) {
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);  // here: the thread makes no MPI call
  if (seconds_ > 0) thread_ = std::thread([this] { watch(); });
}

IoWatchdog::~IoWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void IoWatchdog::progress() {
  std::lock_guard<std::mutex> lock(mutex_);
  last_ = std::chrono::steady_clock::now();
}

void IoWatchdog::watch() {
  const auto limit = std::chrono::duration<double>(seconds_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!done_) {
    const auto deadline =
        last_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(limit);
    if (wake_.wait_until(lock, deadline, [this] { return done_; })) return;
    if (std::chrono::steady_clock::now() < last_ + limit) continue;  // progress meanwhile
    // MPI (initialized without thread support) is off limits to this thread while the main
    // one is inside it: the process ends itself, and the launcher ends the job (the other
    // ranks' watchdogs fire the same way if it does not).
    std::fprintf(stderr,
                 "kmoe: watchdog: world rank %d made no progress for %.0f s "
                 "(parallel.watchdog_seconds) %s (collective I/O); ending the job\n",
                 rank_, seconds_, what_.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

}  // namespace kmoe
