// Files that survive a power loss or a kernel crash once they are in place (RUNTIME.md section
// 4): a finished temporary file is flushed to the disk before it is renamed over its final name,
// and the directory after the rename, so a name never points at data that never reached the
// disk. kill -9 needs none of this (the page cache survives the process); a crashed node does.
#pragma once

#include <filesystem>

namespace kmoe {

// fsync of a file's data and metadata; throws kmoe::Error naming the file.
void sync_file(const std::filesystem::path& path);

// fsync of a directory, so the names it holds (a rename into it) are on the disk.
void sync_directory(const std::filesystem::path& dir);

// Flushes `tmp`, renames it to `path` (replacing it) and flushes the directory; throws
// kmoe::Error naming `what` (the file's role) and the paths.
void rename_durably(const std::filesystem::path& tmp, const std::filesystem::path& path,
                    const char* what);

}  // namespace kmoe
