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
#include "core/run_context.hpp"
#include "core/step_stats.hpp"
#include "core/stop_signal.hpp"
#include "io/checkpoint.hpp"
#include "io/dump.hpp"
#include "io/metrics.hpp"
#include "io/run_lock.hpp"
#include "io/token_data.hpp"
#include "modules/model/model_size.hpp"
#include "modules/model/stage.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "parallel/process_grid.hpp"
#include "train/checkpointer.hpp"
#include "train/evaluate.hpp"
#include "train/grad_reducer.hpp"
#include "train/optimizer.hpp"
#include "train/pipeline_runner.hpp"

namespace kmoe {

class Trainer {
 public:
  // Builds data, model and optimizer state; resumes from a checkpoint per checkpoint.resume.
  // ctx: how the run computes (make_run_context from train.precision and the execution plan);
  // the trainer adds its activation pool.
  Trainer(const Config& cfg, ProcessGrid& grid, const RunContext& ctx);

  // Steps state().step + 1 .. max_steps; throws NonFiniteError on a non-finite loss or norm,
  // StopRequest (exit 85/86) after a checkpoint when SIGUSR1/SIGTERM arrived.
  void run();

  const TrainState& state() const { return state_; }
  const PhaseTotals& phases() const { return phases_; }

 private:
  // One optimizer step: micro-batches through the schedule, reductions, clipping, AdamW.
  StepMetrics train_step(int step);
  // Zero gradients, loss sums and statistics.
  void begin_step();
  // Micro-batches per step (all ranks), targets per micro-batch, and the loss weight of one
  // target in the step loss.
  int micro_batches() const;
  double targets_per_micro() const;
  float grad_scale() const;
  // The host ids of this rank's micro-batch `micro` of the step (loaded into its region), and
  // its first token's position in the global batch.
  const std::int32_t* micro_batch_tokens(int micro);
  std::int64_t first_token(int micro) const;
  // Its first sequence's index in the step's global batch.
  std::int64_t first_sequence(int micro) const;
  // After the last backward: the gradient reduction completed, the loss terms and the layers'
  // statistics summed over the world.
  StepMetrics reduce_step(int step);
  // The global gradient norm (every parameter once).
  double global_grad_norm() const;
  // The state after step `step`.
  void advance_state(int step);
  // Throughput, MFU and memory of a step that took m.step_time_s.
  void add_throughput(StepMetrics& m) const;
  // Writes the step dump of output.dump_step (collective).
  void write_dump(StepDump& d, const StepMetrics& m);
  void print_phases() const;
  // After a step, what every rank agrees on: a stop signal on any rank; a failed metrics
  // write on the root (its message), or a lost run lock (thrown at once).
  StopKind agreed_stop() const;
  std::string write_metrics(const StepMetrics& m, int step);  // the root's error, or ""
  std::string agreed_output_error(const std::string& mine, int step) const;
  // The checkpoint after `step`; a save that fails after a failed metrics write says both.
  void save_after_step(int step, const std::string& output_error);
  // Throws the StopRequest of a checkpointed stop (exit 85 or 86).
  [[noreturn]] void stop_after(int step, StopKind stop);
  // Copies the MoE routes of the micro-batch `stage` last ran forward (its first token at
  // `first_token` of the global batch) into a step dump.
  void record_routes(const Stage& stage, StepDump& d, std::int64_t first_token) const;
  // Token ids of stream positions [first, first + count) into host_tokens_ from sequence
  // `at` on.
  void load_positions(std::int64_t first, int count, int at = 0);

  const Config& cfg_;
  ProcessGrid& grid_;
  std::unique_ptr<RunLock> lock_;                  // this run's hold on checkpoint.dir
  ModelSize size_;
  TensorTable table_;
  StepStats stats_;  // the layers' step statistics (metrics.csv columns after val_loss)
  // The Stage instances' shared workspace; train.recompute = block: the blocks' saved buffers
  std::unique_ptr<ActivationPool> pool_;
  RunContext ctx_;  // the run's, with pool_
  // The stage once per micro-batch in flight under the pipeline schedule: micro-batch i runs
  // on instance i mod size(); all share the parameters in table_ and the statistics.
  std::vector<std::unique_ptr<Stage>> stages_;
  // The pipeline schedule's execution over the instances.
  std::unique_ptr<PipelineRunner> pipeline_;
  std::unique_ptr<GradReducer> reducer_;
  std::vector<char> owned_;  // per tensor: counted in the gradient norm here
  std::unique_ptr<FlatOptimizer> optimizer_;
  std::unique_ptr<TokenDataset> train_data_, val_data_;
  std::unique_ptr<InstanceStream> stream_;
  std::unique_ptr<MetricsWriter> metrics_;  // rank 0 only
  std::unique_ptr<Validator> validator_;     // with data.val_paths
  std::unique_ptr<Checkpointer> checkpointer_;
  // The step's token ids, one region per micro-batch (page-locked on GPU builds): each upload
  // runs asynchronously while the host fills the next region.
  Kokkos::View<std::int32_t*, Layout, PinnedSpace> host_tokens_;
  View1D loss_sums_{"trainer::loss_sums", 3};  // the step's CE, z and MoE sums, on the device
  TrainState state_;
  bool resumed_ = false;
  PhaseTotals phases_;
};

}  // namespace kmoe
