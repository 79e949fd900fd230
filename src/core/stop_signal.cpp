#include "core/stop_signal.hpp"

#include <csignal>
#include <cstring>

namespace kmoe {

namespace {
volatile std::sig_atomic_t g_stop = 0;
extern "C" void on_stop_signal(int sig) {
  if (sig == SIGTERM)
    g_stop = static_cast<int>(StopKind::Cancel);
  else if (g_stop == 0)
    g_stop = static_cast<int>(StopKind::Requeue);
}
}  // namespace

void install_stop_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

StopKind requested_stop() { return static_cast<StopKind>(static_cast<int>(g_stop)); }

}  // namespace kmoe
