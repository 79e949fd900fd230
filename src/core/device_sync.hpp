// The points where the host waits for the device, each named (docs/ARCHITECTURE.md, "Host
// synchronizations"). Step code (src/parallel, train, modules) waits only through these
// (tests/layering checks it): a fence of the default execution space, or a read of device
// data into host memory. Each reports the Kokkos Tools event "kmoe::sync <what>", which
// tests/tools/kokkos_counter counts per step on every backend (Kokkos 3.4's Serial backend
// reports no fences of its own, and its mirror views copy nothing).
#pragma once

#include <cstddef>
#include <string>

#include "core/device_memory.hpp"
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

// A second stream of the device for copies that overlap its kernels (CUDA and HIP under Kokkos
// >= 4: an instance of its own), or the default execution space itself where there is none
// (host backends: its order is the program's, so nothing needs waiting for).
ExecSpace side_stream();
bool has_side_stream();
// A copy queued on `stream` (asynchronous where it is a side stream: its buffers stay untouched
// until stream_sync).
template <class Dst, class Src>
void copy_on(const ExecSpace& stream, const Dst& dst, const Src& src) {
  Kokkos::deep_copy(stream, dst, src);
}
// The host waits for the work queued on a side stream (no-op without one).
inline void stream_sync(const ExecSpace& stream, const char* what) {
  if (!has_side_stream()) return;
  mark_host_sync(what);
  stream.fence();
}

// Host memory that a named read reuses from call to call: `bytes` or more, page-locked where
// the backend has such memory, labelled kHostLabel + what, grown when a read needs more (the
// previous contents are then gone). Released when Kokkos finalizes.
void* host_read_buffer(const char* what, std::size_t bytes);

// A host view of a device view's shape over memory the caller provides.
template <class View>
using HostViewOf = Kokkos::View<typename View::non_const_data_type, typename View::array_layout,
                                HostSpace, Unmanaged>;

// Whether views of MemSpace are read in place on the host: a host backend without device
// paths. With device paths a host backend copies as a GPU build does (core/device_memory.hpp).
template <class View>
bool host_reads_in_place() {
  if constexpr (Kokkos::SpaceAccessibility<HostSpace, typename View::memory_space>::accessible)
    return !device_paths();
  else
    return false;
}

// The device view's contents in host memory, once the work that writes them is done: the view
// itself where host_reads_in_place, else a copy in the host buffer of this name, valid until
// the next read of the same name (a name allocates at its first read and again only when a
// read needs more, so the step's named waits allocate nothing in a steady run). The view must
// be contiguous.
template <class View>
HostViewOf<View> read_to_host(const char* what, const View& v) {
  mark_host_sync(what);
  using Host = HostViewOf<View>;
  using T = typename View::non_const_value_type;
  if constexpr (Kokkos::SpaceAccessibility<HostSpace, typename View::memory_space>::accessible) {
    if (host_reads_in_place<View>()) {
      Kokkos::fence();
      return Host(const_cast<T*>(v.data()), v.layout());
    }
  }
  Host h(static_cast<T*>(host_read_buffer(what, v.span() * sizeof(T))), v.layout());
  Kokkos::deep_copy(h, v);
  return h;
}

// A host view of the device view's shape that owns its memory (labelled kHostLabel + label:
// checkpoint and dump buffers, which the HDF5 layer takes), or the view itself where
// host_reads_in_place. Uninitialized unless it is the view itself.
template <class View>
Kokkos::View<typename View::non_const_data_type, typename View::array_layout, HostSpace>
host_mirror(const std::string& label, const View& v) {
  using Host = Kokkos::View<typename View::non_const_data_type, typename View::array_layout,
                            HostSpace>;
  if constexpr (Kokkos::SpaceAccessibility<HostSpace, typename View::memory_space>::accessible) {
    if (host_reads_in_place<View>()) return Host(v);
  }
  return Host(Kokkos::view_alloc(Kokkos::WithoutInitializing, kHostLabel + label), v.layout());
}

// host_mirror with the view's contents, once the work that writes them is done.
template <class View>
auto host_copy(const std::string& label, const View& v) {
  auto h = host_mirror(label, v);
  mark_host_sync(label.c_str());
  if (h.data() == v.data())
    Kokkos::fence();
  else
    Kokkos::deep_copy(h, v);
  return h;
}

}  // namespace kmoe
