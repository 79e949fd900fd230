#include "io/durable_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "core/error.hpp"

namespace kmoe {

namespace {

void sync_path(const std::filesystem::path& path, int flags, const char* kind) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  KMOE_REQUIRE(fd >= 0, path.string() << ": cannot open the " << kind
                                      << " to flush it to the disk: " << std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // A file system that cannot flush a directory (EINVAL) has nothing to flush there.
  KMOE_REQUIRE(
      rc == 0 || (err == EINVAL && (flags & O_DIRECTORY)),
      path.string() << ": cannot flush the " << kind << " to the disk: " << std::strerror(err));
}

}  // namespace

void sync_file(const std::filesystem::path& path) { sync_path(path, O_RDONLY, "file"); }

void sync_directory(const std::filesystem::path& dir) {
  sync_path(dir.empty() ? std::filesystem::path(".") : dir, O_RDONLY | O_DIRECTORY, "directory");
}

void rename_durably(const std::filesystem::path& tmp, const std::filesystem::path& path,
                    const char* what) {
  sync_file(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KMOE_REQUIRE(!ec, path.string() << ": cannot move the finished " << what << " into place ("
                                  << tmp.string() << "): " << ec.message());
  sync_directory(path.parent_path());
}

}  // namespace kmoe
