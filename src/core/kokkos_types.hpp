// The one header of Kokkos aliases, loop policies and the math/printf bridge between Kokkos 3.4
// (Debian's Trilinos) and Kokkos 4.x/5.x. Nothing else in kmoe names a Kokkos version.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace kmoe {

using ExecSpace = Kokkos::DefaultExecutionSpace;
using MemSpace = ExecSpace::memory_space;
using HostSpace = Kokkos::HostSpace;
using Layout = Kokkos::LayoutRight;
using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;

// Page-locked host memory: the staging buffers of MPI on device memory (parallel/staged_comm)
// copy to and from it with DMA. The HIP space left Kokkos::Experimental in Kokkos 4.0.
#if defined(KOKKOS_ENABLE_CUDA)
using PinnedSpace = Kokkos::CudaHostPinnedSpace;
#elif defined(KOKKOS_ENABLE_HIP) && KOKKOS_VERSION >= 40000
using PinnedSpace = Kokkos::HIPHostPinnedSpace;
#elif defined(KOKKOS_ENABLE_HIP)
using PinnedSpace = Kokkos::Experimental::HIPHostPinnedSpace;
#else
using PinnedSpace = Kokkos::HostSpace;
#endif

// Owning device views.
using View1F = Kokkos::View<float*, Layout, MemSpace>;
using View1D = Kokkos::View<double*, Layout, MemSpace>;
using View1I = Kokkos::View<int*, Layout, MemSpace>;
using View2F = Kokkos::View<float**, Layout, MemSpace>;
using View2I = Kokkos::View<int**, Layout, MemSpace>;

// Unmanaged windows into flat buffers: the currency of module interfaces. Always contiguous
// row-major, so GEMMs on them reach vendor BLAS.
using Vec = Kokkos::View<float*, Layout, MemSpace, Unmanaged>;
using ConstVec = Kokkos::View<const float*, Layout, MemSpace, Unmanaged>;
using Mat = Kokkos::View<float**, Layout, MemSpace, Unmanaged>;
using ConstMat = Kokkos::View<const float**, Layout, MemSpace, Unmanaged>;
using IVec = Kokkos::View<int*, Layout, MemSpace, Unmanaged>;
using ConstIVec = Kokkos::View<const int*, Layout, MemSpace, Unmanaged>;

// A launch of a single index (a kernel on one thread, a GPU's worst shape) is reported to Kokkos
// Tools as the event "kmoe::one_thread" just before it starts, so the counter
// (tests/tools/kokkos_counter.cpp) names such kernels and ctest holds the dense step at none.
inline void note_one_thread_launch() {
  if (Kokkos::Tools::profileLibraryLoaded()) Kokkos::Tools::markEvent("kmoe::one_thread");
}
// The 1-D range of ExecSpace over [begin, end).
template <class B, class E>
inline Kokkos::RangePolicy<ExecSpace> Range(B begin, E end) {
  if (end - begin == 1) note_one_thread_launch();
  return Kokkos::RangePolicy<ExecSpace>(begin, end);
}
// Loops over flat extents that can pass 2^32 elements (a tensor, or a parameter, gradient or
// moment buffer: a 7B dense model's gradients on one GPU) take this policy, through
// flat_range(): CUDA's RangePolicy counts in 32 bits by default (Cuda::size_type), which CPU
// backends' 64-bit default hides. Their lambdas take std::int64_t.
using FlatRange = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
inline FlatRange flat_range(std::int64_t begin, std::int64_t end) {
  static_assert(sizeof(FlatRange::index_type) == 8 && std::is_signed_v<FlatRange::index_type>,
                "a flat loop must count in signed 64 bits on every backend");
  if (end - begin == 1) note_one_thread_launch();
  return FlatRange(begin, end);
}
// 2-D ranges iterate right-major on every backend (the last index fastest, as the row-major
// data lies): the default on GPUs is left-major, where a warp would read 32 different rows.
using Range2 =
    Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2, Kokkos::Iterate::Right, Kokkos::Iterate::Right>>;
using TeamPolicy = Kokkos::TeamPolicy<ExecSpace>;
using TeamMember = TeamPolicy::member_type;

// Device paths (docs/BUILDING.md, "Device paths on CPUs"): whether the branches that ask "is
// this a GPU" take their GPU form. Always on device builds; on host backends when the
// environment sets KMOE_DEVICE_PATHS=1 (read once), so one CPU build runs the GPU forms of
// vector lanes, team sizes, column chunks, host-thread GEMM batches and staged communication.
inline bool device_paths() {
  if constexpr (!Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) {
    return true;
  } else {
    static const bool on = [] {
      const char* v = std::getenv("KMOE_DEVICE_PATHS");
      return v && *v && std::strcmp(v, "0") != 0;
    }();
    return on;
  }
}

