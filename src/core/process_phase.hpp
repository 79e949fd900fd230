// Which rank, on which node, in which phase (RUNTIME.md section 4): every way a rank can end
// badly names the three, so a failed job's log says where it failed without a debugger.
//   - The phase ("start-up: MPI_Init", "start-up: the first barrier", "step 17", "the save of
//     step 18", "shut-down") is kept in a fixed buffer that a signal handler can read.
//   - A fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT), in kmoe or in a library under
//     it (the MPI transport), prints "kmoe: world rank R of N on node X: SIGSEGV
//     (Segmentation fault) during PHASE" and then goes on to the handler that was there before
//     (Open MPI's backtrace) or the default action, so the exit status is still the signal's.
//   - During start-up such a failure is reported as transient: the rank writes exit code 75
//     (kStartupFailed) to $KMOE_STOP_FILE, where slurm/train.sbatch requeues the job (a
//     connection that failed while the ranks were joining, a peer that died before training
//     began); a failure once training began is not.
#pragma once

#include <string>

namespace kmoe {

// The exit code of a start-up that failed (the ranks could not all join): sysexits' EX_TEMPFAIL.
constexpr int kStartupFailed = 75;

// Sets the phase; a step >= 0 is appended ("step" 17 -> "step 17"). Not for signal handlers.
void set_phase(const char* what, int step = -1);
// The phase now ("start-up: MPI_Init" until the driver sets another).
std::string current_phase();
bool in_startup();
// The ranks are joining: MPI_Init or the first barrier ("start-up: ..." phases), before any rank
// can reach a step. Async-signal-safe.
bool ranks_joining();

// This process's world rank and size once MPI knows them (before: the launcher's environment,
// OMPI_COMM_WORLD_RANK / PMIX_RANK / SLURM_PROCID / PMI_RANK, or -1).
void set_world_identity(int rank, int size);
// "world rank 3 of 4 on node n2" (the node: SLURMD_NODENAME, else the host name).
std::string process_identity();

// Installs the fatal-signal report (idempotent; chains to the handler found when installed).
// kmoe installs it once before MPI starts and again after MPI_Init, in front of the MPI
// library's own handler.
void install_crash_report();

// A stop signal while the ranks join (async-signal-safe, for the stop handler): there is nothing
// to checkpoint and a rank that waits for a peer that is gone would sit there until the
// launcher's SIGKILL, so the process says so ("kmoe: <identity>: SIGTERM during start-up: the
// first barrier: ending now ...") and exits with 128 + sig at once. Writes no exit code to
// $KMOE_STOP_FILE: a cancel is no transient failure.
[[noreturn]] void end_while_joining(int sig, const char* signal_name);

// Reports a failure in the current phase and ends this process at once: the message (prefixed
// "kmoe: <identity>: ") on stderr, exit code 75 to $KMOE_STOP_FILE and as the exit status when
// in start-up, else `code`.
[[noreturn]] void fail_process(const std::string& message, int code);

}  // namespace kmoe
