#include "train/memory_check.hpp"

#include <mpi.h>

#include <iomanip>
#include <sstream>
#include <string>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"
#include "core/memory.hpp"
#include "parallel/pipeline_schedule.hpp"

namespace kmoe {

namespace {
std::string gib(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << bytes / double(std::int64_t(1) << 30) << " GiB";
  return os.str();
}
}  // namespace

RankShare rank_share(const Config& cfg, int stage, int in_flight) {
  const ParallelCfg& p = cfg.parallel;
  const std::vector<int> bounds = stage_bounds(p, cfg.model.n_layers);
  RankShare r;
  r.first_block = bounds[stage];
  r.last_block = bounds[stage + 1];
  r.embed = stage == 0;
  r.head = stage == p.pp - 1;
  r.ep = p.ep;
  switch (p.engram_shard) {
    case EngramShardGroup::None:
      r.engram_members = 1;
      break;
    case EngramShardGroup::Ep:
      r.engram_members = p.ep;
      break;
    case EngramShardGroup::Stage:
      r.engram_members = p.dp * p.ep;
      break;
  }
  r.in_flight = in_flight;
  r.precision = cfg.train.precision;
  r.attention = cfg.train.attention;
  r.recompute = cfg.train.recompute == Recompute::Block;
  r.engram_offload = cfg.engram.host_tables();
  if (cfg.optimizer.shard == OptimizerShard::Replicas) {
    r.dense_replicas = p.dp * p.ep;
    r.expert_replicas = p.dp;
  }
  return r;
}

int micro_batches_per_replica(const Config& cfg) {
  const TrainCfg& t = cfg.train;
  return t.global_batch / t.micro_batch / (cfg.parallel.dp * cfg.parallel.ep);
}

RankMemory stage_memory(const Config& cfg, int stage, int* in_flight) {
  const ParallelCfg& p = cfg.parallel;
  const int n =
      max_in_flight(pipeline_schedule(p.schedule, p.pp, stage, micro_batches_per_replica(cfg)));
  if (in_flight) *in_flight = n;
  return rank_memory(cfg.model, cfg.moe, cfg.engram, cfg.train.micro_batch, cfg.train.seq_len,
                     rank_share(cfg, stage, n));
}

StepTraffic step_traffic(const Config& cfg, int stage) {
  const ParallelCfg& p = cfg.parallel;
  const TrainCfg& t = cfg.train;
  // What the stage's ranks hold (the memory estimate's RankShare) splits into the experts
  // (reduced over dp), sharded Engram rows (over dp when sharded over ep, not at all over the
  // stage) and the rest (replicated over the stage).
  const RankShare r = rank_share(cfg, stage, 1);
  const RankMemory mem = rank_memory(cfg.model, cfg.moe, cfg.engram, t.micro_batch, t.seq_len, r);
  const double experts = double(mem.expert_elements), sharded = double(mem.sharded_elements);
  double moe_layers = 0;
  for (int l = r.first_block; l < r.last_block; ++l) moe_layers += cfg.moe.is_moe_layer(l);
  const double dense = double(mem.elements) - experts - sharded;
  // Tables in host memory: summed over MPI like their device counterparts.
  const double host_replicated = r.engram_members > 1 ? 0.0 : double(mem.host_elements);
  const double host_sharded = r.engram_members > 1 ? double(mem.host_elements) : 0.0;
  auto ring = [](double bytes, int members) {
    return members > 1 ? bytes * 2.0 * (members - 1) / members : 0.0;
  };
  // A ring all-reduce moves as much as a reduce-scatter and an all-gather (optimizer.shard);
  // bf16 compute copies gather 2 bytes an element instead of 4.
  auto gather_saved = [](double copies, int members) {
    return members > 1 ? 2.0 * copies * (members - 1) / members : 0.0;
  };
  // (Without optimizer.shard the copies are rounded on each rank: nothing gathered.)
  const bool copies = cfg.optimizer.shard == OptimizerShard::Replicas && mem.copy_elements > 0;
  StepTraffic out;
  out.stage_grads = ring(4.0 * (dense + host_replicated), p.dp * p.ep) -
                    (copies ? gather_saved(double(mem.gemm_elements), p.dp * p.ep) : 0.0);
  const bool ep_rows = p.engram_shard == EngramShardGroup::Ep;
  out.dp_grads = ring(4.0 * (experts + (ep_rows ? sharded + host_sharded : 0.0)), p.dp) -
                 (copies ? gather_saved(experts, p.dp) : 0.0);
  const double micro = micro_batches_per_replica(cfg);
  const double tokens = double(t.micro_batch) * t.seq_len;
  out.to_device = micro * double(mem.offload_to_device);
  out.from_device = micro * double(mem.offload_from_device);
  if (p.ep > 1) {
    const int D = cfg.model.d_model;
    const double out_bytes = t.precision == Precision::Bf16 && D % 2 == 0 ? 2.0 : 4.0;
    const double rows = tokens * cfg.moe.top_k * (p.ep - 1) / p.ep;
    // Forward: rows out, outputs back; backward: output gradients out, input gradients back.
    out.all_to_all = micro * moe_layers * rows * D * (2.0 * out_bytes + 2.0 * 4.0);
  }
  const double boundary = 4.0 * tokens * cfg.model.d_model;
  out.pipeline = micro * boundary * ((stage + 1 < p.pp ? 1 : 0) + (stage > 0 ? 1 : 0));
  return out;
}

RankShare rank_share(const Config& cfg, const ProcessGrid& grid, int in_flight) {
  return rank_share(cfg, grid.pp_rank, in_flight);
}

void check_memory(const Config& cfg, const ProcessGrid& grid, int in_flight,
                  const RunContext& ctx) {
  if (!cfg.train.check_memory) return;
  RankShare share = rank_share(cfg, grid, in_flight);
  share.batch_threads = ctx.batch_threads;
  const RankMemory mine = rank_memory(cfg.model, cfg.moe, cfg.engram, cfg.train.micro_batch,
                                      cfg.train.seq_len, share);
  constexpr bool host_memory = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
  // The ranks of this node share its host memory.
  MPI_Comm node_comm;
  mpi_check(MPI_Comm_split_type(grid.world.comm(), MPI_COMM_TYPE_SHARED, grid.world.rank(),
                                MPI_INFO_NULL, &node_comm),
            "MPI_Comm_split_type");
  const Communicator node(node_comm, "node", cfg.parallel.watchdog_seconds);
  MPI_Comm_free(&node_comm);
  // Host memory: the tables kept there (engram.offload = host), and on CPU builds everything.
  double need[2] = {double(kCheckMarginBytes) + double(mine.host_bytes) +
                        (host_memory ? double(mine.total()) : 0.0),
                    1.0};
  node.allreduce_sum(need, 2);
  std::ostringstream error;
  const std::int64_t host = host_available_bytes();
  auto explain = [&](std::ostringstream& os) {
    os << "; this rank's share: " << mine.elements << " tensor elements (" << gib(mine.state_bytes)
       << " with gradients and AdamW moments) and " << gib(mine.activation_bytes)
       << " of activations for " << in_flight
       << " micro-batch(es) of train.micro_batch = " << cfg.train.micro_batch
       << " x train.seq_len = " << cfg.train.seq_len << " tokens in flight"
       << (mine.host_elements > 0 ? ", and " + gib(double(mine.host_bytes)) +
                                        " of host memory for the Engram tables "
                                        "(engram.offload = host)"
                                  : std::string())
       << ". The sizes follow "
       << size_keys()
       << ", and the grid's parallel.pp, parallel.ep and parallel.engram_shard split them: "
          "shrink them, add ranks or nodes, or skip this check with train.check_memory = false";
  };
  if (host >= 0 && need[0] > double(host)) {
    error << "memory: the " << static_cast<int>(need[1]) << " rank(s) on this node ("
          << "world rank " << grid.world.rank() << " among them) need about " << gib(need[0])
          << " of host memory, the node has " << gib(double(host)) << " available";
    explain(error);
  }
  const std::int64_t device = device_free_bytes();
  if (error.str().empty() && !host_memory && device >= 0 && mine.total() > device) {
    error << "memory: world rank " << grid.world.rank() << " needs about " << gib(mine.total())
          << " on its device, which has " << gib(double(device)) << " free";
    explain(error);
  }
  const std::string first = grid.world.first_message(error.str());
  if (!first.empty()) throw SharedError(first);
}

}  // namespace kmoe