// A league of teams whose size the backend chooses (AUTO; one thread on host backends), or
// with device paths on a host backend of several threads, teams of up to 4, so team barriers
// and team reductions run with more than one thread as they do on GPUs.
inline TeamPolicy team_policy(int league, int lanes = 1) {
  if constexpr (Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) {
    if (device_paths()) {  // (the thread count only then: this runs at every launch)
      const int threads = ExecSpace().concurrency();
      if (threads > 1) return TeamPolicy(league, threads < 4 ? threads : 4, lanes);
    }
  }
  return TeamPolicy(league, Kokkos::AUTO, lanes);
}

// One team per row for row-wise reductions (norms, softmax).
inline TeamPolicy row_policy(int rows) { return team_policy(rows); }

// The widest vector a team's threads form: a warp (32) on CUDA (and device paths on host
// backends), a wavefront (64) on AMD GPUs.
#if defined(KOKKOS_ENABLE_HIP)
constexpr int kMaxVectorLanes = 64;
#else
constexpr int kMaxVectorLanes = 32;
#endif

// Vector lanes for an inner loop of n contiguous values: on GPUs (device paths) the largest
// power of two up to min(n, kMaxVectorLanes), so a warp's or wavefront's lanes touch consecutive
// addresses; 1 on host backends.
inline int vector_lanes(int n) {
  if (!device_paths()) return 1;
  int v = 1;
  while (v * 2 <= n && v * 2 <= kMaxVectorLanes) v *= 2;
  return v;
}

inline Mat as_mat(float* data, int rows, int cols) { return Mat(data, rows, cols); }
inline ConstMat as_cmat(const float* data, int rows, int cols) {
  return ConstMat(data, rows, cols);
}
inline Mat as_mat(const View2F& v) { return Mat(v.data(), v.extent(0), v.extent(1)); }
inline ConstMat as_cmat(const View2F& v) { return ConstMat(v.data(), v.extent(0), v.extent(1)); }
inline ConstMat as_cmat(const Mat& v) { return ConstMat(v.data(), v.extent(0), v.extent(1)); }

namespace math {
#if KOKKOS_VERSION >= 30700
#define KMOE_MATH_NS Kokkos
#else
#define KMOE_MATH_NS Kokkos::Experimental
#endif
KOKKOS_INLINE_FUNCTION float exp(float x) { return KMOE_MATH_NS::exp(x); }
KOKKOS_INLINE_FUNCTION double exp(double x) { return KMOE_MATH_NS::exp(x); }
KOKKOS_INLINE_FUNCTION float log(float x) { return KMOE_MATH_NS::log(x); }
KOKKOS_INLINE_FUNCTION double log(double x) { return KMOE_MATH_NS::log(x); }
KOKKOS_INLINE_FUNCTION float sqrt(float x) { return KMOE_MATH_NS::sqrt(x); }
KOKKOS_INLINE_FUNCTION double sqrt(double x) { return KMOE_MATH_NS::sqrt(x); }
KOKKOS_INLINE_FUNCTION float fabs(float x) { return KMOE_MATH_NS::fabs(x); }
KOKKOS_INLINE_FUNCTION double cos(double x) { return KMOE_MATH_NS::cos(x); }
KOKKOS_INLINE_FUNCTION double sin(double x) { return KMOE_MATH_NS::sin(x); }
#undef KMOE_MATH_NS
KOKKOS_INLINE_FUNCTION float rsqrt(float x) { return 1.0f / sqrt(x); }

// exp(x) in float without a library call, branch-free so element-wise loops vectorize (the
// libm call does not without -ffast-math). Cody-Waite reduction x = n ln2 + r, a degree-6
// polynomial for e^r on |r| <= ln2/2, and 2^n assembled in the exponent bits; within 2 ulp of
// expf over [-87, 88]; inputs beyond are clamped (e^-87 ~ 1.6e-38, the float floor).
KOKKOS_INLINE_FUNCTION float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round to nearest by the 1.5 * 2^23 shifter: plain float adds, no libm call.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

KOKKOS_INLINE_FUNCTION float sigmoid(float x) { return 1.0f / (1.0f + exp_poly(-x)); }
KOKKOS_INLINE_FUNCTION float silu(float x) { return x * sigmoid(x); }
KOKKOS_INLINE_FUNCTION float fmax(float a, float b) { return a > b ? a : b; }
}  // namespace math

#if KOKKOS_VERSION >= 40200
#define KMOE_KERNEL_PRINTF(...) Kokkos::printf(__VA_ARGS__)
#else
#define KMOE_KERNEL_PRINTF(...) printf(__VA_ARGS__)
#endif

}  // namespace kmoe
