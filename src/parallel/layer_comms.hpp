// What the layers of a pipeline stage need from the process grid: the expert-parallel group for
// the MoE all-to-all, and the group over which Engram tables are row-sharded. Null pointers (or
// groups of one rank) mean everything is local.
#pragma once

#include "core/config.hpp"
#include "core/tensor_table.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

class ProcessGrid;

struct LayerComms {
  const Communicator* ep = nullptr;       // ep rank r holds experts [r*E/ep, (r+1)*E/ep)
  const DataComm* ep_data = nullptr;      // its data plane (expert rows); ep itself when null
  const Communicator* engram = nullptr;   // holders of the Engram row blocks
  const DataComm* engram_data = nullptr;  // its data plane
  Shard engram_shard = Shard::None;       // None | Ep | Stage (parallel.engram_shard)
};

// The groups of this rank: the ep axis for MoE, the Engram shard group of
// parallel.engram_shard.
LayerComms layer_comms(const Config& cfg, const ProcessGrid& grid);

}  // namespace kmoe
