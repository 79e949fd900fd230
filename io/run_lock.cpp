#include "io/run_lock.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "core/error.hpp"

namespace kmoe {

namespace fs = std::filesystem;

namespace {

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// The lock file's "key value" lines.
std::map<std::string, std::string> read_lock(const std::string& path) {
  std::map<std::string, std::string> kv;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto sp = line.find(' ');
    if (sp != std::string::npos) kv[line.substr(0, sp)] = line.substr(sp + 1);
  }
  return kv;
}

// Seconds since the holder's last heartbeat: its heartbeat line, else the file's age.
double heartbeat_age(const std::string& path, const std::map<std::string, std::string>& kv) {
  const double now = static_cast<double>(std::time(nullptr));
  const auto it = kv.find("heartbeat");
  if (it != kv.end()) {
    char* end = nullptr;
    const double t = std::strtod(it->second.c_str(), &end);
    if (end != it->second.c_str()) return now - t;
  }
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? now - static_cast<double>(st.st_mtime) : 1e30;
}

// A zombie (killed, not yet reaped) counts as gone.
bool process_alive(long pid) {
  if (pid <= 0 || (::kill(pid, 0) != 0 && errno != EPERM)) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const auto close = text.rfind(')');  // "pid (comm) state ..."
  return close == std::string::npos || close + 2 >= text.size() ||
         (text[close + 2] != 'Z' && text[close + 2] != 'X');
}

std::string value_or(const std::map<std::string, std::string>& kv, const char* key,
                     const char* fallback) {
  const auto it = kv.find(key);
  return it == kv.end() ? fallback : it->second;
}

}  // namespace

RunLock::RunLock(const CheckpointCfg& cfg, const Communicator& world)
    : path_((fs::path(cfg.dir) / "kmoe.lock").string()) {
  host_ = host_name();
  pid_ = static_cast<long>(::getpid());
  started_ = utc_now();
  if (const char* job = std::getenv("SLURM_JOB_ID")) job_ = job;
  interval_s_ = std::max(1.0, std::min(60.0, cfg.lock_stale_seconds / 4.0));
  world.on_root([&] {
    std::error_code ec;
    fs::create_directories(cfg.dir, ec);
    KMOE_REQUIRE(!ec, "checkpoint.dir = " << cfg.dir << ": cannot create: " << ec.message());
    const std::string mine = path_ + "." + host_ + "." + std::to_string(pid_);
    write_lock_file(mine);
    // link() creates the lock only if there is none: two runs cannot both succeed. Where the
    // file system has no hard links, an O_EXCL create does the same.
    bool created = ::link(mine.c_str(), path_.c_str()) == 0;
    int create_errno = created ? 0 : errno;
    if (!created && create_errno != EEXIST) {
      const int fd = ::open(path_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
      create_errno = fd >= 0 ? 0 : errno;
      if (fd >= 0) {
        ::close(fd);
        created = ::rename(mine.c_str(), path_.c_str()) == 0;
        if (!created) create_errno = errno;
      }
    }
    if (created) {
      ::unlink(mine.c_str());
      holder_ = true;
      return;
    }
    if (create_errno != EEXIST) {
      ::unlink(mine.c_str());
      KMOE_FAIL(path_ << ": cannot create the run lock (" << std::strerror(create_errno) << ")");
    }
    const auto held = read_lock(path_);
    const std::string host = value_or(held, "host", "?"), job = value_or(held, "slurm_job", "");
    const long pid = std::atol(value_or(held, "pid", "0").c_str());
    const double age = heartbeat_age(path_, held);
    const bool own_job = !job_.empty() && job == job_;
    std::string why;
    if (own_job)
      why = "it is this Slurm job's own lock (" + job + "), from before a requeue";
    else if (host == host_ && !process_alive(pid))
      why = "its process " + std::to_string(pid) + " on this host is gone";
    else if (age > cfg.lock_stale_seconds)
      why = "its last heartbeat is " + std::to_string(static_cast<long long>(age)) +
            " s old, more than checkpoint.lock_stale_seconds = " +
            std::to_string(cfg.lock_stale_seconds);
    if (why.empty()) {
      ::unlink(mine.c_str());
      KMOE_FAIL("checkpoint.dir = "
                << cfg.dir << " belongs to another run: host " << host << ", pid " << pid
                << ", started " << value_or(held, "started", "?")
                << (job.empty() ? "" : ", Slurm job " + job) << ", last heartbeat "
                << static_cast<long long>(age) << " s ago (" << path_
                << "). Use another checkpoint.dir, wait for that run, or "
                   "remove the lock if it is gone (it is taken over by itself "
                   "after checkpoint.lock_stale_seconds = "
                << cfg.lock_stale_seconds << " s without a heartbeat)");
    }
    if (::rename(mine.c_str(), path_.c_str()) != 0) {
      const int e = errno;
      ::unlink(mine.c_str());
      KMOE_FAIL(path_ << ": cannot take over the run lock (" << std::strerror(e) << ")");
    }
    // Two runs taking over the same stale lock at the same instant: the last rename wins, and
    // the other one sees it here (a window of a few microseconds remains).
    KMOE_REQUIRE(still_ours(), path_ << ": another run took the lock over at the same time");
    holder_ = true;
    requeued_own_ = own_job;
    std::printf("checkpoint.dir = %s: taking over the run lock of host %s, pid %ld: %s\n",
                cfg.dir.c_str(), host.c_str(), pid, why.c_str());
    std::fflush(stdout);
  });
  if (holder_) thread_ = std::thread([this] { heartbeat(); });
}

RunLock::~RunLock() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (holder_ && still_ours()) ::unlink(path_.c_str());  // not taken over meanwhile
}

