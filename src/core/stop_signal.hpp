// SIGUSR1 (Slurm's warning before the time limit) asks for a checkpoint and exit 85 (requeue);
// SIGTERM (a cancel) for a checkpoint and exit 86. The handlers only record the request; the
// training loop reads it at each step boundary, where the ranks agree on it.
#pragma once

namespace kmoe {

enum class StopKind { None = 0, Requeue = 1, Cancel = 2 };  // ordered: Cancel wins

// Installs the handlers (idempotent). Drivers call it first thing, so a signal during start-up
// is kept too.
void install_stop_handlers();

// The strongest stop requested by a signal to this process so far.
StopKind requested_stop();

}  // namespace kmoe
