#include "modules/engram/row_cache.hpp"

#include <algorithm>

#include "core/device_sync.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {
using HostRange = Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>;
}  // namespace

EngramRowCache::EngramRowCache(int width, int max_requests)
    : width_(width), copies_(side_stream()) {
  reserve(max_requests);
}

void EngramRowCache::reserve(int n) {
  max_ = n;
  cache_ = View1F("engram::row_cache", std::int64_t(n) * width_);
  slots_ = View1I("engram::row_cache_slots", n);
  staging_ = decltype(staging_)("engram::row_staging", std::int64_t(n) * width_);
  slots_h_ = decltype(slots_h_)("engram::row_staging_slots", n);
  uniq_h_ = decltype(uniq_h_)("engram::row_staging_rows", n);
  keys_.reserve(n);
  first_.reserve(std::size_t(n) + 1);
}

std::int64_t EngramRowCache::device_bytes(int width, std::int64_t max_requests) {
  return max_requests * (4 * std::int64_t(width) + 4);
}

std::int64_t EngramRowCache::host_bytes(int width, std::int64_t max_requests) {
  // staging, slots and rows, the sort keys and row starts, the gradients read back
  return max_requests * (8 * std::int64_t(width) + 8 + 8 + 4);
}

void EngramRowCache::stage(const TensorTable& table, int tab, const int* rows, int n,
                           bool settled) {
  if (!settled) host_sync("engram offload staging");  // the device may still read the cache
  // More requests than planned for (a holder of a sharded table asked by every member at
  // once): room for them and a quarter more, once.
  if (n > max_) {
    stream_sync(copies_, "engram offload copy");  // nothing may still copy into the old ones
    reserve(n + n / 4);
  }
  const std::int64_t local_rows = table.entry(tab).spec.local_rows();
  keys_.resize(n);
  for (int a = 0; a < n; ++a) {
    KMOE_REQUIRE(rows[a] >= 0 && rows[a] < local_rows,
                 "EngramRowCache: row " << rows[a] << " outside " << local_rows);
    keys_[a] = (std::uint64_t(rows[a]) << 32) | std::uint64_t(a);
  }
  std::sort(keys_.begin(), keys_.end());
  first_.clear();
  int* slot = slots_h_.data();
  int* uniq = uniq_h_.data();
  for (int k = 0; k < n; ++k) {
    const int row = static_cast<int>(keys_[k] >> 32);
    if (k == 0 || row != static_cast<int>(keys_[k - 1] >> 32)) {
      uniq[first_.size()] = row;
      first_.push_back(k);
    }
    slot[keys_[k] & 0xffffffffu] = static_cast<int>(first_.size()) - 1;
  }
  unique_ = static_cast<int>(first_.size());
  first_.push_back(n);
  n_ = n;

  // The distinct rows, gathered by host threads.
  const int w = width_;
  const float* src = table.host_param(tab);
  float* dst = staging_.data();
  Kokkos::parallel_for(
      "engram::gather_rows", HostRange(0, unique_), [=](int s) {
        std::copy_n(src + std::int64_t(uniq[s]) * w, w, dst + std::int64_t(s) * w);
      });
  // On the side stream (host backends: in the program's order), waited for by wait().
  auto sub = [](const auto& v, std::int64_t count) {
    return Kokkos::subview(v, std::make_pair(std::int64_t(0), count));
  };
  copy_on(copies_, sub(cache_, std::int64_t(unique_) * w), sub(staging_, std::int64_t(unique_) * w));
  copy_on(copies_, sub(slots_, n), sub(slots_h_, n));
}

void EngramRowCache::wait() const { stream_sync(copies_, "engram offload copy"); }

void EngramRowCache::add_gradients(TensorTable& table, int tab, const float* d_req) const {
  const int w = width_;
  const auto g = read_to_host("engram offload gradients",
                              ConstVec(d_req, std::int64_t(n_) * w));
  const float* in = g.data();
  float* grad = table.host_grad(tab);
  const std::uint64_t* keys = keys_.data();
  const int* first = first_.data();
  const int* uniq = uniq_h_.data();
  // Distinct rows in parallel, each row's requests in request order.
  Kokkos::parallel_for(
      "engram::add_row_gradients", HostRange(0, unique_), [=](int s) {
        float* out = grad + std::int64_t(uniq[s]) * w;
        for (int i = 0; i < w; ++i) {
          float acc = 0.0f;
          for (int k = first[s]; k < first[s + 1]; ++k)
            acc += in[std::int64_t(keys[k] & 0xffffffffu) * w + i];
          out[i] += acc;
        }
      });
}

}  // namespace kmoe
