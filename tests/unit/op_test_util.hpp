// Shared by the op unit tests (test_ops*.cpp): host/device copies, random fills, double-precision
// host matrices for the naive references, and the central finite-difference check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"

namespace kmoe {
namespace op_test {

using HostVec = Kokkos::View<float*, Layout, HostSpace, Unmanaged>;
using ConstHostVec = Kokkos::View<const float*, Layout, HostSpace, Unmanaged>;

inline std::vector<float> to_host(const float* device_data, std::int64_t n) {
  std::vector<float> h(n);
  Kokkos::deep_copy(HostVec(h.data(), n), ConstVec(device_data, n));
  return h;
}
inline void to_device(const std::vector<float>& h, float* device_data) {
  Kokkos::deep_copy(Vec(device_data, h.size()), ConstHostVec(h.data(), h.size()));
}
inline View1F device_copy(const std::vector<float>& h) {
  View1F v("op_test::buffer", h.size());
  to_device(h, v.data());
  return v;
}

inline std::vector<float> uniform(std::mt19937& gen, std::int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(gen);
  return v;
}

// Overwrites every parameter of the table: norm weights 1 + U(-0.3, 0.3), others U(-scale, scale).
inline void randomize_params(TensorTable& table, std::mt19937& gen, float scale) {
  auto h = to_host(table.params.data(), table.total_elements());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const auto& e : table.entries())
    for (std::int64_t i = e.offset; i < e.offset + e.size; ++i)
      h[i] = e.spec.init == InitKind::Ones ? 1.0f + 0.3f * u(gen) : scale * u(gen);
  to_device(h, table.params.data());
}

// Row-major [rows, cols] in double, for the naive references.
struct HostMat {
  int rows = 0, cols = 0;
  std::vector<double> v;
  HostMat() = default;
  HostMat(int r, int c) : rows(r), cols(c), v(static_cast<std::size_t>(r) * c, 0.0) {}
  HostMat(const float* data, int r, int c) : HostMat(r, c) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = data[i];
  }
  double& operator()(int r, int c) { return v[static_cast<std::size_t>(r) * cols + c]; }
  double operator()(int r, int c) const { return v[static_cast<std::size_t>(r) * cols + c]; }
};

// Tensor `name` of the table as a [shape[0], rest] matrix (a vector: [shape[0], 1]), from a host
// copy of table.params.
inline HostMat param_mat(const TensorTable& table, const std::vector<float>& params,
                         const std::string& name) {
  const int idx = table.find(name);
  if (idx < 0) throw std::invalid_argument("no tensor " + name);
  const auto& e = table.entry(idx);
  const int rows = static_cast<int>(e.spec.shape[0]);
  return HostMat(params.data() + e.offset, rows, static_cast<int>(e.size / rows));
}

// y = x W^T with W: [out, in] (the PyTorch convention of MODEL.md).
inline HostMat linear(const HostMat& x, const HostMat& w) {
  HostMat y(x.rows, w.rows);
  for (int r = 0; r < x.rows; ++r)
    for (int o = 0; o < w.rows; ++o) {
      double s = 0.0;
      for (int i = 0; i < x.cols; ++i) s += x(r, i) * w(o, i);
      y(r, o) = s;
    }
  return y;
}

// y = g * x / sqrt(mean(x^2) + eps) per row.
inline HostMat rmsnorm_ref(const HostMat& x, const std::vector<double>& g, double eps) {
  HostMat y(x.rows, x.cols);
  for (int r = 0; r < x.rows; ++r) {
    double ss = 0.0;
    for (int c = 0; c < x.cols; ++c) ss += x(r, c) * x(r, c);
    const double inv = 1.0 / std::sqrt(ss / x.cols + eps);
    for (int c = 0; c < x.cols; ++c) y(r, c) = g[c] * x(r, c) * inv;
  }
  return y;
}

// max |got - want| <= tol * max(1, max |want|): one bad element fails, whatever the others.
inline void expect_close(const std::vector<double>& want, const std::vector<float>& got, double tol,
                         const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  double err = 0.0, scale = 1.0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(want[i]));
    if (std::fabs(got[i] - want[i]) > err) {
      err = std::fabs(got[i] - want[i]);
      worst = i;
    }
  }
  EXPECT_LE(err, tol * scale) << what << ": worst element " << worst << " is " << got[worst]
                              << ", want " << want[worst];
}

// sum(out * r) in double: the scalar objective whose gradient w.r.t. out is r.
inline double dot(const std::vector<float>& out, const std::vector<float>& r) {
  double s = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * r[i];
  return s;
}

// One element of a finite-difference check: its host copy (perturbed in place) and the analytic
// gradient there.
struct FdPoint {
  float* value;
  double analytic;
};

