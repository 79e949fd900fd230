#include "modules/norm/rmsnorm.hpp"

#include "core/bf16.hpp"
#include "core/column_sums.hpp"

namespace kmoe {

void rmsnorm_forward(ConstMat x, ConstVec g, float eps, ConstMat residual, Mat y, Vec rstd,
                     std::uint16_t* y16) {
  const int rows = x.extent(0), width = x.extent(1);
  const bool has_residual = residual.extent(0) > 0, has_y = y.extent(0) > 0;
  Kokkos::parallel_for(
      "rmsnorm::forward", row_policy(rows), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        float ss = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, width),
            [&](int d, float& acc) { acc += x(r, d) * x(r, d); }, ss);
        const float s = math::rsqrt(ss / width + eps);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int d) {
          const float v = (has_residual ? residual(r, d) : 0.0f) + g(d) * x(r, d) * s;
          if (has_y) y(r, d) = v;
          if (y16) y16[std::int64_t(r) * width + d] = bf16_bits(v);
        });
        Kokkos::single(Kokkos::PerTeam(team), [&]() { rstd(r) = s; });
      });
}

void rmsnorm_forward_of_sum(ConstMat a, ConstMat b, ConstVec g, float eps, Mat x_sum, Mat y,
                            Vec rstd, std::uint16_t* y16) {
  const int rows = a.extent(0), width = a.extent(1);
  Kokkos::parallel_for(
      "rmsnorm::forward_of_sum", row_policy(rows), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        float ss = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, width),
            [&](int d, float& acc) {
              const float x = a(r, d) + b(r, d);
              x_sum(r, d) = x;
              acc += x * x;
            },
            ss);
        team.team_barrier();  // x_sum's row written before any thread reads it
        const float s = math::rsqrt(ss / width + eps);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int d) {
          const float v = 0.0f + g(d) * x_sum(r, d) * s;  // rmsnorm_forward's sum, no residual
          y(r, d) = v;
          if (y16) y16[std::int64_t(r) * width + d] = bf16_bits(v);
        });
        Kokkos::single(Kokkos::PerTeam(team), [&]() { rstd(r) = s; });
      });
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
  const int rows = x.extent(0), width = x.extent(1);
  const bool has_base = dx_base.extent(0) > 0;
  rmsnorm_weight_grad(x.data(), width, dy.data(), width, rstd, rows, width, dg);
  Kokkos::parallel_for(
      "rmsnorm::backward", row_policy(rows), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        const float s = rstd(r);
        float dot = 0.0f;  // sum_d g*dy*xhat
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, width),
            [&](int d, float& acc) { acc += g(d) * dy(r, d) * x(r, d) * s; }, dot);
        const float mean_dot = dot / width;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int d) {
          const float v = s * (g(d) * dy(r, d) - x(r, d) * s * mean_dot);
          const float out = (has_base ? dx_base(r, d) : 0.0f) + v;
          dx(r, d) = out;
          if (dx16) dx16[std::int64_t(r) * width + d] = bf16_bits(out);
        });
      });
}

void rmsnorm_backward_of_sum(ConstMat x, ConstVec g, ConstVec rstd, ConstMat dy_a, ConstMat dy_b,
                             Mat dy_sum, Mat dx, Vec dg, std::uint16_t* dx16) {
  const int rows = x.extent(0), width = x.extent(1);
  Kokkos::parallel_for(
      "rmsnorm::backward_of_sum", row_policy(rows), KOKKOS_LAMBDA(const TeamMember& team) {
        const int r = team.league_rank();
        const float s = rstd(r);
        float dot = 0.0f;  // sum_d g*dy*xhat
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, width),
            [&](int d, float& acc) {
              const float dy = dy_a(r, d) + dy_b(r, d);
              dy_sum(r, d) = dy;
              acc += g(d) * dy * x(r, d) * s;
            },
            dot);
        team.team_barrier();  // dy_sum's row written before any thread reads it
        const float mean_dot = dot / width;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width), [&](int d) {
          const float v = s * (g(d) * dy_sum(r, d) - x(r, d) * s * mean_dot);
          dx(r, d) = v;
          if (dx16) dx16[std::int64_t(r) * width + d] = bf16_bits(v);
        });
      });
  rmsnorm_weight_grad(x.data(), width, dy_sum.data(), width, rstd, rows, width, dg);
}

}  // namespace kmoe
