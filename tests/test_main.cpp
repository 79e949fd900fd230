// GoogleTest main for every kmoe suite: MPI and Kokkos initialised once; only rank 0 prints
// (KMOE_TEST_ALL_RANKS=1: every rank); the exit code is the maximum over ranks, so one failing
// rank fails the test.
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdlib>

#include "parallel/communicator.hpp"
#include "parallel/execution.hpp"

int main(int argc, char** argv) {
  kmoe::init_mpi(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int result = 0;
  {
    kmoe::KokkosSession kokkos(argc, argv, "kmoe-test");
    ::testing::InitGoogleTest(&argc, argv);
    if (rank != 0 && !std::getenv("KMOE_TEST_ALL_RANKS")) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    int local = RUN_ALL_TESTS();
    MPI_Allreduce(&local, &result, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  }
  MPI_Finalize();
  return result;
}
