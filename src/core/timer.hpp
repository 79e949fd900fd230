// Wall-clock phase timers. Each stop() fences the execution space so device work is counted
// in the phase that launched it.
#pragma once

#include <chrono>

#include "core/kokkos_types.hpp"

namespace kmoe {

class PhaseTimer {
 public:
  void start() { t0_ = std::chrono::steady_clock::now(); }
  // Adds the time since start() to `total`, and restarts.
  void stop(double& total) {
    Kokkos::fence();
    const auto t = std::chrono::steady_clock::now();
    total += std::chrono::duration<double>(t - t0_).count();
    t0_ = t;
  }

 private:
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

}  // namespace kmoe
