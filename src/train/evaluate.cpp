#include "train/evaluate.hpp"

#include <algorithm>

namespace kmoe {

EvalResult evaluate(Stage& stage, const TensorTable& table, const TokenDataset& val,
                    const ProcessGrid& grid, int b, std::int64_t max_instances) {
  const int T = val.seq_len();
  std::int64_t n = val.num_instances();
  if (max_instances > 0) n = std::min(n, max_instances);
  // Per-instance sums combine exactly (every other replica contributes 0.0) and are added in
  // instance order.
  std::vector<double> per_instance(n, 0.0);
  std::vector<std::int32_t> tokens(std::size_t(b) * T);
  const std::int64_t n_batches = (n + b - 1) / b;
  for (std::int64_t c = grid.replica(); c < n_batches; c += grid.replicas()) {
    const std::int64_t first = c * b, count = std::min<std::int64_t>(b, n - first);
    for (std::int64_t i = 0; i < count; ++i) val.read_instance(first + i, tokens.data() + i * T);
    const LossSums s = stage.forward(table, tokens.data(), count, 0.0f);
    for (std::int64_t i = 0; i < count; ++i) per_instance[first + i] = s.seq_ce[i];
  }
  grid.stage.allreduce_sum(per_instance.data(), n);
  double sum = 0.0;
  for (double v : per_instance) sum += v;
  EvalResult r;
  r.tokens = n * (T - 1);
  r.loss = sum / r.tokens;
  return r;
}

}  // namespace kmoe
