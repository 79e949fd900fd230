// The NCCL backend (KMOE_ENABLE_NCCL) compiles, links and loads: libnccl answers its version,
// and the backend's choices hold. On a CPU Kokkos (CI, no GPU) an NcclComm, and a ProcessGrid
// with parallel.backend = nccl, refuse with an error naming the CUDA requirement; on a CUDA
// Kokkos a one-rank NcclComm moves data through NCCL.
#include <gtest/gtest.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/kokkos_types.hpp"
#include "io/deck.hpp"
#include "parallel/nccl_comm.hpp"
#include "parallel/process_grid.hpp"
#include "parallel/staged_comm.hpp"

namespace kmoe {
namespace {

const char* const kDeck = R"([model]
vocab_size = 256
d_model = 32
n_layers = 2
n_heads = 2
ffn_hidden = 64
[train]
seq_len = 16
micro_batch = 1
global_batch = 1
max_steps = 1
[optimizer]
lr = 1e-3
[data]
paths = a.bin
)";

TEST(NcclLink, LibraryVersion) {
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  // ncclSend/ncclRecv, which every transfer uses, arrived in 2.7 (and 2.0 is where NCCL's
  // version scheme starts).
  EXPECT_GE(version, NCCL_VERSION(2, 7, 0)) << "libnccl reports version code " << version;
  std::printf("libnccl version code %d (nccl.h %d)\n", version, NCCL_VERSION_CODE);
}

TEST(NcclLink, DeckAcceptsTheBackendKeys) {
  const Config c = parse_deck(kDeck, "test.deck",
                              {"--parallel.backend=nccl", "--parallel.cuda_aware_mpi=false"});
  EXPECT_EQ(c.parallel.backend, CommBackend::Nccl);
  EXPECT_EQ(c.parallel.cuda_aware_mpi, CudaAwareMpi::No);
  const Config d = parse_deck(kDeck, "test.deck");
  EXPECT_EQ(d.parallel.backend, CommBackend::Mpi);
  EXPECT_EQ(d.parallel.cuda_aware_mpi, CudaAwareMpi::Auto);
  try {
    parse_deck(kDeck, "test.deck", {"--parallel.backend=gloo"});
    ADD_FAILURE() << "parallel.backend = gloo accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.backend must be one of mpi | nccl"),
              std::string::npos)
        << e.what();
  }
  try {
    parse_deck(kDeck, "test.deck", {"--parallel.cuda_aware_mpi=maybe"});
    ADD_FAILURE() << "parallel.cuda_aware_mpi = maybe accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.cuda_aware_mpi must be one of auto | true | "
                                         "false, got 'maybe'"),
              std::string::npos)
        << e.what();
  }
}

TEST(NcclLink, CudaAwareMpiSetting) {
  EXPECT_TRUE(mpi_takes_device_pointers(CudaAwareMpi::Yes));
  EXPECT_FALSE(mpi_takes_device_pointers(CudaAwareMpi::No));
  // auto stages: nonblocking collectives on device memory are not what CUDA-aware MPIs promise.
  EXPECT_FALSE(mpi_takes_device_pointers(CudaAwareMpi::Auto));
  if (!device_paths()) {  // host memory never stages
    for (CudaAwareMpi c : {CudaAwareMpi::No, CudaAwareMpi::Auto, CudaAwareMpi::Yes})
      EXPECT_FALSE(mpi_needs_staging(c));
    return;
  }
  // Device memory (or device paths on a CPU): auto and false stage; true is refused with Open
  // MPI, whose CUDA support takes no nonblocking collectives, and trusted with other MPIs.
  EXPECT_TRUE(mpi_needs_staging(CudaAwareMpi::No));
  EXPECT_TRUE(mpi_needs_staging(CudaAwareMpi::Auto));
#if defined(OPEN_MPI) && OPEN_MPI
  try {
    mpi_needs_staging(CudaAwareMpi::Yes);
    ADD_FAILURE() << "cuda_aware_mpi = true was accepted under Open MPI";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.cuda_aware_mpi = true"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("parallel.backend = nccl"), std::string::npos);
  }
#else
  EXPECT_FALSE(mpi_needs_staging(CudaAwareMpi::Yes));
#endif
}

#if !defined(KOKKOS_ENABLE_CUDA)
std::string error_of(void (*f)()) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no kmoe::Error)";
}

TEST(NcclLink, CpuKokkosRefusesNccl) {
  const std::string e = error_of([] {
    Communicator world(MPI_COMM_WORLD, "world", 10.0);
    NcclComm nccl(world);
  });
  EXPECT_NE(e.find("parallel.backend = nccl needs Kokkos built with CUDA"), std::string::npos) << e;
  EXPECT_NE(e.find(ExecSpace::name()), std::string::npos) << e;
}

TEST(NcclLink, CpuKokkosGridRefusesNccl) {
  const std::string e = error_of([] {
    ParallelCfg cfg;
    cfg.dp = [] {
      int n = 1;
      MPI_Comm_size(MPI_COMM_WORLD, &n);
      return n;
    }();
    cfg.backend = CommBackend::Nccl;
    ProcessGrid grid(cfg, 2, MPI_COMM_WORLD);
  });
  EXPECT_NE(e.find("parallel.backend = nccl needs Kokkos built with CUDA"), std::string::npos) << e;
}

#else

// Outside the TEST body: nvcc refuses a device lambda in a private member function.
void fill_ramp(View1F v, float step) {
  Kokkos::parallel_for(
      "fill", Range(0, static_cast<int>(v.extent(0))), KOKKOS_LAMBDA(int i) { v(i) = step * i; });
}

TEST(NcclLink, OneRankAllToAllThroughNccl) {
  Communicator self(MPI_COMM_SELF, "self", 60.0);
  NcclComm nccl(self);
  EXPECT_STREQ(nccl.backend(), "nccl");
  EXPECT_EQ(nccl.size(), 1);
  View1F send("send", 5), recv("recv", 5);
  fill_ramp(send, 1.5f);
  nccl.all_to_all_v(send.data(), {5}, recv.data(), {5});
  auto host = Kokkos::create_mirror_view_and_copy(HostSpace(), recv);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(host(i), 1.5f * i);
  Pending p = nccl.start_allreduce_sum(recv.data(), 5);  // one member: nothing to wait for
  nccl.complete(p);
}

#endif

}  // namespace
}  // namespace kmoe
