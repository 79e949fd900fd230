#include "train/evaluate.hpp"

#include <algorithm>

namespace kmoe {

EvalResult evaluate(Stage& stage, const TensorTable& table, const TokenDataset& val,
                    const ProcessGrid& grid, int b, std::int64_t max_instances,
                    bool engram_sharded) {
  const int T = val.seq_len();
  const std::int64_t D = stage.d_model();
  std::int64_t n = val.num_instances();
  if (max_instances > 0) n = std::min(n, max_instances);
  // Per-instance sums combine exactly (every other rank contributes 0.0) and are added in
  // instance order.
  std::vector<double> per_instance(n, 0.0);
  std::vector<std::int32_t> tokens(std::size_t(b) * T);
  const std::int64_t n_batches = (n + b - 1) / b, R = grid.replicas();
  // With expert parallelism or sharded Engram tables every replica of a stage takes part in
  // each round's all-to-alls: a replica without a batch in a round runs instance 0 and
  // discards the result.
  const bool lockstep = grid.ep > 1 || (grid.replicas() > 1 && engram_sharded);
  const DataComm& pipe = grid.data_plane(grid.pipe);
  for (std::int64_t round = 0; round * R < n_batches; ++round) {
    const std::int64_t c = round * R + grid.replica();
    const bool real = c < n_batches;
    if (!real && !lockstep) break;
    const std::int64_t first = real ? c * b : 0;
    const std::int64_t count = real ? std::min<std::int64_t>(b, n - first) : 1;
    for (std::int64_t i = 0; i < count; ++i) val.read_instance(first + i, tokens.data() + i * T);
    const std::int64_t acts = count * T * D;
    if (!grid.first_stage()) pipe.recv(stage.input_buffer(), acts, grid.pp_rank - 1);
    const LossSums s = stage.forward(table, tokens.data(), count, 0.0f);
    if (!grid.last_stage()) {
      Pending p = pipe.start_send(stage.output(), acts, grid.pp_rank + 1);
      pipe.complete(p);
    } else if (real) {
      for (std::int64_t i = 0; i < count; ++i) per_instance[first + i] = s.seq_ce[i];
    }
  }
  grid.world.allreduce_sum(per_instance.data(), n);
  double sum = 0.0;
  for (double v : per_instance) sum += v;
  EvalResult r;
  r.tokens = n * (T - 1);
  r.loss = sum / r.tokens;
  return r;
}

}  // namespace kmoe
