// The memory check at the start of a real run (not in --dry-run, which plans for other
// machines): this rank's share of the model (modules/model/model_size.hpp rank_memory) summed
// over the ranks of its node, against the node's available host memory, and on GPU builds each
// rank's share against its device's free memory. Too much is an error naming the keys that
// drive the sizes, before anything large is allocated (train.check_memory = false skips it).
#pragma once

#include "core/config.hpp"
#include "modules/model/model_size.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

// What this rank of `grid` holds, with `in_flight` Stage instances.
RankShare rank_share(const Config& cfg, const ProcessGrid& grid, int in_flight);

// Collective over grid.world; throws the same SharedError on every rank when a node or device
// cannot hold its ranks' shares.
void check_memory(const Config& cfg, const ProcessGrid& grid, int in_flight);

}  // namespace kmoe
