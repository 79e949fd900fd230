// Validation loss (RUNTIME.md section 3): mean CE over the T-1 targets of at most
// `max_instances` validation instances in file order, summed per instance in instance order,
// so kmoe-eval on a checkpoint reproduces the trainer's value bit for bit on the same layout.
#pragma once

#include <cstdint>
#include <vector>

#include "io/token_data.hpp"
#include "modules/model/stage.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

struct EvalResult {
  double loss = 0.0;        // mean CE per target
  std::int64_t tokens = 0;  // instances * (T-1)
};

// Collective over the grid. Batches of micro_batch instances, batch c on replica c mod R,
// forward through the pipeline; the last stage's loss, summed over the world.
EvalResult evaluate(Stage& stage, const TensorTable& table, const TokenDataset& val,
                    const ProcessGrid& grid, int micro_batch, std::int64_t max_instances,
                    bool engram_sharded = false);

// The training loop's validation: its own timing (every train.eval_every steps and after the
// last one) and its data (at most train.eval_instances of data.val_paths).
class Validator {
 public:
  Validator(const Config& cfg, const TokenDataset& val) : cfg_(cfg), val_(val) {}
  bool should_validate(int step) const {
    const TrainCfg& t = cfg_.train;
    return (t.eval_every > 0 && step % t.eval_every == 0) || step == t.max_steps;
  }
  // The validation loss of the parameters in `table` (collective over the grid).
  double validate(Stage& stage, const TensorTable& table, const ProcessGrid& grid) const {
    return evaluate(stage, table, val_, grid, cfg_.train.micro_batch, cfg_.train.eval_instances,
                    cfg_.parallel.engram_shard != EngramShardGroup::None)
        .loss;
  }

 private:
  const Config& cfg_;
  const TokenDataset& val_;
};

}  // namespace kmoe
