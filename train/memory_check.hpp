// The memory check at the start of a real run (not in --dry-run, which plans for other
// machines): this rank's share of the model (modules/model/model_size.hpp rank_memory) summed
// over the ranks of its node, against the node's available host memory, and on GPU builds each
// rank's share against its device's free memory. Too much is an error naming the keys that
// drive the sizes, before anything large is allocated (train.check_memory = false skips it).
#pragma once

#include "core/config.hpp"
#include "core/run_context.hpp"
#include "modules/model/model_size.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

// Per rank, beyond its tensors and activations, in the estimates: MPI, Kokkos, BLAS and the
// program itself (a 1-block d_model 32 model's memory high-water is 31 MiB on 1 and on 2
// ranks here).
constexpr std::int64_t kRuntimeBytes = std::int64_t(32) << 20;
// What the memory check before a run adds per rank to the estimate: the runtime and a margin
// for what the estimate leaves out (allocator slack, libraries' buffers, device contexts).
constexpr std::int64_t kCheckMarginBytes = std::int64_t(256) << 20;

// What a rank of pipeline stage `stage` of the deck's grid holds, with `in_flight` Stage
// instances (every ep and dp rank of a stage alike; an Engram table's row blocks differ by at
// most one row, the first the largest, which this counts). Needs no ranks: the dry run plans
// any grid on one process.
RankShare rank_share(const Config& cfg, int stage, int in_flight);
// The same for this rank of `grid`.
RankShare rank_share(const Config& cfg, const ProcessGrid& grid, int in_flight);

// Micro-batches per replica and step (train.global_batch / (micro_batch * dp * ep)).
int micro_batches_per_replica(const Config& cfg);
// What a rank of pipeline stage `stage` holds with the schedule's in-flight micro-batches
// (their count in *in_flight when given).
RankMemory stage_memory(const Config& cfg, int stage, int* in_flight = nullptr);

// Bytes a rank of pipeline stage `stage` sends per optimizer step, per axis (RUNTIME.md
// section 1), for the dry run's plan: ring all-reduces (2 (R-1)/R of the buffer), the
// all-to-all at a balanced load without drops ((ep-1)/ep of the kept rows leave, in the run's
// precision: bf16 rows and output gradients in bf16 runs), the pipeline's activations and their
// gradients. Not counted: the sharded Engram tables' row fetches, the tied embedding's
// all-reduce between the first and last stage, metrics.
struct StepTraffic {
  double stage_grads = 0;   // dense gradients over the stage's dp*ep replicas
  double dp_grads = 0;      // what is sharded over ep (experts; Engram rows with
                            // parallel.engram_shard = ep) over its dp replicas
  double all_to_all = 0;    // expert rows out and back, forward and backward
  double pipeline = 0;      // activations to the next stage, gradients to the previous one
  double total() const { return stage_grads + dp_grads + all_to_all + pipeline; }
  // engram.offload = host, within the rank (not in total()): rows staged to the device, row
  // gradients back, at most (every lookup a distinct row).
  double to_device = 0, from_device = 0;
};
StepTraffic step_traffic(const Config& cfg, int stage);

// Collective over grid.world; throws the same SharedError on every rank when a node or device
// cannot hold its ranks' shares.
// ctx: the run's (its host threads size the experts' side-by-side scratch).
void check_memory(const Config& cfg, const ProcessGrid& grid, int in_flight,
                  const RunContext& ctx);

}  // namespace kmoe
