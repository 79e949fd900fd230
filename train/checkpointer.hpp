// When and how the training loop checkpoints (RUNTIME.md section 4): its own timing
// (checkpoint.every, checkpoint.at_end, checkpoint.save_initial, a stop), the collective save,
// and the size and time line on the root rank.
#pragma once

#include "core/config.hpp"
#include "core/tensor_table.hpp"
#include "io/checkpoint.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

class Checkpointer {
 public:
  Checkpointer(const Config& cfg, const ProcessGrid& grid) : cfg_(cfg), grid_(grid) {}

  // The state a run starts from (step 0, or the resumed step) is saved first.
  bool should_save_initial() const { return cfg_.checkpoint.save_initial; }
  // After step `step`: every checkpoint.every steps, after the last step (checkpoint.at_end),
  // and before a stop.
  bool should_save(int step, bool stopping) const;
  // Writes `state`'s checkpoint (collective) and prints its size and time (root).
  void save(const TensorTable& table, const TrainState& state) const;

 private:
  const Config& cfg_;
  const ProcessGrid& grid_;
};

}  // namespace kmoe
