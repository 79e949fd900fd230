#include "parallel/process_grid.hpp"

#include "core/device_memory.hpp"
#include "core/error.hpp"
#include "parallel/staged_comm.hpp"
#ifdef KMOE_HAVE_NCCL
#include "parallel/nccl_comm.hpp"
#endif

namespace kmoe {

namespace {
Communicator split(const Communicator& parent, int color, int key, const char* name,
                   double watchdog, double spin) {
  MPI_Comm c;
  mpi_check(MPI_Comm_split(parent.comm(), color, key, &c), "MPI_Comm_split");
  if (c == MPI_COMM_NULL) return Communicator();
  Communicator out(c, name, watchdog, spin);
  MPI_Comm_free(&c);
  return out;
}

double spin_seconds(const ParallelCfg& cfg) {
  return cfg.spin_microseconds < 0 ? -1.0 : cfg.spin_microseconds * 1e-6;
}
}  // namespace

std::vector<int> stage_bounds(const ParallelCfg& cfg, int n_layers) {
  const int pp = cfg.pp;
  std::vector<int> b(pp + 1, 0);
  for (int s = 0; s < pp; ++s)
    b[s + 1] = b[s] + (cfg.pp_layers.empty() ? n_layers / pp + (s < n_layers % pp ? 1 : 0)
                                             : cfg.pp_layers[s]);
  KMOE_REQUIRE(b[pp] == n_layers,
               "parallel.pp_layers covers " << b[pp] << " blocks, model.n_layers is " << n_layers);
  return b;
}

ProcessGrid::ProcessGrid(const ParallelCfg& cfg, int n_layers, MPI_Comm world_comm)
    : pp(cfg.pp),
      dp(cfg.dp),
      ep(cfg.ep),
      world(world_comm, "world", cfg.watchdog_seconds, spin_seconds(cfg)) {
  KMOE_REQUIRE(cfg.dp >= 1, "parallel.dp = auto reached the process grid unresolved "
                            "(resolve_auto_dp sets it from the launch's rank count)");
  KMOE_REQUIRE(world.size() == cfg.world(),
               "parallel grid pp*dp*ep = " << cfg.pp << "*" << cfg.dp << "*" << cfg.ep << " = "
                                           << cfg.world() << " ranks, but the job was launched on "
                                           << world.size() << " ranks");
  const double wd = cfg.watchdog_seconds, spin = spin_seconds(cfg);
  const int r = world.rank();
  ep_rank = r % ep;
  dp_rank = (r / ep) % dp;
  pp_rank = r / (ep * dp);
  stage = split(world, pp_rank, r, "stage", wd, spin);
  dp_axis = split(world, pp_rank * ep + ep_rank, r, "dp", wd, spin);
  ep_axis = split(world, pp_rank * dp + dp_rank, r, "ep", wd, spin);
  pipe = split(world, replica(), pp_rank, "pp", wd, spin);
  const bool tied_end = pp > 1 && (first_stage() || last_stage());
  tie = split(world, tied_end ? replica() : MPI_UNDEFINED, pp_rank, "tied-embedding", wd, spin);

  bounds_ = stage_bounds(cfg, n_layers);
  build_data_plane(cfg);
}

void ProcessGrid::build_data_plane(const ParallelCfg& cfg) {
  // The axes that carry data (world carries only metrics). Every rank walks them in this
  // order, so the collective set-up of an NCCL communicator per axis cannot deadlock: tie, the
  // one axis some ranks lack, comes last.
  std::vector<const Communicator*> axes = {&stage, &dp_axis, &ep_axis, &pipe};
  if (tie.valid()) axes.push_back(&tie);
  declare_mpi_device_memory(false);
  if (cfg.backend == CommBackend::Nccl) {
#ifdef KMOE_HAVE_NCCL
    for (const Communicator* axis : axes)
      data_.emplace_back(axis, std::make_unique<NcclComm>(*axis));
    return;
#else
    KMOE_FAIL(
        "parallel.backend = nccl, but this build of kmoe lacks NCCL: configure it with "
        "-DKMOE_ENABLE_NCCL=ON (and a CUDA Kokkos)");
#endif
  }
  // MPI on device memory it cannot read: through pinned host buffers. On host-accessible
  // memory, or with a CUDA-aware MPI, the axes serve as their own data plane.
  const bool staging = mpi_needs_staging(cfg.cuda_aware_mpi);
  if (staging)
    for (const Communicator* axis : axes)
      data_.emplace_back(axis, std::make_unique<StagedMpiComm>(*axis));
  // The axes then take device memory as the user declared (the device memory check lets them).
  declare_mpi_device_memory(device_paths() && !staging);
}

const DataComm& ProcessGrid::data_plane(const Communicator& axis) const {
  for (const auto& [mpi, dc] : data_)
    if (mpi == &axis) return *dc;
  return axis;
}

}  // namespace kmoe
