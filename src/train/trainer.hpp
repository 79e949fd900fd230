// The training loop (docs/ARCHITECTURE.md "One step"): this rank's micro-batches forward and
// backward through its pipeline stage in schedule order (1F1B or GPipe; activations to the
// next stage, gradients to the previous), bucketed gradient reduction over the grid, the
// layers' statistics summed over the world, global-norm clipping over every parameter once,
// AdamW, the learning-rate schedule, metrics, evaluation, dumps and checkpoints.
#pragma once

#include <memory>
#include <vector>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "core/step_stats.hpp"
#include "io/checkpoint.hpp"
#include "io/dump.hpp"
#include "io/metrics.hpp"
#include "io/run_lock.hpp"
#include "io/token_data.hpp"
#include "modules/model/model_size.hpp"
#include "modules/model/stage.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "parallel/process_grid.hpp"
#include "train/evaluate.hpp"
#include "train/grad_reducer.hpp"
#include "train/optimizer.hpp"

namespace kmoe {

// Seconds per phase on this rank over the run.
struct PhaseTotals {
  double data = 0, forward = 0, backward = 0;
  double pipeline = 0;  // waiting for activations / gradients from the neighbouring stages
  double reduce = 0;    // the step's reductions after the last backward
  double optimizer = 0, eval = 0, checkpoint = 0;
  double comm_wait = 0;  // every wait on communication inside training steps
};

class Trainer {
 public:
  // Builds data, model and optimizer state; resumes from a checkpoint per checkpoint.resume.
  Trainer(const Config& cfg, ProcessGrid& grid);

  // Steps state().step + 1 .. max_steps; throws NonFiniteError on a non-finite loss or norm,
  // StopRequest (exit 85/86) after a checkpoint when SIGUSR1/SIGTERM arrived.
  void run();

  const TrainState& state() const { return state_; }
  const PhaseTotals& phases() const { return phases_; }

 private:
  StepMetrics train_step(int step);
  // Throughput, MFU and memory of a step that took m.step_time_s.
  void add_throughput(StepMetrics& m) const;
  // Writes the step dump of output.dump_step (collective).
  void write_dump(StepDump& d, const StepMetrics& m);
  void print_phases() const;
  // Writes the current state's checkpoint and prints its size and time (rank 0).
  void save();
  // Copies the MoE routes of the micro-batch `stage` last ran forward (its first token at
  // `first_token` of the global batch) into a step dump.
  void record_routes(const Stage& stage, StepDump& d, std::int64_t first_token) const;
  // Token ids of stream positions [first, first + count) into host_tokens_ from sequence
  // `at` on.
  void load_positions(std::int64_t first, int count, int at = 0);

  const Config& cfg_;
  ProcessGrid& grid_;
  std::unique_ptr<RunLock> lock_;                  // this run's hold on checkpoint.dir
  std::unique_ptr<GemmPrecisionScope> precision_;  // train.precision while this run lives
  ModelSize size_;
  TensorTable table_;
  StepStats stats_;  // the layers' step statistics (metrics.csv columns after val_loss)
  // The Stage instances' shared workspace; train.recompute = block: the blocks' saved buffers
  std::unique_ptr<ActivationPool> pool_;
  // The stage once per micro-batch in flight under the pipeline schedule: micro-batch i runs
  // on instance i mod size(); all share the parameters in table_ and the statistics.
  std::vector<std::unique_ptr<Stage>> stages_;
  std::vector<PipeOp> schedule_;
  std::unique_ptr<GradReducer> reducer_;
  std::vector<char> owned_;  // per tensor: counted in the gradient norm here
  std::unique_ptr<FlatOptimizer> optimizer_;
  std::unique_ptr<TokenDataset> train_data_, val_data_;
  std::unique_ptr<InstanceStream> stream_;
  std::unique_ptr<MetricsWriter> metrics_;  // rank 0 only
  // The step's token ids, one region per micro-batch (page-locked on GPU builds): each upload
  // runs asynchronously while the host fills the next region.
  Kokkos::View<std::int32_t*, Layout, PinnedSpace> host_tokens_;
  View1D loss_sums_{"trainer::loss_sums", 3};  // the step's CE, z and MoE sums, on the device
  TrainState state_;
  bool resumed_ = false;
  PhaseTotals phases_;
};

}  // namespace kmoe
