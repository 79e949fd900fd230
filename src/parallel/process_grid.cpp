#include "parallel/process_grid.hpp"

#include "core/error.hpp"

namespace kmoe {

ProcessGrid::ProcessGrid(const ParallelCfg& cfg, MPI_Comm world_comm)
    : pp(cfg.pp), dp(cfg.dp), ep(cfg.ep), world(world_comm, "world") {
  KMOE_REQUIRE(world.size() == cfg.world(),
               "parallel grid pp*dp*ep = " << cfg.pp << "*" << cfg.dp << "*" << cfg.ep << " = "
                                           << cfg.world() << " ranks, but the job was launched on "
                                           << world.size() << " ranks");
  KMOE_REQUIRE(cfg.pp == 1, "parallel.pp = " << cfg.pp
                                             << ": pipeline parallelism is not available in this "
                                                "build yet; use parallel.pp = 1");
  const int r = world.rank();
  ep_rank = r % ep;
  dp_rank = (r / ep) % dp;
  pp_rank = r / (ep * dp);
  MPI_Comm stage_comm;
  mpi_check(MPI_Comm_split(world.comm(), pp_rank, r, &stage_comm), "MPI_Comm_split(stage)");
  stage = Communicator(stage_comm, "stage");
  MPI_Comm_free(&stage_comm);
}

}  // namespace kmoe
