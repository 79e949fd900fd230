// Writing one shared HDF5 file from every rank when a write can fail on some ranks only (a full
// disk, a quota, one rank's file system): each step (creating the file, one dataset, one
// attribute) runs on every rank, each rank keeps its first error, and the ranks agree after the
// step, so that no rank ever skips a collective the others make. After a failure every later
// step is skipped on every rank; finish() then removes the partial file and throws the same
// SharedError everywhere. An IoWatchdog ends the job if a collective inside HDF5 makes no
// progress for parallel.watchdog_seconds.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "io/hdf5_file.hpp"
#include "parallel/communicator.hpp"
#include "parallel/io_watchdog.hpp"

namespace kmoe {

class CollectiveWrite {
 public:
  // Creates `path` (truncating) collectively over `world`, as the first step.
  CollectiveWrite(const std::string& path, const Communicator& world, double watchdog_seconds);

  // One step on every rank; false once any rank failed in it or before (the work is then not
  // run). Every rank must make the same sequence of calls.
  bool step(const std::function<void(H5File&)>& work);
  bool ok() const { return ok_; }

  // Closes the file (a step of its own: the final flush can fail too). On a failure removes the
  // partial file and throws SharedError("<what>: <first error>" + note) on every rank.
  void finish(const std::string& what, const std::string& note = "");

  // The watchdog's clock: a long transfer inside a step (a block of rows) counts as progress.
  void progress() { watchdog_.progress(); }

 private:
  bool agree();

  std::string path_;
  const Communicator& world_;
  IoWatchdog watchdog_;
  std::optional<H5File> file_;
  std::string error_;
  bool ok_ = true;
};

}  // namespace kmoe