// Central differences of `objective` at `points` against their analytic gradients, with a bound
// measured on the objective itself rather than assumed (the objective sums in double, but the
// forward under it runs in fp32, and its rounding depends on the BLAS kernels of the machine).
//
// Every point is evaluated at +-s for s in {h/2, h, 2h, 4h} (steps as actually represented in
// fp32). For each pair of adjacent steps (s, 2s):
//   - the Richardson estimate g = (4 fd(s) - fd(2s)) / 3 cancels the s^2 truncation term;
//   - the forward's noise sigma is measured from the same evaluations: the second differences
//     C(s) = L(+s) - 2 L(0) + L(-s) satisfy C(2s) - 4 C(s) = rounding alone up to O(s^4), with
//     variance 70 sigma^2; the noise of g is then 0.95 sigma / s per point;
//   - the truncation left is bounded by fd(s)'s own, |fd(2s) - fd(s)| / 3.
// The pair with the smallest error estimate E (noise + truncation, L2 over the points) is used:
// |g - analytic| <= 5 E (a margin of 5 over the measured floor), and the check must be able to
// resolve the gradient: 5 E <= 0.1 |g| (a wrong term of 10% of the tensor's gradient fails),
// which also refuses a vanishing gradient. Leaves the values as they were.
inline void expect_fd_gradient(const std::string& what, const std::vector<FdPoint>& points,
                               const std::function<void()>& upload,
                               const std::function<double()>& objective, float h) {
  constexpr int kSteps = 4;
  const double scale[kSteps] = {0.5, 1.0, 2.0, 4.0};
  const std::size_t n = points.size();
  ASSERT_GT(n, 0u) << what;
  upload();
  const double l0 = objective();
  // fd[k][i], curv[k][i]: step k's central difference and second difference at point i.
  std::vector<std::vector<double>> fd(kSteps, std::vector<double>(n)), curv = fd;
  for (std::size_t i = 0; i < n; ++i) {
    float* v = points[i].value;
    const float saved = *v;
    for (int k = 0; k < kSteps; ++k) {
      const float plus = saved + static_cast<float>(scale[k] * h);
      const float minus = saved - static_cast<float>(scale[k] * h);
      *v = plus;
      upload();
      const double lp = objective();
      *v = minus;
      upload();
      const double lm = objective();
      fd[k][i] = (lp - lm) / (double(plus) - double(minus));
      curv[k][i] = lp - 2.0 * l0 + lm;
    }
    *v = saved;
  }
  upload();
  double best_err = -1.0, best_norm = 0.0, best_diff = 0.0, best_noise = 0.0, best_trunc = 0.0;
  double best_step = 0.0;
  for (int k = 0; k + 1 < kSteps; ++k) {
    double noise2 = 0.0, trunc2 = 0.0, diff2 = 0.0, norm2 = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      const double c = curv[k + 1][i] - 4.0 * curv[k][i];
      noise2 += c * c / 70.0;
      const double t = (fd[k + 1][i] - fd[k][i]) / 3.0;
      trunc2 += t * t;
      const double g = (4.0 * fd[k][i] - fd[k + 1][i]) / 3.0;
      norm2 += g * g;
      diff2 += (g - points[i].analytic) * (g - points[i].analytic);
    }
    const double sigma = std::sqrt(noise2 / n);
    const double noise = std::sqrt(double(n)) * 0.95 * sigma / (scale[k] * h);
    const double err = noise + std::sqrt(trunc2);
    if (best_err < 0.0 || err < best_err) {
      best_err = err;
      best_norm = std::sqrt(norm2);
      best_diff = std::sqrt(diff2);
      best_noise = noise;
      best_trunc = std::sqrt(trunc2);
      best_step = scale[k] * h;
    }
  }
  const double bound = 5.0 * best_err;
  const auto detail = [&] {
    return what + ": |fd - analytic| = " + std::to_string(best_diff) + ", |fd| = " +
           std::to_string(best_norm) + ", bound 5 x (noise " + std::to_string(best_noise) +
           " + truncation " + std::to_string(best_trunc) + ") at step " +
           std::to_string(best_step);
  };
  EXPECT_LE(bound, 0.1 * best_norm) << detail() << ": the differences cannot resolve this gradient";
  EXPECT_LE(best_diff, bound) << detail();
  if (const char* log = std::getenv("KMOE_FD_LOG")) {  // margins for docs/BUILDING.md
    if (FILE* f = std::fopen(log, "a")) {
      std::fprintf(f, "%s\t%.3e\t%.3e\t%.3e\t%.3e\n", what.c_str(), best_diff, bound, best_norm,
                   best_step);
      std::fclose(f);
    }
  }
}

// The same check at up to 16 elements spread over values[0, n) against grad[0, n).
inline void expect_fd_gradient(const std::string& what, float* values, const float* grad,
                               std::int64_t n, const std::function<void()>& upload,
                               const std::function<double()>& objective, float h = 1e-2f) {
  std::vector<FdPoint> points;
  const std::int64_t samples = std::min<std::int64_t>(n, 16);
  for (std::int64_t k = 0; k < samples; ++k) {
    const std::int64_t j = (k * n) / samples + (k * 7) % std::max<std::int64_t>(1, n / samples);
    points.push_back({values + j, grad[j]});
  }
  expect_fd_gradient(what, points, upload, objective, h);
}

// Runs `backward` on gradients pre-filled with random values and returns, on the host, what it
// added: parameter gradients must accumulate (+=), never overwrite.
inline std::vector<float> accumulated_grads(TensorTable& table, std::mt19937& gen,
                                            const std::function<void()>& backward) {
  const auto before = uniform(gen, table.total_elements(), -1.0f, 1.0f);
  to_device(before, table.grads.data());
  backward();
  auto added = to_host(table.grads.data(), table.total_elements());
  for (std::size_t i = 0; i < added.size(); ++i) added[i] -= before[i];
  return added;
}

// The finite-difference check for tensor `name` of the table (perturbing the table's
// parameters); grads: the analytic gradient of the whole table, on the host.
inline void expect_fd_param_gradient(const TensorTable& table, const std::string& name,
                                     const std::vector<float>& grads,
                                     const std::function<double()>& objective) {
  const int idx = table.find(name);
  ASSERT_GE(idx, 0) << name;
  const auto& e = table.entry(idx);
  auto params = to_host(table.params.data(), table.total_elements());
  expect_fd_gradient(
      name, params.data() + e.offset, grads.data() + e.offset, e.size,
      [&] { to_device(params, table.params.data()); }, objective);
}

}  // namespace op_test
}  // namespace kmoe
