// The training loop (DESIGN.md "one step"): micro-batches of this rank's data replica forward
// and backward with gradient accumulation, gradient reduction over the stage's replicas,
// global-norm clipping, AdamW, the schedule, metrics and evaluation.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "core/error.hpp"
#include "io/config.hpp"
#include "io/metrics.hpp"
#include "io/token_data.hpp"
#include "modules/model/model_size.hpp"
#include "modules/model/stage.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

// A non-finite loss or gradient norm: the run stops (exit code 3) without a checkpoint.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

struct PhaseTotals {
  double data = 0, forward = 0, backward = 0, comm = 0, optimizer = 0, eval = 0;
};

struct EvalResult {
  double loss = 0.0;          // mean CE per target over the instances
  std::int64_t tokens = 0;    // instances * (T-1)
};

class Trainer {
 public:
  Trainer(const Config& cfg, ProcessGrid& grid);

  // Steps first_step..max_steps; throws NonFiniteError on a non-finite loss or norm.
  void run();
  // Validation CE over at most train.eval_instances instances of data.val_paths, file order.
  EvalResult evaluate();

  const std::vector<StepMetrics>& history() const { return history_; }
  const PhaseTotals& phases() const { return phases_; }
  TensorTable& table() { return table_; }

 private:
  StepMetrics train_step(int step);
  void load_sequences(const TokenDataset& data, const std::vector<std::int64_t>& instances);

  const Config& cfg_;
  ProcessGrid& grid_;
  ModelSize size_;
  TensorTable table_;
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<TokenDataset> train_data_, val_data_;
  std::unique_ptr<InstanceStream> stream_;
  std::unique_ptr<MetricsWriter> metrics_;  // rank 0 only
  std::vector<std::int32_t> host_tokens_;   // (micro_batch * T)
  std::int64_t next_position_ = 0;
  int first_step_ = 1;
  std::vector<StepMetrics> history_;
  PhaseTotals phases_;
};

}  // namespace kmoe
