#include "parallel/layer_comms.hpp"

#include "parallel/process_grid.hpp"

namespace kmoe {

LayerComms layer_comms(const Config& cfg, const ProcessGrid& grid) {
  LayerComms c;
  c.ep = &grid.ep_axis;
  c.ep_data = &grid.data_plane(grid.ep_axis);
  if (cfg.parallel.engram_shard == EngramShardGroup::Ep) {
    c.engram = &grid.ep_axis;
    c.engram_data = &grid.data_plane(grid.ep_axis);
    c.engram_shard = Shard::Ep;
  } else if (cfg.parallel.engram_shard == EngramShardGroup::Stage) {
    c.engram = &grid.stage;
    c.engram_data = &grid.data_plane(grid.stage);
    c.engram_shard = Shard::Stage;
  }
  return c;
}

}  // namespace kmoe
