#include "train/memory_check.hpp"

#include <mpi.h>

#include <iomanip>
#include <sstream>
#include <string>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"
#include "core/memory.hpp"

namespace kmoe {

namespace {
// Per rank, beyond its tensors and activations: MPI, Kokkos, BLAS and the program itself.
constexpr std::int64_t kRuntimeBytes = std::int64_t(256) << 20;

std::string gib(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << bytes / double(std::int64_t(1) << 30) << " GiB";
  return os.str();
}
}  // namespace

RankShare rank_share(const Config& cfg, const ProcessGrid& grid, int in_flight) {
  RankShare r;
  r.first_block = grid.first_block(grid.pp_rank);
  r.last_block = grid.first_block(grid.pp_rank + 1);
  r.embed = grid.first_stage();
  r.head = grid.last_stage();
  r.ep = grid.ep;
  switch (cfg.parallel.engram_shard) {
    case EngramShardGroup::None:
      r.engram_members = 1;
      break;
    case EngramShardGroup::Ep:
      r.engram_members = grid.ep;
      break;
    case EngramShardGroup::Stage:
      r.engram_members = grid.replicas();
      break;
  }
  r.in_flight = in_flight;
  r.precision = cfg.train.precision;
  return r;
}

void check_memory(const Config& cfg, const ProcessGrid& grid, int in_flight) {
  if (!cfg.train.check_memory) return;
  const RankMemory mine = rank_memory(cfg.model, cfg.moe, cfg.engram, cfg.train.micro_batch,
                                      cfg.train.seq_len, rank_share(cfg, grid, in_flight));
  constexpr bool host_memory = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
  // The ranks of this node share its host memory.
  MPI_Comm node_comm;
  mpi_check(MPI_Comm_split_type(grid.world.comm(), MPI_COMM_TYPE_SHARED, grid.world.rank(),
                                MPI_INFO_NULL, &node_comm),
            "MPI_Comm_split_type");
  const Communicator node(node_comm, "node", cfg.parallel.watchdog_seconds);
  MPI_Comm_free(&node_comm);
  double need[2] = {double(kRuntimeBytes) + (host_memory ? double(mine.total()) : 0.0), 1.0};
  node.allreduce_sum(need, 2);
  std::ostringstream error;
  const std::int64_t host = host_available_bytes();
  auto explain = [&](std::ostringstream& os) {
    os << "; this rank's share: " << mine.elements << " tensor elements (" << gib(mine.state_bytes)
       << " with gradients and AdamW moments) and " << gib(mine.activation_bytes)
       << " of activations for " << in_flight
       << " micro-batch(es) of train.micro_batch = " << cfg.train.micro_batch
       << " x train.seq_len = " << cfg.train.seq_len << " tokens in flight. The sizes follow "
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
