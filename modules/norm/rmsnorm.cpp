#include "modules/norm/rmsnorm.hpp"

#include "core/bf16.hpp"
#include "core/column_sums.hpp"

namespace kmoe {

namespace {
// y = residual + g * x * rstd per row, where x is a or (with b) the sum a + b, which is also
// written to x_sum (the row's sum complete before it is read back).
void forward_rows(ConstMat a, ConstMat b, Mat x_sum, ConstVec g, float eps, ConstMat residual,
                  Mat y, Vec rstd, std::uint16_t* y16) {
  const int rows = a.extent(0), width = a.extent(1);
  const bool has_b = b.extent(0) > 0, has_residual = residual.extent(0) > 0,
             has_y = y.extent(0) > 0;
  Kokkos::parallel_for(
      "rmsnorm::forward", row_policy(rows), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        float ss = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, width),
            [&](int d, float& acc) {
              float x = a(r, d);
              if (has_b) {
                x += b(r, d);
                x_sum(r, d) = x;
              }
              acc += x * x;
            },
            ss);
        if (has_b) team.team_barrier();
        const float s = math::rsqrt(ss / width + eps);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int d) {
          const float x = has_b ? x_sum(r, d) : a(r, d);
          const float v = (has_residual ? residual(r, d) : 0.0f) + g(d) * x * s;
          if (has_y) y(r, d) = v;
          if (y16) y16[std::int64_t(r) * width + d] = bf16_bits(v);
        });
        Kokkos::single(Kokkos::PerTeam(team), [&]() { rstd(r) = s; });
      });
}

// dx = dx_base + the RMSNorm backward per row for the output gradient dy, or (with dy_b) the
// sum dy + dy_b, which is also written to dy_sum; then dg from that gradient.
void backward_rows(ConstMat x, ConstVec g, ConstVec rstd, ConstMat dy, ConstMat dy_b, Mat dy_sum,
                   ConstMat dx_base, Mat dx, Vec dg, std::uint16_t* dx16) {
  const int rows = x.extent(0), width = x.extent(1);
  const bool has_b = dy_b.extent(0) > 0, has_base = dx_base.extent(0) > 0;
  Kokkos::parallel_for(
      "rmsnorm::backward", row_policy(rows), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        const float s = rstd(r);
        float dot = 0.0f;  // sum_d g*dy*xhat
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, width),
            [&](int d, float& acc) {
              float e = dy(r, d);
              if (has_b) {
                e += dy_b(r, d);
                dy_sum(r, d) = e;
              }
              acc += g(d) * e * x(r, d) * s;
            },
            dot);
        if (has_b) team.team_barrier();
        const float mean_dot = dot / width;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int d) {
          const float e = has_b ? dy_sum(r, d) : dy(r, d);
          const float v = s * (g(d) * e - x(r, d) * s * mean_dot);
          const float out = (has_base ? dx_base(r, d) : 0.0f) + v;
          dx(r, d) = out;
          if (dx16) dx16[std::int64_t(r) * width + d] = bf16_bits(out);
        });
      });
  // (dy is not written above, dy_sum complete: the gradient the row kernel used.)
  const float* e = has_b ? dy_sum.data() : dy.data();
  rmsnorm_weight_grad(x.data(), width, e, width, rstd, rows, width, dg);
}
}  // namespace

void rmsnorm_forward(ConstMat x, ConstVec g, float eps, ConstMat residual, Mat y, Vec rstd,
                     std::uint16_t* y16) {
  forward_rows(x, ConstMat(), Mat(), g, eps, residual, y, rstd, y16);
}

void rmsnorm_forward_of_sum(ConstMat a, ConstMat b, ConstVec g, float eps, Mat x_sum, Mat y,
                            Vec rstd, std::uint16_t* y16) {
  forward_rows(a, b, x_sum, g, eps, ConstMat(), y, rstd, y16);
}

void rmsnorm_weight_grad(const float* x_data, int x_stride, const float* dy_data, int dy_stride,
                         ConstVec rstd, int rows, int width, Vec dg) {
  column_sums(
      "rmsnorm::weight_grad", rows, width,
      KOKKOS_LAMBDA(int r, int d) {
        return dy_data[static_cast<std::int64_t>(r) * dy_stride + d] *
               x_data[static_cast<std::int64_t>(r) * x_stride + d] * rstd(r);
      },
      dg);
}

void rmsnorm_backward(ConstMat x, ConstVec g, ConstVec rstd, ConstMat dy, ConstMat dx_base, Mat dx,
                      Vec dg, std::uint16_t* dx16) {
  backward_rows(x, g, rstd, dy, ConstMat(), Mat(), dx_base, dx, dg, dx16);
}

void rmsnorm_backward_of_sum(ConstMat x, ConstVec g, ConstVec rstd, ConstMat dy_a, ConstMat dy_b,
                             Mat dy_sum, Mat dx, Vec dg, std::uint16_t* dx16) {
  backward_rows(x, g, rstd, dy_a, dy_b, dy_sum, ConstMat(), dx, dg, dx16);
}

}  // namespace kmoe
