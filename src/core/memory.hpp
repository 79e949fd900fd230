// Host memory high-water mark of this process (Linux ru_maxrss).
#pragma once

#include <sys/resource.h>

namespace kmoe {

inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;  // KiB on Linux
}

}  // namespace kmoe
