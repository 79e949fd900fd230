// The points where the host waits for the device, each named (docs/ARCHITECTURE.md, "Host
// synchronizations"). Step code (src/parallel, train, modules) waits only through these
// (tests/layering checks it): a fence of the default execution space, or a read of device
// data into host memory. Each reports the Kokkos Tools event "kmoe::sync <what>", which
// tests/tools/kokkos_counter counts per step on every backend (Kokkos 3.4's Serial backend
// reports no fences of its own, and its mirror views copy nothing).
#pragma once

#include <string>

#include "core/kokkos_types.hpp"

namespace kmoe {

inline void mark_host_sync(const char* what) {
  if (Kokkos::Tools::profileLibraryLoaded())
    Kokkos::Tools::markEvent(std::string("kmoe::sync ") + what);
}

// The host waits for all work launched so far.
inline void host_sync(const char* what) {
  mark_host_sync(what);
  Kokkos::fence();
}

// The device view's contents in host memory, once the work that writes them is done (the view
// itself on host backends).
template <class View>
auto read_to_host(const char* what, const View& v) {
  mark_host_sync(what);
  return Kokkos::create_mirror_view_and_copy(HostSpace(), v);
}

}  // namespace kmoe
