// The watchdog for I/O whose collectives happen inside a library (parallel HDF5 over MPI-IO),
// where the Communicator's own watchdog cannot look: a thread waits while the section runs, and
// if the section reports no progress for parallel.watchdog_seconds it names the section on
// stderr and ends the process (exit code 1; the launcher then ends the job), so a rank left in
// a collective by the others ends the job instead of hanging it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace kmoe {

class IoWatchdog {
 public:
  // seconds <= 0: no watchdog. `what` names the section in the message ("writing FILE").
  IoWatchdog(double seconds, std::string what);
  ~IoWatchdog();
  IoWatchdog(const IoWatchdog&) = delete;
  IoWatchdog& operator=(const IoWatchdog&) = delete;

  // The section advanced (a dataset written): the wait starts again.
  void progress();

 private:
  void watch();

  double seconds_;
  std::string what_;
  int rank_ = -1;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::chrono::steady_clock::time_point last_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace kmoe
