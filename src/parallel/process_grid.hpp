// The 3D process grid of RUNTIME.md section 1: world = pp * dp * ep ranks, ep fastest:
// rank = (pp_rank * dp + dp_rank) * ep + ep_rank. The dp*ep ranks of one pipeline stage are the
// stage's data replicas (R = dp * ep); dense gradients are summed over them, expert gradients
// over the dp ranks that hold the same experts. One duplicated communicator per axis and
// purpose, each under the watchdog (parallel.watchdog_seconds).
#pragma once

#include <memory>
#include <vector>

#include "core/config.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

// Blocks [b[s], b[s + 1]) form stage s of a parallel.pp-stage pipeline: parallel.pp_layers, or
// an even split with the first L % pp stages one block longer. An error when pp_layers does
// not cover model.n_layers.
std::vector<int> stage_bounds(const ParallelCfg& cfg, int n_layers);

class ProcessGrid {
 public:
  // Throws kmoe::Error (before any allocation) if the world size is not pp*dp*ep. Collective
  // over `world`; with parallel.backend = nccl it also initializes NCCL on every axis.
  ProcessGrid(const ParallelCfg& cfg, int n_layers, MPI_Comm world);
  // The data plane holds pointers to the axes below: the grid stays where it was built.
  ProcessGrid(const ProcessGrid&) = delete;
  ProcessGrid& operator=(const ProcessGrid&) = delete;

  int pp, dp, ep;
  int pp_rank, dp_rank, ep_rank;

  int replicas() const { return dp * ep; }
  int replica() const { return dp_rank * ep + ep_rank; }
  bool is_root() const { return world.rank() == 0; }
  bool first_stage() const { return pp_rank == 0; }
  bool last_stage() const { return pp_rank == pp - 1; }
  // Blocks [first_block(s), first_block(s + 1)) form stage s (stage_bounds).
  int first_block(int s) const { return bounds_[s]; }

  Communicator world;
  Communicator stage;    // the dp*ep ranks of this rank's pipeline stage
  Communicator dp_axis;  // same stage and ep rank: replicas of the same experts
  Communicator ep_axis;  // same stage and dp rank: the expert-parallel group (all-to-all)
  Communicator pipe;     // same replica, every stage: member s is stage s
  // pp > 1 with tied embeddings: stage 0 and the last stage of this replica (member 0 and 1);
  // invalid on the other stages and when pp == 1.
  Communicator tie;

  // The data plane of an axis (gradients, expert rows, activations): the MPI communicator
  // itself, the NCCL communicator built over it (parallel.backend = nccl), or the MPI one
  // staging device buffers through pinned host memory (device memory, MPI not CUDA-aware).
  const DataComm& data_plane(const Communicator& axis) const;

 private:
  // Fills data_ from parallel.backend and parallel.cuda_aware_mpi.
  void build_data_plane(const ParallelCfg& cfg);

  std::vector<int> bounds_;
  std::vector<std::pair<const Communicator*, std::unique_ptr<DataComm>>> data_;
};

}  // namespace kmoe
