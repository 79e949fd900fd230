#include "train/optimizer.hpp"

#include <cmath>

namespace kmoe {

double learning_rate(const OptimizerCfg& o, int max_steps, int s) {
  const double lr = o.lr, lr_min = o.lr * o.final_lr_ratio;
  const int W = o.warmup_steps;
  if (s <= W) return lr * s / W;
  if (o.schedule == LrSchedule::Constant) return lr;
  if (o.schedule == LrSchedule::Wsd) {
    if (s > max_steps - o.decay_steps)
      return lr_min + (lr - lr_min) * double(max_steps - s) / o.decay_steps;
    return lr;
  }
  const double pi = 3.14159265358979323846;
  return lr_min + (lr - lr_min) * 0.5 * (1.0 + std::cos(pi * (s - W) / double(max_steps - W)));
}

double grad_sq_sum(const TensorTable& table, const std::vector<char>* counted) {
  auto g = table.grads;
  if (!counted) {
    double sum = 0.0;
    Kokkos::parallel_reduce(
        "optim::grad_sq_sum", Range(0, table.total_elements()),
        KOKKOS_LAMBDA(std::int64_t i, double& acc) { acc += double(g(i)) * g(i); }, sum);
    return sum;
  }
  double total = 0.0;
  for (int t = 0; t < table.size(); ++t) {
    if (!(*counted)[t]) continue;
    const TensorEntry& e = table.entry(t);
    double sum = 0.0;
    Kokkos::parallel_reduce(
        "optim::grad_sq_sum", Range(e.offset, e.offset + e.size),
        KOKKOS_LAMBDA(std::int64_t i, double& acc) { acc += double(g(i)) * g(i); }, sum);
    total += sum;
  }
  return total;
}

void adamw_step(const OptimizerCfg& o, TensorTable& table, int t, double lr, double clip_scale) {
  const float b1 = o.beta1, b2 = o.beta2, eps = o.eps;
  const float bc1 = 1.0 - std::pow(o.beta1, t), bc2 = 1.0 - std::pow(o.beta2, t);
  const float gs = clip_scale;
  auto p = table.params, g = table.grads, m = table.exp_avg, v = table.exp_avg_sq;
  for (const auto& e : table.entries()) {
    if (!e.spec.trainable) continue;
    const float lr_g = lr * e.spec.lr_mult;
    const float wd = e.spec.weight_decay ? o.weight_decay : 0.0;
    Kokkos::parallel_for(
        "optim::adamw", Range(e.offset, e.offset + e.size), KOKKOS_LAMBDA(std::int64_t i) {
          const float gi = gs * g(i);
          m(i) = b1 * m(i) + (1.0f - b1) * gi;
          v(i) = b2 * v(i) + (1.0f - b2) * gi * gi;
          const float mh = m(i) / bc1, vh = v(i) / bc2;
          p(i) -= lr_g * (wd * p(i) + mh / (math::sqrt(vh) + eps));
        });
  }
}

}  // namespace kmoe
