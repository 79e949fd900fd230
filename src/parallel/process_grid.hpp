// The 3D process grid of RUNTIME.md section 1: world = pp * dp * ep ranks, ep fastest:
// rank = (pp_rank * dp + dp_rank) * ep + ep_rank. The dp*ep ranks of one pipeline stage are the
// stage's data replicas (R = dp * ep); dense gradients are summed over them.
#pragma once

#include "io/config.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

class ProcessGrid {
 public:
  // Throws kmoe::Error (before any allocation) if the world size is not pp*dp*ep, or for a
  // layout this build cannot run yet.
  ProcessGrid(const ParallelCfg& cfg, MPI_Comm world);

  int pp, dp, ep;
  int pp_rank, dp_rank, ep_rank;

  int replicas() const { return dp * ep; }
  int replica() const { return dp_rank * ep + ep_rank; }
  bool is_root() const { return world.rank() == 0; }

  Communicator world;
  Communicator stage;  // the dp*ep ranks of this rank's pipeline stage
};

}  // namespace kmoe
