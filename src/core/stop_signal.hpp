// Stop signals (RUNTIME.md section 4): SIGUSR1 (Slurm's warning before the time limit) asks for
// a checkpoint and exit 85 (requeue); SIGTERM, SIGUSR2 (what scripts/kmoe-mpirun and the batch
// script send through mpirun, which forwards only SIGUSR1/2) and a first SIGINT (Ctrl-C) ask
// for a checkpoint and exit 86 (stopped, resumable). A second SIGINT ends the process at once.
// The handlers only record the request; the training loop reads it at each step boundary,
// where the ranks agree on it.
#pragma once

namespace kmoe {

enum class StopKind { None = 0, Requeue = 1, Cancel = 2 };  // ordered: Cancel wins

// Installs the handlers (idempotent). kmoe-train installs them before MPI starts, so a signal
// during start-up is kept too, and again after.
void install_stop_handlers();

// The strongest stop requested by a signal to this process so far.
StopKind requested_stop();
// The signal that asked for it ("SIGTERM", ...), or "" when none reached this process.
const char* stop_signal_name();

// A checkpointed stop's exit code (85/86) written to the file $KMOE_STOP_FILE names, when set:
// launchers that report their own status when signalled (Open MPI's mpirun returns 1) can be
// corrected by the script around them (scripts/kmoe-mpirun, slurm/train.sbatch).
void report_stop_code(int code);

}  // namespace kmoe
