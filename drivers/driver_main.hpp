// The frame every kmoe driver runs in: MPI, then --help (answered before Kokkos starts, which
// would print its own help instead), then Kokkos on the rank's share of the node
// (parallel/execution), then the driver's body (given the execution plan, whose host threads its
// run context takes: core/run_context.hpp), with kmoe's error
// reporting and exit codes: 0 done, 1 error, 3 non-finite loss or gradient norm, 85/86 a
// checkpointed stop after SIGUSR1/SIGTERM (every rank exits with it, no abort), 75 a start-up
// that failed while the ranks joined (named with the rank, node and phase: core/process_phase).
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <chrono>
#include <functional>
#include <iostream>
#include <string>
#include <thread>

#include "core/error.hpp"
#include "core/process_phase.hpp"
#include "core/stop_signal.hpp"
#include "io/hdf5_file.hpp"
#include "parallel/communicator.hpp"
#include "parallel/execution.hpp"

namespace kmoe {

inline int run_driver(int argc, char** argv, const std::string& name, const std::string& help,
                      const std::function<void(int, char**, const ExecutionPlan&)>& body) {
  init_mpi(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      if (rank == 0) std::cout << help;
      MPI_Finalize();
      return 0;
    }
  }
  int code = 0;
  bool stop = false, shared = false;
  {
    KokkosSession kokkos(argc, argv, name);  // consumes --kokkos-* arguments
    try {
      body(argc, argv, kokkos.plan());
      set_phase("shut-down");
    } catch (const StopRequest& e) {
      if (rank == 0) std::cerr << name << ": " << e.what() << std::endl;
      code = e.code();
      stop = true;
    } catch (const NonFiniteError& e) {
      if (rank == 0) std::cerr << name << ": error: " << e.what() << std::endl;
      code = 3;
      shared = true;
    } catch (const SharedError& e) {
      if (rank == 0) std::cerr << name << ": error: " << e.what() << std::endl;
      code = 1;
      shared = true;
    } catch (const std::exception& e) {
      std::cerr << name << ": error: " << e.what() << std::endl;
      code = 1;
    }
  }
  // A rank that failed alone must not leave the others waiting in a collective: the job is
  // aborted. An error every rank shares waits (briefly) for rank 0's message to be out first. A
  // file HDF5 must not touch again (abandoned after a failed collective write) rules out
  // MPI_Finalize, which would close it.
  if (code != 0 && !stop && (world > 1 || hdf5_files_abandoned())) {
    if (shared) {
      MPI_Request req;
      MPI_Ibarrier(MPI_COMM_WORLD, &req);
      int done = 0;
      for (int i = 0; i < 1000 && !done; ++i) {  // at most ~10 s
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  MPI_Finalize();
  // A cancel that reached this process after the ranks agreed on a requeue (85) still wins
  // while the process lives.
  if (stop && code == 85 && requested_stop() == StopKind::Cancel) {
    if (rank == 0) {
      std::cerr << name << ": then " << stop_signal_name()
                << " arrived: exit code 86 (resumable, do not requeue)" << std::endl;
      report_exit_code(86);
    }
    code = 86;
  }
  return code;
}

}  // namespace kmoe
