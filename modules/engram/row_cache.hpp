// The device row cache of an Engram table kept in host memory (engram.offload = host; MODEL.md
// section 4, RUNTIME.md section 8). A lookup's requests name rows of the table; stage() finds
// the distinct rows on the host, gathers them by host threads into a pinned staging buffer and
// queues their copy to the device cache, with each request's slot in it, on a side stream of
// the device (core/device_sync.hpp): the host's work and the copy overlap whatever the device is
// still running; wait() holds the host until the copy is done, before the kernels that read it.
// The gradient goes the other way: each request's row gradient comes back to the host, where
// the requests of one row are summed in request order and added to the row's gradient, the
// order (and so the values) of the device-resident table's per-row sums.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"

namespace kmoe {

class EngramRowCache {
 public:
  EngramRowCache() = default;
  // width: floats per row; max_requests: per stage() call as planned (a call with more grows
  // the buffers).
  EngramRowCache(int width, int max_requests);

  // rows: (n) host row ids in [0, local rows) of host_resident tensor `tab` -> the device
  // cache holds each distinct row once (unique() of them) and slots() each request's place.
  // The device's reads of the previous stage() must be done (the caller's order guarantees it
  // in training: a backward waits for its row gradients; otherwise `settled` = false and the
  // host waits for the device first).
  void stage(const TensorTable& table, int tab, const int* rows, int n, bool settled);
  // Before the first kernel that reads cache() or slots(): the copies are done (the named
  // wait "engram offload copy" where they run on a side stream; nothing on host backends).
  void wait() const;
  // Device views of the last stage(): (unique, width) rows, (n) slots.
  ConstMat cache() const { return ConstMat(cache_.data(), unique_, width_); }
  ConstIVec slots() const { return ConstIVec(slots_.data(), n_); }
  int unique() const { return unique_; }
  int requests() const { return n_; }

  // d_req: (requests(), width) device gradients of the last stage()'s requests -> added to
  // tensor `tab`'s host gradient rows, each row's requests summed in request order. Waits for
  // the device (the named sync "engram offload gradients").
  void add_gradients(TensorTable& table, int tab, const float* d_req) const;

  // Bytes this cache holds in device memory and in host memory.
  static std::int64_t device_bytes(int width, std::int64_t max_requests);
  static std::int64_t host_bytes(int width, std::int64_t max_requests);

 private:
  void reserve(int n);
  int width_ = 0, max_ = 0, n_ = 0, unique_ = 0;
  ExecSpace copies_;  // the side stream the copies go on
  View1F cache_;      // (max, width)
  View1I slots_;      // (max)
  Kokkos::View<float*, Layout, PinnedSpace> staging_;       // (max, width)
  Kokkos::View<int*, Layout, PinnedSpace> slots_h_, uniq_h_;  // (max)
  std::vector<std::uint64_t> keys_;  // (row << 32 | request), sorted: rows, then requests
  std::vector<int> first_;           // (unique + 1) each distinct row's first key
};

}  // namespace kmoe
