// One step's pipeline schedule executed (RUNTIME.md section 2): this rank's micro-batches
// forward and backward through its Stage instances in schedule order, activations to the next
// stage and gradients to the previous one over the grid's pipe data plane.
//
// The transfer-ordering rule that keeps pipelines from deadlocking lives here: an op's send is
// held until the start of the rank's next op and goes out with that op's receive as one
// operation, or alone when that op receives nothing. In 1F1B's steady state each rank then
// exchanges with a neighbour in one step (send forward + receive backward, and the reverse on
// the neighbour), so transfers that complete only when matched (NCCL on one stream) cannot wait
// on each other. An instance's outgoing send completes before the instance is reused.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/timer.hpp"
#include "modules/model/stage.hpp"
#include "parallel/communicator.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

// Seconds per phase on this rank over the run.
struct PhaseTotals {
  double data = 0, forward = 0, backward = 0;
  double pipeline = 0;  // waiting for activations / gradients from the neighbouring stages
  double reduce = 0;    // the step's reductions after the last backward
  double optimizer = 0, eval = 0, checkpoint = 0;
  double comm_wait = 0;  // every wait on communication inside training steps
};

// What the step's owner supplies to the schedule.
struct StepFeed {
  // The host ids of the rank's micro-batch `micro` (0..M-1), loaded before its forward (timed as
  // data); they stay valid through the step (the upload is asynchronous).
  std::function<const std::int32_t*(int micro)> tokens;
  // After micro-batch `micro`'s forward on `stage` (may be empty).
  std::function<void(const Stage& stage, int micro)> after_forward;
  // During the step's last backward: every tensor with table index >= k has its gradient.
  std::function<void(int k)> gradients_ready;
};

class PipelineRunner {
 public:
  // The schedule of the grid's pipeline stage over `micro` micro-batches of `seqs` sequences,
  // `activation_floats` floats at the stage boundary each.
  PipelineRunner(const ProcessGrid& grid, PipeSchedule kind, int micro, int seqs,
                 std::int64_t activation_floats);

  // Stage instances the schedule needs (one per micro-batch in flight): micro-batch i runs on
  // instance i mod instances().
  int instances() const { return max_in_flight(ops_); }

  // Runs every op of the schedule on `stages` (instances() of them), each forward with
  // `grad_scale` adding its loss sums to `loss_sums` (Stage::forward); returns when every
  // transfer of this rank is complete. Time goes to phases.data / pipeline / forward / backward.
  void run(const std::vector<std::unique_ptr<Stage>>& stages, TensorTable& table,
           float grad_scale, View1D loss_sums, const StepFeed& feed, PhaseTimer& timer,
           PhaseTotals& phases);

 private:
  // The held send goes out alone.
  void send_held();
  // Receives n floats into `into` from pipe rank `from`, with the held send if there is one.
  void receive(float* into, int from);

  const ProcessGrid& grid_;
  const DataComm& pipe_;
  std::vector<PipeOp> ops_;
  int seqs_;
  std::int64_t floats_;
  std::vector<Pending> sends_;  // per instance: its outgoing transfer
  struct Held {
    const float* data = nullptr;
    int peer = -1, instance = -1;
  } held_;
};

}  // namespace kmoe
