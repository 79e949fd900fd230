#include "core/stop_signal.hpp"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace kmoe {

namespace {
volatile std::sig_atomic_t g_stop = 0;
volatile std::sig_atomic_t g_signal = 0;      // the signal behind g_stop
volatile std::sig_atomic_t g_interrupts = 0;  // SIGINTs so far

extern "C" void on_stop_signal(int sig) {
  if (sig == SIGINT && ++g_interrupts > 1) {  // a second Ctrl-C: stop now, as without kmoe
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
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
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;  // reads and writes the signal interrupts go on
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaction(sig, &sa, nullptr);
}

StopKind requested_stop() { return static_cast<StopKind>(static_cast<int>(g_stop)); }

const char* stop_signal_name() {
  switch (g_signal) {
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

void report_stop_code(int code) {
  const char* path = std::getenv("KMOE_STOP_FILE");
  if (!path || !*path) return;
  if (std::FILE* f = std::fopen(path, "w")) {
    std::fprintf(f, "%d\n", code);
    std::fclose(f);
  }
}

}  // namespace kmoe
