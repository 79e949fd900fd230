#include "core/stop_signal.hpp"

#include "core/process_phase.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <sstream>

namespace kmoe {

namespace {
volatile std::sig_atomic_t g_stop = 0;
volatile std::sig_atomic_t g_signal = 0;      // the signal behind g_stop
volatile std::sig_atomic_t g_interrupts = 0;  // SIGINTs so far
volatile std::sig_atomic_t g_under_orte = 0;  // launched by Open MPI 4.x's mpirun

const char* signal_label(int sig) {
  switch (sig) {
    case SIGUSR1:
      return "SIGUSR1";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT (Ctrl-C)";
    default:
      return "";
  }
}

bool under_orte() { return std::getenv("OMPI_MCA_orte_hnp_uri") != nullptr; }

// Writes to fd no longer wait for a reader (fcntl is async-signal-safe).
void stop_blocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

extern "C" void on_stop_signal(int sig) {
  if (sig == SIGINT && ++g_interrupts > 1) {  // a second Ctrl-C: stop now, as without kmoe
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  // While the ranks join, a cancel ends the process at once (core/process_phase.hpp): the
  // launcher's SIGTERM to the ranks left when one died there (srun --kill-on-bad-exit) would
  // otherwise wait for its SIGKILL. A SIGUSR1 (the time limit) is kept for after step 1.
  if (sig != SIGUSR1 && ranks_joining()) end_while_joining(sig, signal_label(sig));
  if (sig == SIGTERM && g_under_orte) {  // mpirun is tearing the job down: see the header
    stop_blocking(STDOUT_FILENO);
    stop_blocking(STDERR_FILENO);
  }
  const int kind =
      sig == SIGUSR1 ? static_cast<int>(StopKind::Requeue) : static_cast<int>(StopKind::Cancel);
  if (kind > g_stop) {
    g_signal = sig;  // first: a reader that sees the stop sees its signal
    g_stop = kind;
  }
}
}  // namespace

void install_stop_handlers() {
  g_under_orte = under_orte() ? 1 : 0;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;  // reads and writes the signal interrupts go on
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaction(sig, &sa, nullptr);
}

StopKind requested_stop() { return static_cast<StopKind>(static_cast<int>(g_stop)); }

const char* stop_signal_name() { return signal_label(g_signal); }

void report_exit_code(int code) {
  const char* path = std::getenv("KMOE_STOP_FILE");
  if (!path || !*path) return;
  if (std::FILE* f = std::fopen(path, "w")) {
    std::fprintf(f, "%d\n", code);
    std::fclose(f);
  }
}

std::string launcher_stop_note() {
  if (!under_orte() || std::getenv("KMOE_STOP_FILE")) return "";
  const char* set = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  const int grace = set && std::atoi(set) > 0 ? std::atoi(set) : 1;
  std::ostringstream os;
  os << "launched by Open MPI's mpirun: a SIGTERM to mpirun (kill, timeout, a batch system's "
        "time limit) reaches the ranks after odls_base_sigkill_timeout = "
     << grace << " s" << (set ? "" : " (Open MPI's default)") << " and SIGKILL " << grace
     << " s later, so a step and a checkpoint must fit in " << grace
     << " s, and mpirun exits 1 whatever kmoe did. For a stop with a checkpoint send mpirun "
        "SIGUSR2 (exit 86) or SIGUSR1 (85), raise the timeout (--mca odls_base_sigkill_timeout "
        "60, or OMPI_MCA_odls_base_sigkill_timeout=60), or launch through scripts/kmoe-mpirun "
        "(slurm/README.md, \"Stop signals by launcher\")";
  return os.str();
}

}  // namespace kmoe
