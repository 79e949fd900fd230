#include "modules/attention/rope.hpp"

#include <cmath>

#include "core/device_sync.hpp"

namespace kmoe {

RopeTables::RopeTables(int seq_len, int head_dim, double theta)
    : cos("rope::cos", seq_len, head_dim / 2), sin("rope::sin", seq_len, head_dim / 2) {
  auto hc = Kokkos::create_mirror_view(cos);
  auto hs = Kokkos::create_mirror_view(sin);
  for (int p = 0; p < seq_len; ++p)
    for (int i = 0; i < head_dim / 2; ++i) {
      const double inv_freq = std::pow(theta, -2.0 * i / head_dim);
      const double angle = p * inv_freq;
      hc(p, i) = static_cast<float>(std::cos(angle));
      hs(p, i) = static_cast<float>(std::sin(angle));
    }
  mark_host_sync("rope tables");
  Kokkos::deep_copy(cos, hc);
  mark_host_sync("rope tables");
  Kokkos::deep_copy(sin, hs);
}

}  // namespace kmoe
