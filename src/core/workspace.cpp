#include "core/workspace.hpp"

#include <algorithm>
#include <cstdint>

#include "core/device_sync.hpp"
#include "core/error.hpp"

// Under AddressSanitizer (an ASan build, docs/BUILDING.md) the workspace's memory that no open
// frame holds, and the gap after each take, is poisoned: a kernel that reads or writes past the
// end of its buffer, or a buffer after its frame closed, is reported. Host memory only.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define KMOE_WS_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define KMOE_WS_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define KMOE_WS_POISON(p, n) ((void)(p), (void)(n))
#define KMOE_WS_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace kmoe {

namespace {
constexpr bool kPoison = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
}  // namespace

Workspace::Chunk::Chunk(const std::string& label, std::int64_t bytes)
    : data(Kokkos::view_alloc(label, Kokkos::WithoutInitializing), bytes + 255),
      base(data.data() + (256 - reinterpret_cast<std::uintptr_t>(data.data()) % 256) % 256) {
  // (ASan's allocator makes the memory addressable again when it is freed and reused.)
  if (kPoison) KMOE_WS_POISON(data.data(), data.extent(0));
}

Workspace::Workspace(std::string label) : label_(std::move(label)) {}

void Workspace::reserve(std::int64_t bytes) {
  KMOE_REQUIRE(depth_ == 0, label_ << ": reserve() inside a frame");
  bytes = (bytes + 255) / 256 * 256;
  if (capacity() >= bytes && chunks_.size() <= 1) return;
  chunks_.clear();  // free before allocating: the two are never held together
  chunks_.emplace_back(label_, bytes);
  chunk_ = 0;
  used_ = 0;
}

std::int64_t Workspace::capacity() const {
  std::int64_t b = 0;
  for (const Chunk& c : chunks_) b += c.size();
  return b;
}

void* Workspace::take(std::int64_t bytes) {
  KMOE_REQUIRE(depth_ > 0 && bytes >= 0, label_ << ": a take outside every frame");
  const std::int64_t requested = bytes;
  bytes = rounded(std::max<std::int64_t>(bytes, 1));
  // The next chunk that fits: later chunks hold nothing live (they are above the top).
  while (chunk_ < chunks_.size() && used_ + bytes > chunks_[chunk_].size()) {
    ++chunk_;
    used_ = 0;
  }
  if (chunk_ == chunks_.size()) {
    // Room for this take and a quarter of what the stack holds, so a frame that outgrows the
    // reserve does not add a chunk per take.
    const std::int64_t n = rounded(bytes + live_ / 4);
    chunks_.emplace_back(label_ + " (grown)", n);
  }
  char* p = chunks_[chunk_].base + used_;
  if (kPoison) KMOE_WS_UNPOISON(p, requested);  // the gap after it stays poisoned
  used_ += bytes;
  live_ += bytes;
  high_water_ = std::max(high_water_, live_);
  return p;
}

void Workspace::consolidate() {
  if (chunks_.size() <= 1) return;
  host_sync("workspace grown");  // no kernel may still use the memory being freed
  chunks_.clear();
  chunks_.emplace_back(label_, high_water_);
  chunk_ = 0;
  used_ = 0;
}

Workspace::Frame::Frame(Workspace& ws)
    : ws_(ws), chunk_(ws.chunk_), used_(ws.used_), live_(ws.live_) {
  ++ws_.depth_;
}

Workspace::Frame::~Frame() {
  ws_.chunk_ = chunk_;
  ws_.used_ = used_;
  ws_.live_ = live_;
  if (kPoison)  // what the frame took is nobody's now
    for (std::size_t c = chunk_; c < ws_.chunks_.size(); ++c) {
      const Chunk& k = ws_.chunks_[c];
      const std::int64_t from = c == chunk_ ? used_ : 0;
      KMOE_WS_POISON(k.base + from, k.size() - from);
    }
  if (--ws_.depth_ == 0) ws_.consolidate();
}

}  // namespace kmoe
