// RMSNorm over the last dim of row-major [rows, width] activations:
//   y = residual + g * x * rstd,   rstd = 1 / sqrt(mean(x^2) + eps)
// (residual optional; fusing it saves a pass in the reordered block). Backward gives
//   dx = dx_base + rstd * (g*dy - xhat * mean(g*dy*xhat)),  dg += sum_rows dy * xhat.
#pragma once

#include <cstdint>

#include "core/kokkos_types.hpp"

namespace kmoe {

// x, y: (rows, width); residual: (rows, width) or empty; rstd: (rows) saved for backward.
// y16 (bf16 runs): where y is also written rounded to bf16 (rows x width), for products; with
// y16, y may be empty (the bf16 copy alone).
void rmsnorm_forward(ConstMat x, ConstVec g, float eps, ConstMat residual, Mat y, Vec rstd,
                     std::uint16_t* y16 = nullptr);

// The norm of a sum in one pass: x = a + b is written (x_sum, kept by the caller), then y and
// rstd as rmsnorm_forward's of that x (no residual). The same numbers as add() followed by
// rmsnorm_forward, one kernel fewer.
void rmsnorm_forward_of_sum(ConstMat a, ConstMat b, ConstVec g, float eps, Mat x_sum, Mat y,
                            Vec rstd, std::uint16_t* y16 = nullptr);

// dy: (rows, width) -> dx = dx_base + dL/dx (dx_base may be empty; dx may alias dx_base);
// dg accumulates. dx must not alias dy. dx16 (bf16 runs): where dx is also written rounded to
// bf16 (rows x width, contiguous), for products that read it.
void rmsnorm_backward(ConstMat x, ConstVec g, ConstVec rstd, ConstMat dy, ConstMat dx_base, Mat dx,
                      Vec dg, std::uint16_t* dx16 = nullptr);

// The backward of a norm whose output gradient is a sum, in one pass: dy = dy_a + dy_b is also
// written (dy_sum, for the caller's later use), then dx and dg as rmsnorm_backward's with that
// dy (no dx_base). The same numbers as add() followed by rmsnorm_backward, one kernel fewer.
void rmsnorm_backward_of_sum(ConstMat x, ConstVec g, ConstVec rstd, ConstMat dy_a, ConstMat dy_b,
                             Mat dy_sum, Mat dx, Vec dg, std::uint16_t* dx16 = nullptr);

// dg[d] += sum_r dy[r,d] * x[r,d] * rstd[r], reduced per column in row order (deterministic).
// x and dy may be row-strided windows: row r of x starts at x_data + r * x_stride.
void rmsnorm_weight_grad(const float* x_data, int x_stride, const float* dy_data, int dy_stride,
                         ConstVec rstd, int rows, int width, Vec dg);

}  // namespace kmoe
