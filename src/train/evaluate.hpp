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

}  // namespace kmoe
