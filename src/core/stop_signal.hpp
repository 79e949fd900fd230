// Stop signals (RUNTIME.md section 4): SIGUSR1 (Slurm's warning before the time limit) asks for
// a checkpoint and exit 85 (requeue); SIGTERM, SIGUSR2 (what scripts/kmoe-mpirun and the batch
// script send through mpirun, which forwards only SIGUSR1/2) and a first SIGINT (Ctrl-C) ask
// for a checkpoint and exit 86 (stopped, resumable). A second SIGINT ends the process at once.
// The handlers only record the request; the training loop reads it at each step boundary,
// where the ranks agree on it. While the ranks join (MPI_Init, the first barrier) a SIGTERM,
// SIGUSR2 or SIGINT ends the process at once instead, with 128 + the signal: nothing exists to
// checkpoint yet, and the SIGTERM a launcher sends the ranks left when one died there must not
// wait for its SIGKILL (core/process_phase.hpp). A SIGUSR1 then is kept for after step 1.
//
// Under Open MPI's own launcher (ORTE, Open MPI 4.x mpirun), a SIGTERM reaches a rank only when
// mpirun is tearing the job down (it forwards SIGUSR1/2 alone): mpirun then no longer reads the
// ranks' output, and a rank blocked writing a log line would sit there until SIGKILL. The
// handler makes stdout and stderr non-blocking on such a SIGTERM, so the rank loses the lines
// nobody reads but reaches its checkpoint (RUNTIME.md section 4, slurm/README.md).
#pragma once

#include <string>

namespace kmoe {

enum class StopKind { None = 0, Requeue = 1, Cancel = 2 };  // ordered: Cancel wins

// Installs the handlers (idempotent). kmoe-train installs them before MPI starts, so a signal
// during start-up is kept too, and again after.
void install_stop_handlers();

// The strongest stop requested by a signal to this process so far.
StopKind requested_stop();
// The signal that asked for it ("SIGTERM", ...), or "" when none reached this process.
const char* stop_signal_name();

// The exit code of a run that ended cleanly (0 finished, 85/86 a checkpointed stop) written to
// the file $KMOE_STOP_FILE names, when set: launchers that report their own status when
// signalled (Open MPI's mpirun returns 1) can be corrected by the script around them
// (scripts/kmoe-mpirun, slurm/train.sbatch).
void report_exit_code(int code);

// A note for the start of a run launched by Open MPI 4.x's mpirun without scripts/kmoe-mpirun
// (no KMOE_STOP_FILE): what a SIGTERM to mpirun does to it (odls_base_sigkill_timeout) and the
// ways to stop it with a checkpoint; "" under any other launcher.
std::string launcher_stop_note();

}  // namespace kmoe
