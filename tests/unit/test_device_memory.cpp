// The device memory check (core/device_memory.hpp) with device paths on, in both this test's
// runs (the environment is set before main): device allocations are recorded and forgotten
// when freed, kmoe's host buffers are not device memory, and the MPI Communicator, the HDF5
// file layer and the safetensors reader and writer refuse a device pointer, naming themselves
// and the allocation, while StagedMpiComm moves device buffers through host memory. Named host
// reads copy into one reused buffer per name. At 1 and 2 ranks.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/device_memory.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "io/hdf5_file.hpp"
#include "io/safetensors.hpp"
#include "parallel/communicator.hpp"
#include "parallel/staged_comm.hpp"

namespace {
// Before main, so the first read of either setting sees them.
const bool g_env = [] {
  setenv("KMOE_DEVICE_PATHS", "1", 1);
  setenv("KMOE_CHECK_DEVICE_MEMORY", "1", 1);
  return true;
}();
}  // namespace

namespace kmoe {
namespace {

using HostView = Kokkos::View<float*, Layout, HostSpace>;

// The message of the kmoe::Error `f` throws, "" when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A fresh directory under the system's temporary directory, removed at the end.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kmoe-devmem-XXXXXX").string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

TEST(DeviceMemory, TheCheckIsOnWithDevicePaths) {
  ASSERT_TRUE(g_env);
  EXPECT_TRUE(device_paths());
  EXPECT_TRUE(device_memory_check_on());
  if constexpr (Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) {
    // Host backends: the label decides (device paths on).
    EXPECT_TRUE(counts_as_device("Host", "grads"));
    EXPECT_FALSE(counts_as_device("Host", "kmoe::host staged mpi"));
  } else {  // GPU builds: the space decides
    EXPECT_TRUE(counts_as_device("Cuda", "grads"));
    EXPECT_TRUE(counts_as_device("HIP", "grads"));
    EXPECT_FALSE(counts_as_device("CudaHostPinned", "grads"));
    EXPECT_FALSE(counts_as_device("Host", "grads"));
  }
}

TEST(DeviceMemory, RecordsDeviceViewsAndForgetsFreedOnes) {
  View1F d("test device buffer", 1000);
  HostView h(std::string(kHostLabel) + "test buffer", 1000);
  std::vector<float> plain(1000);
  const std::string in = device_allocation_at(d.data(), 4);
  EXPECT_NE(in.find("'test device buffer'"), std::string::npos) << in;
  EXPECT_NE(in.find("4000 bytes"), std::string::npos) << in;
  // The last element too (Kokkos reports the allocation from its header on).
  EXPECT_NE(device_allocation_at(d.data() + 999, 4), "");
  View1F tiny("test tiny buffer", 3);  // its data lies past the size Kokkos reports
  EXPECT_NE(device_allocation_at(tiny.data() + 2, 4).find("'test tiny buffer'"),
            std::string::npos);
  // A range that begins below the allocation and reaches into it.
  const char* below =
      reinterpret_cast<const char*>(d.data()) - sizeof(Kokkos::Impl::SharedAllocationHeader) - 64;
  EXPECT_NE(device_allocation_at(below, 128).find("'test device buffer'"), std::string::npos);
  EXPECT_EQ(device_allocation_at(h.data(), 4000), "");
  EXPECT_EQ(device_allocation_at(plain.data(), 4000), "");
  EXPECT_EQ(device_allocation_at(d.data(), 0), "");  // nothing to touch

  const float* freed = nullptr;
  {
    View1F tmp("test freed buffer", 64);
    freed = tmp.data();
    EXPECT_NE(device_allocation_at(freed, 4), "");
  }
  EXPECT_EQ(device_allocation_at(freed, 4), "");
}

TEST(DeviceMemory, CommunicatorRefusesDevicePointersUnlessDeclared) {
  Communicator world(MPI_COMM_WORLD, "test");
  View1F d("test gradients", 256);
  Kokkos::deep_copy(d, 1.0f);
  std::vector<float> host(256, 1.0f);
  declare_mpi_device_memory(false);
  // Every rank refuses before any MPI call, so none is left waiting.
  const std::string e = error_of([&] { world.allreduce_sum(d.data(), 256); });
  EXPECT_NE(e.find("Communicator test axis, allreduce_sum(float)"), std::string::npos) << e;
  EXPECT_NE(e.find("'test gradients'"), std::string::npos) << e;
  EXPECT_NE(e.find("parallel.cuda_aware_mpi"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { world.start_send(d.data(), 16, 0); }), "");
  EXPECT_NE(error_of([&] { world.recv(d.data(), 16, 0); }), "");
  std::vector<std::int64_t> counts(world.size(), 0);
  counts[0] = 8;
  EXPECT_NE(error_of([&] { world.start_allgather(d.data(), counts); }), "");
  EXPECT_NE(error_of([&] { world.all_to_all_v(d.data(), counts, host.data(), counts); }), "");

  world.allreduce_sum(host.data(), 256);  // host memory goes through
  EXPECT_EQ(host[0], static_cast<float>(world.size()));

  // A CUDA-aware MPI declared: the axis serves as the data plane on device memory (where MPI
  // would touch GPU memory, at one rank only: no MPI call is made there).
  if (Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible || world.size() == 1) {
    declare_mpi_device_memory(true);
    EXPECT_EQ(error_of([&] { world.allreduce_sum(d.data(), 256); }), "");
    declare_mpi_device_memory(false);
  }
  auto h = read_to_host("test gradients", d);
  EXPECT_EQ(h(255), static_cast<float>(world.size()));
}

TEST(DeviceMemory, StagedCommunicationMovesDeviceBuffersThroughHostMemory) {
  Communicator world(MPI_COMM_WORLD, "test");
  StagedMpiComm staged(world);
  declare_mpi_device_memory(false);
  View1F d("test bucket", 300);
  Kokkos::deep_copy(d, 2.0f);
  Pending p = staged.start_allreduce_sum(d.data(), 300);
  staged.complete(p);
  auto h = read_to_host("test bucket", d);
  EXPECT_EQ(h(0), 2.0f * world.size());
  EXPECT_EQ(h(299), 2.0f * world.size());
}

TEST(DeviceMemory, Hdf5RefusesDevicePointersAndTakesHostCopies) {
  TempDir dir;
  const std::string path = dir.path + "/r" + std::to_string(world_rank()) + ".h5";
  View1F d("test weights", 12);
  Kokkos::deep_copy(d, 3.0f);
  H5File f = H5File::create(path, MPI_COMM_SELF);
  std::string e = error_of([&] { f.write_rows_f32("/w", {3, 4}, 0, 3, d.data(), true); });
  EXPECT_NE(e.find(path + ": writing dataset /w"), std::string::npos) << e;
  EXPECT_NE(e.find("'test weights'"), std::string::npos) << e;
  EXPECT_NE(e.find("HDF5"), std::string::npos) << e;
  auto h = host_copy("test weights", d);
  EXPECT_NE(h.data(), d.data());
  f.write_rows_f32("/w", {3, 4}, 0, 3, h.data(), true);
  e = error_of([&] { f.read_rows_f32("/w", {3, 4}, 0, 3, d.data()); });
  EXPECT_NE(e.find(path + ": reading dataset /w"), std::string::npos) << e;
  std::vector<float> back(12);
  f.read_rows_f32("/w", {3, 4}, 0, 3, back.data());
  EXPECT_EQ(back[11], 3.0f);
  f.close();
}

TEST(DeviceMemory, SafetensorsRefusesDevicePointers) {
  TempDir dir;
  const std::string path = dir.path + "/r" + std::to_string(world_rank()) + ".safetensors";
  View1F d("test embedding", 6);
  Kokkos::deep_copy(d, 0.5f);
  StTensor t;
  t.name = "emb";
  t.shape = {2, 3};
  {
    SafetensorsWriter w(path, {t}, {});
    const std::string e = error_of([&] { w.write_next("emb", d.data(), 6); });
    EXPECT_NE(e.find(path + ": writing tensor emb"), std::string::npos) << e;
    EXPECT_NE(e.find("'test embedding'"), std::string::npos) << e;
    auto h = host_copy("test embedding", d);
    w.write_next("emb", h.data(), 6);
    w.finish();
  }
  SafetensorsReader r(path);
  const std::string e = error_of([&] { r.read_f32("emb", d.data()); });
  EXPECT_NE(e.find(path + ": reading tensor emb"), std::string::npos) << e;
  std::vector<float> back(6);
  r.read_f32("emb", back.data());
  EXPECT_EQ(back[5], 0.5f);
}

TEST(DeviceMemory, NamedReadsReuseOneHostBufferPerName) {
  View1F a("test a", 100), b("test b", 400);
  Kokkos::deep_copy(a, 1.0f);
  Kokkos::deep_copy(b, 2.0f);
  auto h1 = read_to_host("test read", a);
  EXPECT_NE(h1.data(), a.data());  // a copy, as on a GPU
  EXPECT_EQ(device_allocation_at(h1.data(), 400), "");
  EXPECT_EQ(h1(99), 1.0f);
  auto h2 = read_to_host("test read", a);
  EXPECT_EQ(h2.data(), h1.data());         // the same buffer again
  auto h3 = read_to_host("test read", b);  // grown
  EXPECT_EQ(h3.extent(0), 400u);
  EXPECT_EQ(h3(399), 2.0f);
  auto other = read_to_host("test other read", a);
  EXPECT_NE(other.data(), h3.data());
}

}  // namespace
}  // namespace kmoe
