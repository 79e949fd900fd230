#include "core/device_memory.hpp"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

namespace {

struct Allocation {
  std::uint64_t bytes;  // as Kokkos reports it (see kHeader)
  std::string space, label;
};

// A view's allocation is a header, then its data; Kokkos reports the header's address with the
// data's size, or the header's own size for a view of no elements. Kokkos' raw allocations
// carry no header and end at the reported size: its scratch memory, labelled "Kokkos::..." or,
// where it calls the space's allocate without a label (Kokkos 3.4's OpenMP thread data),
// "[unlabeled]".
constexpr std::uint64_t kHeader = sizeof(Kokkos::Impl::SharedAllocationHeader);

// One past the allocation's last byte. A view that reports kHeader bytes is either empty or
// holds kHeader bytes of data: on host-accessible memory its header says which (its first
// member points to the view's record, which knows the data's size; trusted when the header holds
// the allocation's label). Device memory cannot be read here, so such a view's end is taken as
// far as it can be: only device memory lies past a device allocation, no host buffer.
std::uintptr_t allocation_end(std::uintptr_t start, const Allocation& a) {
  if (a.label.rfind("Kokkos::", 0) == 0 || a.label == "[unlabeled]") return start + a.bytes;
  if constexpr (Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) {
    if (a.bytes == kHeader) {
      using Header = Kokkos::Impl::SharedAllocationHeader;
      using Record = Kokkos::Impl::SharedAllocationRecord<void, void>;
      const char* in_header = reinterpret_cast<const Header*>(start)->label();
      if (*in_header && a.label.rfind(in_header, 0) == 0) {  // (long labels are cut short there)
        const Record* record = *reinterpret_cast<const Record* const*>(start);
        return start + kHeader + record->size();
      }
    }
  }
  return start + a.bytes + kHeader;
}

// Leaked on purpose: Kokkos may report a deallocation during static destruction.
struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, Allocation> device;  // by start address
  Kokkos_Profiling_allocateDataFunction next_allocate = nullptr;
  Kokkos_Profiling_deallocateDataFunction next_deallocate = nullptr;
};

Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

std::atomic<bool> g_on{false};
std::atomic<bool> g_mpi_device{false};

void on_allocate(const Kokkos_Profiling_SpaceHandle space, const char* label, const void* ptr,
                 const std::uint64_t bytes) {
  Registry& r = registry();
  if (counts_as_device(space.name, label)) {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.device[reinterpret_cast<std::uintptr_t>(ptr)] = Allocation{bytes, space.name, label};
  }
  if (r.next_allocate) r.next_allocate(space, label, ptr, bytes);
}

void on_deallocate(const Kokkos_Profiling_SpaceHandle space, const char* label, const void* ptr,
                   const std::uint64_t bytes) {
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.device.erase(reinterpret_cast<std::uintptr_t>(ptr));
  }
  if (r.next_deallocate) r.next_deallocate(space, label, ptr, bytes);
}

}  // namespace

bool counts_as_device(const char* space, const char* label) {
  if constexpr (!Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) {
    (void)label;
    // "Cuda", "CudaUVM", "HIP", "HIPManaged", "SYCLDeviceUSM" ...; not "Host", "HostSpace",
    // "CudaHostPinned", "HIPHostPinned", "SYCLHostUSM".
    return std::strstr(space, "Host") == nullptr;
  } else {
    (void)space;
    return device_paths() && std::strncmp(label, kHostLabel, std::strlen(kHostLabel)) != 0;
  }
}

void start_device_memory_check() {
  if (g_on.exchange(true)) return;
  Registry& r = registry();
  // A tool library loaded at Kokkos' start keeps seeing every allocation.
  const auto before = Kokkos::Tools::Experimental::get_callbacks();
  r.next_allocate = before.allocate_data;
  r.next_deallocate = before.deallocate_data;
  Kokkos::Tools::Experimental::set_allocate_data_callback(&on_allocate);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(&on_deallocate);
}

bool start_device_memory_check_from_env() {
  const char* v = std::getenv("KMOE_CHECK_DEVICE_MEMORY");
  if (v && *v && std::strcmp(v, "0") != 0) start_device_memory_check();
  return device_memory_check_on();
}

bool device_memory_check_on() { return g_on.load(std::memory_order_relaxed); }

std::string device_allocation_at(const void* p, std::size_t bytes) {
  if (!device_memory_check_on() || bytes == 0 || p == nullptr) return "";
  Registry& r = registry();
  const auto begin = reinterpret_cast<std::uintptr_t>(p), end = begin + bytes;
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.device.empty()) return "";
  // The last allocation that starts at or below p, and those that start inside the range.
  const Allocation* hit = nullptr;
  auto it = r.device.upper_bound(begin);
  if (it != r.device.begin()) {
    const auto prev = std::prev(it);
    if (allocation_end(prev->first, prev->second) > begin) hit = &prev->second;
  }
  if (!hit && it != r.device.end() && it->first < end) hit = &it->second;
  if (!hit) return "";
  std::ostringstream os;
  os << "'" << hit->label << "' (" << hit->space << ", " << hit->bytes << " bytes)";
  return os.str();
}

void require_host_memory(const void* p, std::size_t bytes, const std::string& who,
                         const char* why) {
  const std::string in = device_allocation_at(p, bytes);
  if (in.empty()) return;
  const bool emulated = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
  KMOE_FAIL(who << ": the buffer at " << p << " (" << bytes << " bytes) lies in device allocation "
                << in << (emulated ? " (device memory as KMOE_DEVICE_PATHS=1 emulates it)" : "")
                << "; " << why << " (KMOE_CHECK_DEVICE_MEMORY=1 checks this)");
}

void declare_mpi_device_memory(bool takes) { g_mpi_device.store(takes); }
bool mpi_device_memory_declared() { return g_mpi_device.load(); }

}  // namespace kmoe
