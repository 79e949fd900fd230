#include "core/device_sync.hpp"

#include <algorithm>
#include <map>
#include <mutex>

namespace kmoe {

namespace {

using Bytes = Kokkos::View<char*, Layout, PinnedSpace>;

struct ReadBuffers {
  std::mutex mutex;
  std::map<std::string, Bytes> by_name;
  bool hook = false;  // the release at Kokkos' finalize is registered
};

ReadBuffers& read_buffers() {
  static ReadBuffers* r = new ReadBuffers;  // leaked: its views are released at finalize
  return *r;
}

}  // namespace

#if (defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP)) && KOKKOS_VERSION >= 40000
ExecSpace side_stream() { return Kokkos::Experimental::partition_space(ExecSpace(), 1)[0]; }
bool has_side_stream() { return true; }
#else
ExecSpace side_stream() { return ExecSpace(); }
bool has_side_stream() { return false; }
#endif

void* host_read_buffer(const char* what, std::size_t bytes) {
  ReadBuffers& r = read_buffers();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!r.hook) {
    Kokkos::push_finalize_hook([] {
      ReadBuffers& rb = read_buffers();
      std::lock_guard<std::mutex> l(rb.mutex);
      rb.by_name.clear();
      rb.hook = false;
    });
    r.hook = true;
  }
  Bytes& b = r.by_name[what];
  if (b.extent(0) < bytes) {
    b = Bytes();  // the old buffer goes first
    b = Bytes(Kokkos::view_alloc(Kokkos::WithoutInitializing, kHostLabel + std::string(what)),
              std::max<std::size_t>(bytes, 64));
  }
  return b.data();
}

}  // namespace kmoe
