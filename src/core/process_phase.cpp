#include "core/process_phase.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace kmoe {

namespace {
// Written by the main thread, read by signal handlers and the start-up watchdog: plain
// buffers, complete before the flag that publishes them (a torn read shows a mixed phase name,
// never undefined memory: the buffer is always NUL-terminated).
char g_phase[96] = "start-up: MPI_Init";
char g_identity[160] = "";
char g_stop_file[512] = "";
volatile std::sig_atomic_t g_startup = 1;
volatile std::sig_atomic_t g_joining = 1;

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction g_previous[sizeof kSignals / sizeof kSignals[0]];
bool g_have_previous[sizeof kSignals / sizeof kSignals[0]] = {};

int env_rank() {
  for (const char* key : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "PMI_RANK"})
    if (const char* v = std::getenv(key)) return std::atoi(v);
  return -1;
}

std::string node_name() {
  if (const char* n = std::getenv("SLURMD_NODENAME"); n && *n) return n;
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

void copy(char* dst, std::size_t n, const std::string& s) {
  const std::size_t len = s.size() < n - 1 ? s.size() : n - 1;
  std::memcpy(dst, s.data(), len);
  dst[len] = '\0';
}

void ensure_identity() {
  if (g_identity[0] == '\0') set_world_identity(env_rank(), -1);
  if (g_stop_file[0] == '\0')
    if (const char* p = std::getenv("KMOE_STOP_FILE")) copy(g_stop_file, sizeof g_stop_file, p);
}

// Async-signal-safe pieces: write(2) of NUL-terminated strings, open/close.
void put(const char* s) {
  std::size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<std::size_t>(w);
  }
}

void report_startup_code() {
  if (g_stop_file[0] == '\0') return;
  const int fd = ::open(g_stop_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  const char code[] = "75\n";
  (void)!::write(fd, code, sizeof code - 1);
  ::close(fd);
}

const char* signal_label(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV (Segmentation fault)";
    case SIGBUS:
      return "SIGBUS (Bus error)";
    case SIGFPE:
      return "SIGFPE (Floating-point exception)";
    case SIGILL:
      return "SIGILL (Illegal instruction)";
    case SIGABRT:
      return "SIGABRT (Aborted)";
    default:
      return "a fatal signal";
  }
}

extern "C" void on_fatal_signal(int sig, siginfo_t* info, void* uctx) {
  put("kmoe: ");
  put(g_identity);
  put(": ");
  put(signal_label(sig));
  put(" during ");
  put(g_phase);
  if (g_startup) {
    put(" (start-up failed: reported as exit code 75, transient)");
    report_startup_code();
  }
  put("\n");
  // The handler before kmoe's (the MPI library's backtrace), then the default action: the
  // process still ends by the signal.
  for (std::size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    if (kSignals[i] != sig || !g_have_previous[i]) continue;
    const struct sigaction& prev = g_previous[i];
    if (prev.sa_flags & SA_SIGINFO) {
      if (prev.sa_sigaction) prev.sa_sigaction(sig, info, uctx);
    } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && prev.sa_handler) {
      prev.sa_handler(sig);
    }
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
}  // namespace

void set_phase(const char* what, int step) {
  std::string p = what;
  if (step >= 0) p += " " + std::to_string(step);
  copy(g_phase, sizeof g_phase, p);
  g_startup = std::strncmp(what, "start-up", 8) == 0 ? 1 : 0;
  g_joining = std::strncmp(what, "start-up: ", 10) == 0 ? 1 : 0;
}

std::string current_phase() { return g_phase; }
bool in_startup() { return g_startup != 0; }
bool ranks_joining() { return g_joining != 0; }

void end_while_joining(int sig, const char* signal_name) {
  put("kmoe: ");
  if (g_identity[0] != '\0') {
    put(g_identity);
    put(": ");
  }
  put(signal_name);
  put(" during ");
  put(g_phase);
  put(": ending now (the ranks had not joined: nothing to checkpoint)\n");
  ::_exit(128 + sig);
}

void set_world_identity(int rank, int size) {
  std::string id = "world rank " + (rank >= 0 ? std::to_string(rank) : std::string("?"));
  if (size > 0) id += " of " + std::to_string(size);
  id += " on node " + node_name();
  copy(g_identity, sizeof g_identity, id);
}

std::string process_identity() {
  ensure_identity();
  return g_identity;
}

void install_crash_report() {
  ensure_identity();
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (std::size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    struct sigaction old;
    if (sigaction(kSignals[i], &sa, &old) != 0) continue;
    // A second install keeps the first one's predecessor when it finds kmoe's own handler.
    if ((old.sa_flags & SA_SIGINFO) && old.sa_sigaction == on_fatal_signal) continue;
    g_previous[i] = old;
    g_have_previous[i] = true;
  }
}

void fail_process(const std::string& message, int code) {
  ensure_identity();
  const bool startup = in_startup();
  std::fprintf(stderr, "kmoe: %s: %s%s\n", g_identity, message.c_str(),
               startup ? " (start-up failed: exit code 75, transient)" : "");
  std::fflush(stderr);
  if (startup) report_startup_code();
  std::fflush(stdout);
  ::_exit(startup ? kStartupFailed : code);
}

}  // namespace kmoe
