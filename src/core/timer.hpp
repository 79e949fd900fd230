// Wall-clock phase timers. An enabled timer's stop() waits for the device (a named host
// synchronization) so device work is counted in the phase that launched it; a disabled one
// adds nothing and never waits (the step's phases, unless output.phase_timing = true).
#pragma once

#include <chrono>
#include <string>

#include "core/device_sync.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

class PhaseTimer {
 public:
  explicit PhaseTimer(bool enabled = true) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  void start() { t0_ = std::chrono::steady_clock::now(); }
  // Adds the time since start() to `total`, and restarts.
  void stop(double& total) {
    if (!enabled_) return;
    host_sync("phase timer");
    const auto t = std::chrono::steady_clock::now();
    total += std::chrono::duration<double>(t - t0_).count();
    t0_ = t;
  }

 private:
  bool enabled_ = true;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// A named Kokkos Tools region for the scope's lifetime ("kmoe::step" around each optimizer
// step: tests/tools/kokkos_counter counts per step inside it). Free unless a tool is loaded.
class ProfileRegion {
 public:
  explicit ProfileRegion(const std::string& name) { Kokkos::Profiling::pushRegion(name); }
  ~ProfileRegion() { Kokkos::Profiling::popRegion(); }
  ProfileRegion(const ProfileRegion&) = delete;
  ProfileRegion& operator=(const ProfileRegion&) = delete;
};

}  // namespace kmoe
