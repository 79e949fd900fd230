// What the layers of a pipeline stage need from the process grid: the expert-parallel group for
// the MoE all-to-all, and the group over which Engram tables are row-sharded. Null pointers (or
// groups of one rank) mean everything is local.
#pragma once

#include "parallel/communicator.hpp"
#include "train/tensor_table.hpp"

namespace kmoe {

struct LayerComms {
  const Communicator* ep = nullptr;      // ep rank r holds experts [r*E/ep, (r+1)*E/ep)
  const DataComm* ep_data = nullptr;     // its data plane (expert rows); ep itself when null
  const Communicator* engram = nullptr;  // holders of the Engram row blocks
  const DataComm* engram_data = nullptr; // its data plane
  Shard engram_shard = Shard::None;      // None | Ep | Stage (parallel.engram_shard)
};

}  // namespace kmoe
