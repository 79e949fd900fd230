// The frame every kmoe driver runs in: MPI, then --help (answered before Kokkos starts, which
// would print its own help instead), then Kokkos, then the driver's body, with kmoe's error
// reporting and exit codes: 0 done, 1 error, 3 non-finite loss or gradient norm, 85/86 a
// checkpointed stop after SIGUSR1/SIGTERM (every rank exits with it, no abort).
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <functional>
#include <iostream>
#include <string>

#include "core/error.hpp"

namespace kmoe {

inline int run_driver(int argc, char** argv, const std::string& name, const std::string& help,
                      const std::function<void(int, char**)>& body) {
  MPI_Init(&argc, &argv);
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
  bool stop = false;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);  // consumes --kokkos-* arguments
    try {
      body(argc, argv);
    } catch (const StopRequest& e) {
      if (rank == 0) std::cerr << name << ": " << e.what() << std::endl;
      code = e.code();
      stop = true;
    } catch (const NonFiniteError& e) {
      if (rank == 0) std::cerr << name << ": error: " << e.what() << std::endl;
      code = 3;
    } catch (const SharedError& e) {
      if (rank == 0) std::cerr << name << ": error: " << e.what() << std::endl;
      code = 1;
    } catch (const std::exception& e) {
      std::cerr << name << ": error: " << e.what() << std::endl;
      code = 1;
    }
  }
  // A rank that failed alone must not leave the others waiting in a collective.
  if (code != 0 && !stop && world > 1) MPI_Abort(MPI_COMM_WORLD, code);
  MPI_Finalize();
  return code;
}

}  // namespace kmoe