void RunLock::write_lock_file(const std::string& path) const {
  std::ofstream out(path);
  out << "kmoe run lock\nhost " << host_ << "\npid " << pid_ << "\nstarted " << started_
      << "\nslurm_job " << job_ << "\nheartbeat " << std::time(nullptr) << "\n";
  out.close();
  KMOE_REQUIRE(!out.fail(), path << ": cannot write the run lock (the file system is full?)");
}

bool RunLock::still_ours() const {
  const auto held = read_lock(path_);
  return value_or(held, "host", "") == host_ && value_or(held, "pid", "") == std::to_string(pid_);
}

void RunLock::write_lock() const {
  const std::string tmp = path_ + "." + host_ + "." + std::to_string(pid_);
  try {
    write_lock_file(tmp);
    if (::rename(tmp.c_str(), path_.c_str()) != 0) ::unlink(tmp.c_str());
  } catch (const Error&) {
    ::unlink(tmp.c_str());  // a full disk only ages the heartbeat; the run goes on
  }
}

void RunLock::heartbeat() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (
      !wake_.wait_for(lock, std::chrono::duration<double>(interval_s_), [this] { return done_; })) {
    // Another run took the lock over (this one stalled past lock_stale_seconds): never write
    // over its lock; the run stops at its next step boundary.
    if (!still_ours()) {
      lost_ = true;
      return;
    }
    write_lock();
  }
}

void prepare_run_directories(const Config& cfg, bool resuming, bool own_files,
                             const Communicator& world) {
  world.on_root([&] {
    const fs::path dir = cfg.checkpoint.dir;
    std::error_code ec;
    std::vector<fs::path> checkpoints, temporaries;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string n = e.path().filename().string();
      const bool step_file = n.size() == 15 && n.rfind("step", 0) == 0 && n.substr(12) == ".h5";
      const bool temporary =
          n.size() == 20 && n.rfind(".step", 0) == 0 && n.substr(13) == ".h5.tmp";
      if (step_file || n == "latest") checkpoints.push_back(e.path());
      if (temporary) temporaries.push_back(e.path());
    }
    for (const fs::path& t : temporaries) {
      const double mib = fs::file_size(t, ec) / (1024.0 * 1024.0);
      std::printf("removing %s (%.1f MiB), the temporary file of an interrupted save\n",
                  t.string().c_str(), ec ? 0.0 : mib);
      fs::remove(t, ec);
    }
    if (resuming) return;
    const fs::path metrics = fs::path(cfg.output.dir) / "metrics.csv";
    const bool old_metrics = fs::is_regular_file(metrics, ec) && fs::file_size(metrics, ec) > 0;
    if (checkpoints.empty() && !old_metrics) return;
    std::vector<std::string> found;  // what the other run left
    if (!checkpoints.empty())
      found.push_back(std::to_string(checkpoints.size()) +
                      " checkpoint file(s) in checkpoint.dir = " + dir.string());
    if (old_metrics) found.push_back("its metrics.csv in output.dir = " + cfg.output.dir);
    const std::string what = found.size() == 2 ? found[0] + " and " + found[1] : found[0];
    if (own_files) {  // this Slurm job's own files, from before its requeue
      for (const fs::path& c : checkpoints) fs::remove(c, ec);
      if (old_metrics) fs::remove(metrics, ec);
      std::printf("the requeued job starts afresh: removed %s of its earlier attempt\n",
                  what.c_str());
      std::fflush(stdout);
      return;
    }
    KMOE_REQUIRE(cfg.checkpoint.overwrite,
                 "checkpoint.resume = " << cfg.checkpoint.resume
                                        << (cfg.checkpoint.resume == "none"
                                                ? ": a fresh run"
                                                : " found nothing to resume: a fresh run")
                                        << ", but another run left " << what
                                        << ". Resume that run (checkpoint.resume = auto, or a "
                                           "file), use other directories, or set "
                                           "checkpoint.overwrite = true to replace them");
    for (const fs::path& c : checkpoints) fs::remove(c, ec);
    if (old_metrics) fs::remove(metrics, ec);
    std::printf("checkpoint.overwrite = true: removed %s\n", what.c_str());
    std::fflush(stdout);
  });
}

}  // namespace kmoe
