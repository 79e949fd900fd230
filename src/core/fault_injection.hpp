// Test-only fault injection through the environment (RUNTIME.md sections 2 and 4), so the
// failure paths of a real run can be exercised by the regression tests:
//   KMOE_FAULT=kill_during_save   SIGKILL halfway through writing a checkpoint's tensors;
//   KMOE_FAULT=save_fails:<rank>[:<step>]  a checkpoint write fails halfway on world rank
//                                 <rank> (-1: on every rank), as on a full disk: in the save of
//                                 <step>, or in every save;
//   KMOE_FAULT=no_space_check     a save skips its free-space check and meets the full disk
//                                 in its writes;
//   KMOE_FAULT=stall_save:<rank>  world rank <rank> stops before closing a file it writes with
//                                 the others (it sleeps), leaving them in HDF5's collective close;
//   KMOE_FAULT=metrics_fails:<step>  the metrics row of <step> cannot be written (a full disk);
//   KMOE_FAULT=stall:<rank>:<step> world rank <rank> stops taking part at the start of <step>
//                                  (it sleeps), so the other ranks' watchdog must fire;
//   KMOE_FAULT=pause:<rank>:<step>:<ms>  world rank <rank> sleeps <ms> milliseconds at the start
//                                  of <step>, then goes on (a moment at which a test cuts its
//                                  node: only the loss, not the pause, can end the run);
//   KMOE_FAULT=crash:<rank>:<step>  world rank <rank> raises SIGSEGV at the start of <step> (a
//                                  crash in training, which its report must name);
//   KMOE_FAULT=drop_silu_curvature  SwiGLU's backward drops the a s (1 - s) term of silu' (a
//                                  planted gradient bug the gradient tests must catch);
//   KMOE_FAULT=signal_at_start:<signal>  the process sends itself <signal> right after it
//                                  installs its stop handlers, before MPI and the model start
//                                  (a signal during start-up, at a known moment).
//   KMOE_FAULT=startup_pause:<rank>:<ms>  world rank <rank> sleeps <ms> milliseconds in
//                                  start-up, after MPI_Init and before the first barrier (a
//                                  rank that is slow to join, or a moment to cut its node);
//   KMOE_FAULT=startup_crash:<rank>  world rank <rank> raises SIGSEGV at the same point (a
//                                  crash while the ranks join). Both act in a job's first run
//                                  only (SLURM_RESTART_COUNT unset or 0): a requeued run starts
//                                  cleanly;
//   KMOE_FAULT=slow_save:<ms>       every checkpoint save takes <ms> milliseconds longer
//                                  (a signal during a save, at a known moment).
#pragma once

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace kmoe {

inline bool fault_requested(const char* what) {
  const char* f = std::getenv("KMOE_FAULT");
  return f && std::strcmp(f, what) == 0;
}

inline bool save_fault_here(int world_rank, int step) {
  const char* f = std::getenv("KMOE_FAULT");
  int rank = -2, at = -1;
  if (!f || std::sscanf(f, "save_fails:%d:%d", &rank, &at) < 1) return false;
  return (rank == -1 || rank == world_rank) && (at < 0 || at == step);
}

// KMOE_FAULT=metrics_fails:<step>: the metrics row of <step> cannot be written.
inline bool metrics_fault_here(int step) {
  const char* f = std::getenv("KMOE_FAULT");
  int at = -2;
  return f && std::sscanf(f, "metrics_fails:%d", &at) == 1 && at == step;
}

inline void stall_save_if_requested(int world_rank) {
  const char* f = std::getenv("KMOE_FAULT");
  int rank = -1;
  if (!f || std::sscanf(f, "stall_save:%d", &rank) != 1 || rank != world_rank) return;
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

inline void stall_if_requested(int world_rank, int step) {
  const char* f = std::getenv("KMOE_FAULT");
  int rank = -1, at = -1;
  if (!f || std::sscanf(f, "stall:%d:%d", &rank, &at) != 2) return;
  if (rank == world_rank && at == step)
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// The pausing rank says so first (flushed), so that a test can act inside the pause on the
// rank's own word rather than on another rank's progress.
inline void pause_if_requested(int world_rank, int step) {
  const char* f = std::getenv("KMOE_FAULT");
  int rank = -1, at = -1, ms = 0;
  if (!f || std::sscanf(f, "pause:%d:%d:%d", &rank, &at, &ms) != 3) return;
  if (rank == world_rank && at == step && ms > 0) {
    std::fprintf(stderr, "kmoe: fault: world rank %d pausing %d ms at the start of step %d\n",
                 world_rank, ms, step);
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
}

inline void crash_if_requested(int world_rank, int step) {
  const char* f = std::getenv("KMOE_FAULT");
  int rank = -1, at = -1;
  if (f && std::sscanf(f, "crash:%d:%d", &rank, &at) == 2 && rank == world_rank && at == step)
    std::raise(SIGSEGV);
}

inline void startup_fault_if_requested(int world_rank) {
  const char* f = std::getenv("KMOE_FAULT");
  const char* restart = std::getenv("SLURM_RESTART_COUNT");
  if (!f || (restart && std::atoi(restart) != 0)) return;
  int rank = -1, ms = 0;
  if (std::sscanf(f, "startup_pause:%d:%d", &rank, &ms) == 2 && rank == world_rank && ms > 0) {
    std::fprintf(stderr, "kmoe: fault: world rank %d pausing %d ms in start-up\n", world_rank, ms);
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  } else if (std::sscanf(f, "startup_crash:%d", &rank) == 1 && rank == world_rank) {
    std::fprintf(stderr, "kmoe: fault: world rank %d crashing in start-up\n", world_rank);
    std::fflush(stderr);
    std::raise(SIGSEGV);
  }
}

inline void signal_at_start_if_requested() {
  const char* f = std::getenv("KMOE_FAULT");
  int sig = 0;
  if (f && std::sscanf(f, "signal_at_start:%d", &sig) == 1 && sig > 0) std::raise(sig);
}

inline void slow_save_if_requested() {
  const char* f = std::getenv("KMOE_FAULT");
  int ms = 0;
  if (f && std::sscanf(f, "slow_save:%d", &ms) == 1 && ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace kmoe
