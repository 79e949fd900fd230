#include "io/collective_write.hpp"

#include <unistd.h>

#include <filesystem>

#include "core/error.hpp"
#include "core/fault_injection.hpp"

namespace kmoe {

CollectiveWrite::CollectiveWrite(const std::string& path, const Communicator& world,
                                 double watchdog_seconds)
    : path_(path), world_(world), watchdog_(watchdog_seconds, "writing " + path) {
  try {
    file_.emplace(H5File::create(path, world.comm()));
    file_->set_progress([this] { watchdog_.progress(); });
  } catch (const Error& e) {
    error_ = e.what();
  }
  agree();
}

bool CollectiveWrite::agree() {
  watchdog_.progress();
  ok_ = world_.allreduce_max(error_.empty() ? 0.0 : 1.0) == 0.0;
  return ok_;
}

bool CollectiveWrite::step(const std::function<void(H5File&)>& work) {
  if (!ok_) return false;
  try {
    work(*file_);
  } catch (const Error& e) {
    error_ = e.what();
  }
  return agree();
}

void CollectiveWrite::finish(const std::string& what, const std::string& note) {
  if (ok_) {
    stall_save_if_requested(world_.rank());  // tests: a rank that never reaches the close
    if (!file_->try_close()) error_ = path_ + ": closing failed (the file system is full?)";
    agree();
  }
  if (ok_) {
    file_.reset();
    return;
  }
  const std::string first = world_.first_message(error_);
  if (file_ && world_.size() == 1) {
    // Free the partial file's blocks, so that HDF5 can complete the close (its flush needs a
    // little room) and nothing is left for it to flush at MPI_Finalize.
    if (::truncate(path_.c_str(), 0) != 0 || !file_->try_close()) file_->abandon();
  } else if (file_) {
    // After a failed write the ranks' HDF5 states can disagree (one rank's idea of the file's
    // size), so a collective close could wait forever: the file is left to the job's abort,
    // which every rank reaches with this same error (the driver aborts a failed multi-rank job).
    file_->abandon();
  }
  file_.reset();
  world_.on_root([&] {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  });
  throw SharedError(what + ": " + first + note);
}

}  // namespace kmoe
