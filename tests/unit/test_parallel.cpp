// The process grid and its communicators on 4 ranks (RUNTIME.md section 1): rank order and axis
// membership; the variable all-to-all with uneven counts (a rank that sends nothing, a rank that
// receives nothing); simultaneous point-to-point exchange between pipeline neighbours; the
// expert-parallel MoE layer and the sharded Engram lookup against their single-rank versions on
// the same tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/error.hpp"
#include "core/gemm.hpp"
#include "core/kept_operand.hpp"
#include "core/workspace.hpp"
#include "modules/engram/engram.hpp"
#include "modules/model/model_size.hpp"
#include "modules/model/stage.hpp"
#include "modules/moe/moe.hpp"
#include "parallel/layer_comms.hpp"
#include "parallel/process_grid.hpp"
#include "parallel/staged_comm.hpp"
#include "train/grad_reducer.hpp"

namespace kmoe {
namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

std::vector<float> host(const float* d, std::int64_t n) {
  std::vector<float> h(n);
  Kokkos::deep_copy(Kokkos::View<float*, HostSpace, Unmanaged>(h.data(), n),
                    Kokkos::View<const float*, MemSpace, Unmanaged>(d, n));
  return h;
}

void fill(float* d, const std::vector<float>& h) {
  Kokkos::deep_copy(Kokkos::View<float*, MemSpace, Unmanaged>(d, h.size()),
                    Kokkos::View<const float*, HostSpace, Unmanaged>(h.data(), h.size()));
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(double(a[i]) - b[i]));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return num / std::max(den, 1e-30);
}

TEST(Grid, RankOrderAndAxes) {
  ASSERT_EQ(world_size(), 4);
  const int me = world_rank();
  struct Layout {
    int pp, dp, ep;
  };
  for (Layout l : {Layout{1, 2, 2}, Layout{2, 1, 2}, Layout{2, 2, 1}, Layout{4, 1, 1}}) {
    ParallelCfg c;
    c.pp = l.pp;
    c.dp = l.dp;
    c.ep = l.ep;
    ProcessGrid g(c, 4, MPI_COMM_WORLD);
    EXPECT_EQ(me, (g.pp_rank * l.dp + g.dp_rank) * l.ep + g.ep_rank);
    EXPECT_EQ(g.stage.size(), l.dp * l.ep);
    EXPECT_EQ(g.ep_axis.size(), l.ep);
    EXPECT_EQ(g.dp_axis.size(), l.dp);
    EXPECT_EQ(g.pipe.size(), l.pp);
    EXPECT_EQ(g.pipe.rank(), g.pp_rank);
    EXPECT_EQ(g.ep_axis.rank(), g.ep_rank);
    // ep neighbours are adjacent world ranks; pipeline neighbours are a stage (dp*ep) apart.
    for (int r = 0; r < l.ep; ++r) EXPECT_EQ(g.ep_axis.world_rank(r), me - g.ep_rank + r);
    for (int s = 0; s < l.pp; ++s)
      EXPECT_EQ(g.pipe.world_rank(s), me + (s - g.pp_rank) * l.dp * l.ep);
    EXPECT_EQ(g.tie.valid(), l.pp > 1 && (g.first_stage() || g.last_stage()));
    EXPECT_EQ(g.first_block(0), 0);
    EXPECT_EQ(g.first_block(l.pp), 4);
  }
}

TEST(Grid, WorldSizeMismatchIsAClearError) {
  ParallelCfg c;
  c.dp = 3;
  try {
    ProcessGrid g(c, 4, MPI_COMM_WORLD);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("launched on 4 ranks"), std::string::npos) << e.what();
  }
}

// The data plane ProcessGrid builds: staged through host buffers exactly where MemSpace is not
// host-accessible or device paths are on (KMOE_DEVICE_PATHS=1: the *_device_paths tests).
TEST(Comm, DataPlaneStagesUnderDevicePaths) {
  ParallelCfg cfg;
  cfg.dp = Communicator(MPI_COMM_WORLD, "count").size();
  const ProcessGrid grid(cfg, 4, MPI_COMM_WORLD);
  EXPECT_STREQ(grid.data_plane(grid.dp_axis).backend(), device_paths() ? "mpi-staged" : "mpi");
  const Communicator c(MPI_COMM_WORLD, "test");
  EXPECT_STREQ(MpiDataPlane(c).get().backend(), device_paths() ? "mpi-staged" : "mpi");
}

TEST(Comm, AllToAllVWithUnevenCounts) {
  Communicator c(MPI_COMM_WORLD, "test");
  const int P = c.size(), me = c.rank();
  // Rank 0 sends nothing; rank 2 receives nothing; the other counts differ per pair.
  auto count = [](int from, int to) -> std::int64_t {
    if (from == 0 || to == 2) return 0;
    return 1 + (3 * from + 5 * to) % 4;
  };
  std::vector<std::int64_t> sc(P), rc(P);
  std::vector<float> send, expect;
  for (int p = 0; p < P; ++p) {
    sc[p] = count(me, p);
    rc[p] = count(p, me);
    for (int i = 0; i < sc[p]; ++i) send.push_back(100.0f * me + 10.0f * p + i);
    for (int i = 0; i < rc[p]; ++i) expect.push_back(100.0f * p + 10.0f * me + i);
  }
  View1F s("send", std::max<std::size_t>(1, send.size())),
      r("recv", std::max<std::size_t>(1, expect.size()));
  fill(s.data(), send);
  const MpiDataPlane plane(c);  // as ProcessGrid builds it: staged on device memory
  plane.get().all_to_all_v(s.data(), sc, r.data(), rc);
  EXPECT_EQ(host(r.data(), expect.size()), expect);
}

// optimizer.shard's collectives: member q's block of uneven size (one empty) summed to q in
// place, then every block sent to all, on the MPI axis.
TEST(Comm, ReduceScatterAndAllGatherWithUnevenBlocks) {
  Communicator c(MPI_COMM_WORLD, "test");
  const int P = c.size(), me = c.rank();
  std::vector<std::int64_t> counts(P);
  std::int64_t n = 0;
  for (int q = 0; q < P; ++q) n += counts[q] = q == 1 ? 0 : 2 + 3 * q;
  std::vector<float> mine(n), sum(n, 0.0f);
  for (std::int64_t i = 0; i < n; ++i) {
    mine[i] = float(me + 1) * 0.5f + float(i);
    for (int p = 0; p < P; ++p) sum[i] += float(p + 1) * 0.5f + float(i);
  }
  View1F d("blocks", n);
  fill(d.data(), mine);
  const MpiDataPlane plane(c);  // as ProcessGrid builds it: staged on device memory
  const DataComm& dc = plane.get();
  Pending rs = dc.start_reduce_scatter_sum(d.data(), counts);
  dc.complete(rs);
  std::vector<float> got = host(d.data(), n);
  std::int64_t at = 0;
  for (int q = 0; q < me; ++q) at += counts[q];
  for (std::int64_t i = at; i < at + counts[me]; ++i) EXPECT_EQ(got[i], sum[i]) << i;
  // Each member's block holds its result; the gather brings all of them everywhere.
  for (std::int64_t i = 0; i < n; ++i)
    if (i < at || i >= at + counts[me]) got[i] = -1.0f;
  fill(d.data(), got);
  Pending ag = dc.start_allgather(d.data(), counts);
  dc.complete(ag);
  EXPECT_EQ(host(d.data(), n), sum);
  EXPECT_THROW(c.start_allgather(d.data(), std::vector<std::int64_t>(P + 1, 0)), Error);

  // bf16 words (the parameters' compute copies), bit for bit, signalling-NaN patterns and odd
  // block sizes included, on the MPI axis and through the staged path.
  std::vector<std::int64_t> wcounts(P);
  std::int64_t nw = 0;
  for (int q = 0; q < P; ++q) nw += wcounts[q] = q == 1 ? 0 : 1 + 2 * q;
  std::vector<std::uint16_t> want(nw);
  for (std::int64_t i = 0; i < nw; ++i) want[i] = static_cast<std::uint16_t>(0x7F81 + 977 * i);
  std::int64_t wat = 0;
  for (int q = 0; q < me; ++q) wat += wcounts[q];
  const StagedMpiComm staged(c);
  // The axis itself only where MPI reads the memory (host backends); staged everywhere.
  std::vector<const DataComm*> planes = {&staged};
  if (!mpi_needs_staging(CudaAwareMpi::Auto)) planes.push_back(&c);
  for (const DataComm* plane : planes) {
    Kokkos::View<std::uint16_t*, Layout, MemSpace> w("words", nw);
    auto hw = Kokkos::create_mirror_view(w);
    for (std::int64_t i = 0; i < nw; ++i)
      hw(i) = i >= wat && i < wat + wcounts[me] ? want[i] : 0xFFFF;
    Kokkos::deep_copy(w, hw);
    Pending wg = plane->start_allgather(w.data(), wcounts);
    plane->complete(wg);
    Kokkos::deep_copy(hw, w);
    EXPECT_EQ(std::vector<std::uint16_t>(hw.data(), hw.data() + nw), want) << plane->backend();
  }
}

// The moments optimizer.shard keeps: over the stage's 4 replicas (dp 2 x ep 2) every trainable
// row of every dense tensor is kept by exactly one member, and each member keeps about a
// quarter; the experts' rows split over the dp pair alike; the table's moments hold only the
// slices. Sums of a gradient bucket equal the all-reduce's on every member's rows.
TEST(GradReducer, ShardedMomentsCoverEveryRowOnce) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  ParallelCfg p;
  p.dp = 2;
  p.ep = 2;
  ModelCfg m;
  m.vocab_size = 40;
  m.d_model = 16;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 2;
  m.ffn_hidden = 24;
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 8;
  e.dense_layers = {0};
  ProcessGrid grid(p, m.n_layers, MPI_COMM_WORLD);
  TensorTable table;
  Stage stage(RunContext(), m, e, 1, 8, table, EngramCfg(), StagePlan::of(grid), layer_comms(Config(), grid));
  GradReducer reducer(table, grid, /*bucket_mb=*/0.001, /*tied=*/false, /*shard=*/true);
  const auto& slices = reducer.moment_slices();
  table.allocate(&slices);
  std::int64_t kept = 0;
  for (int t = 0; t < table.size(); ++t) {
    const TensorEntry& en = table.entry(t);
    if (!en.spec.trainable) continue;
    const MomentSlice& s = table.moments(t);
    kept += s.rows * en.spec.row_elements();
    const bool expert = en.spec.shard == Shard::Ep;
    const Communicator& group = expert ? grid.dp_axis : grid.stage;
    // Rows kept per member, summed over the group: each row once.
    std::vector<std::int32_t> rows(en.spec.local_rows(), 0);
    for (std::int64_t r = s.first; r < s.first + s.rows; ++r) rows[r] = 1;
    group.allreduce_sum(rows.data(), std::int64_t(rows.size()));
    for (std::size_t r = 0; r < rows.size(); ++r)
      EXPECT_EQ(rows[r], 1) << en.spec.name << " row " << r;
    EXPECT_TRUE(s.split) << en.spec.name;
  }
  EXPECT_EQ(kept, std::int64_t(table.exp_avg.extent(0)));
  EXPECT_LT(kept, table.total_elements() / 2);
  // Reduce-scatter the gradients: every member's own rows hold the sum over the group.
  std::vector<float> g(table.total_elements());
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = float(grid.world.rank() + 1) + 0.001f * i;
  fill(table.grads.data(), g);
  reducer.finish();
  const std::vector<float> got = host(table.grads.data(), table.total_elements());
  for (int t = 0; t < table.size(); ++t) {
    const TensorEntry& en = table.entry(t);
    if (!en.spec.trainable) continue;
    const int members = en.spec.shard == Shard::Ep ? grid.dp : grid.dp * grid.ep;
    const std::int64_t b = table.moment_begin(t),
                       n = table.moments(t).rows * en.spec.row_elements();
    for (std::int64_t i = b; i < b + n; ++i) {
      // Sum over the members of (rank + 1): the dp pair's ranks differ by ep.
      double expect = 0.0;
      for (int q = 0; q < 4; ++q)
        if (members == 4 || q % grid.ep == grid.world.rank() % grid.ep) expect += q + 1;
      ASSERT_NEAR(got[i], expect * 1.0 + members * 0.001 * double(i), 1e-3 * members)
          << en.spec.name << " element " << i - en.offset;
    }
  }
}

// Under recompute the blocks built with a context holding the pool share its buffers: the same
// request in two blocks is one buffer, two requests of one label in a block are two, a larger
// request grows the pool's (blocks built before keep theirs), a kept operand's growth is every
// holder's, and with a context without the pool every request is its own allocation.
TEST(ActivationPool, BlocksShareTheirSavedBuffers) {
  ActivationPool pool;
  RunContext pooled;
  pooled.pool = &pool;
  View1F a1, a2, b1, big;
  KeptOperand k1, k2;
  pool.begin_block();
  a1 = saved_floats(pooled, "x", 10);
  a2 = saved_floats(pooled, "x", 10);
  k1 = KeptOperand(pooled, "k", 8, /*may_be_bf16=*/false);
  pool.begin_block();
  b1 = saved_floats(pooled, "x", 10);
  big = saved_floats(pooled, "x", 10);
  k2 = KeptOperand(pooled, "k", 4, /*may_be_bf16=*/false);
  EXPECT_EQ(a1.data(), b1.data());
  EXPECT_NE(a1.data(), a2.data());
  EXPECT_EQ(a2.data(), big.data());
  EXPECT_EQ(k1.f32(), k2.f32());
  k2.ensure(1000);
  EXPECT_EQ(k1.f32(), k2.f32());
  pool.begin_block();
  View1F grown = saved_floats(pooled, "x", 20);
  EXPECT_NE(grown.data(), a1.data());
  EXPECT_EQ(grown.extent(0), 20u);
  EXPECT_EQ(a1.extent(0), 10u);  // still its own, valid buffer
  EXPECT_GE(pool.bytes(), std::int64_t(4 * (20 + 10 + 1000)));
  const RunContext own;
  View1F own1 = saved_floats(own, "x", 10), own2 = saved_floats(own, "x", 10);
  EXPECT_NE(own1.data(), own2.data());
  // A pool whose blocks do not share (no recompute) only holds the shared objects: every
  // request is its own allocation.
  ActivationPool apart(/*blocks_share=*/false);
  RunContext with_apart;
  with_apart.pool = &apart;
  apart.begin_block();
  View1F s1 = saved_floats(with_apart, "x", 10), s2 = saved_floats(with_apart, "x", 10);
  EXPECT_NE(s1.data(), s2.data());
  EXPECT_EQ(apart.shared<int>("w", 3).get(), apart.shared<int>("w", 4).get());
}

// The workspace is a stack: a frame's takes are disjoint and aligned, a closed frame's memory
// is the next frame's, a take beyond the reserve gets a further chunk (earlier takes stay
// valid), and the outermost frame's end leaves one allocation of the deepest stack seen.
TEST(Workspace, FramesReuseMemoryAndGrowPastTheReserve) {
  Workspace ws("test::workspace");
  ws.reserve(4096);
  EXPECT_EQ(ws.capacity(), 4096);
  float* first = nullptr;
  {
    Workspace::Frame outer(ws);
    first = outer.floats(100);
    float* second = outer.floats(1);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(second) % 256, 0u);
    EXPECT_EQ(second, first + 192);  // 400 bytes rounded to 512, 256 apart
    float* inner_take = nullptr;
    {
      Workspace::Frame inner(ws);
      inner_take = inner.floats(10);
      EXPECT_EQ(inner_take, second + 128);
    }
    {
      Workspace::Frame again(ws);
      EXPECT_EQ(again.floats(10), inner_take);  // the closed frame's memory again
      // Past the reserve: a new chunk; what was taken before keeps its place.
      Mat big = again.mat(100, 100);
      EXPECT_EQ(big.extent(0), 100u);
      Kokkos::deep_copy(Kokkos::View<float**, Layout, MemSpace, Unmanaged>(big.data(), 100, 100),
                        1.0f);
      EXPECT_GT(ws.capacity(), 4096);
      Kokkos::deep_copy(Kokkos::View<float*, Layout, MemSpace, Unmanaged>(first, 100), 2.0f);
    }
  }
  const std::int64_t deepest = 768 + 512 + 512 + 40448;  // each rounded to 256, plus 256
  EXPECT_EQ(ws.high_water(), deepest);
  EXPECT_EQ(ws.capacity(), deepest);  // one allocation of the deepest stack
  {
    Workspace::Frame f(ws);
    f.floats(10000);  // fits now, no growth
    EXPECT_EQ(ws.capacity(), deepest);
    EXPECT_THROW(ws.reserve(std::int64_t(1) << 20), std::exception);  // not inside a frame
  }
  ws.reserve(std::int64_t(1) << 20);
  EXPECT_EQ(ws.capacity(), std::int64_t(1) << 20);
}

TEST(Comm, CountsAndGather) {
  Communicator c(MPI_COMM_WORLD, "test");
  const int P = c.size(), me = c.rank();
  std::vector<std::int64_t> send(2 * P), recv(2 * P);
  for (int p = 0; p < P; ++p) {
    send[2 * p] = me;
    send[2 * p + 1] = 10 * p;
  }
  c.all_to_all(send.data(), recv.data(), 2);
  for (int p = 0; p < P; ++p) {
    EXPECT_EQ(recv[2 * p], p);
    EXPECT_EQ(recv[2 * p + 1], 10 * me);
  }
  const auto all = c.all_gather(std::string(me, 'x'));
  for (int p = 0; p < P; ++p) EXPECT_EQ(all[p], std::string(p, 'x'));
}

TEST(Comm, PipelineNeighboursExchangeBothWays) {
  // Four stages all at once, as the trainer does it: each starts its sends to both neighbours
  // (activations forward, gradients backward), then receives from both, then completes the
  // sends. Messages above any eager limit, so a blocking send would deadlock here.
  Communicator c(MPI_COMM_WORLD, "pp", 30.0);
  const int me = c.rank(), P = c.size(), n = 1 << 16;
  View1F fwd("fwd", n), bwd("bwd", n), from_prev("from_prev", n), from_next("from_next", n);
  Kokkos::deep_copy(fwd, float(me));
  Kokkos::deep_copy(bwd, float(-me));
  const MpiDataPlane plane(c);  // as ProcessGrid builds it: staged on device memory
  const DataComm& d = plane.get();
  Pending to_next, to_prev;
  if (me + 1 < P) to_next = d.start_send(fwd.data(), n, me + 1);
  if (me > 0) to_prev = d.start_send(bwd.data(), n, me - 1);
  if (me + 1 < P) d.recv(from_next.data(), n, me + 1);
  if (me > 0) d.recv(from_prev.data(), n, me - 1);
  d.complete(to_next);
  d.complete(to_prev);
  if (me + 1 < P) {
    EXPECT_EQ(host(from_next.data(), n)[n - 1], float(-(me + 1)));
  }
  if (me > 0) {
    EXPECT_EQ(host(from_prev.data(), n)[0], float(me - 1));
  }
  // A ring with send_recv: everyone sends right and receives from the left at once.
  Pending ring = d.start_send_recv(fwd.data(), n, (me + 1) % P, from_prev.data(), n,
                                  (me + P - 1) % P);
  d.complete(ring);
  EXPECT_EQ(host(from_prev.data(), n)[n / 2], float((me + P - 1) % P));
}

TEST(Comm, MismatchedCollectivesAreAClearError) {
  // Rank 1 issues another kind of collective at the same position (a float sum where the
  // others sum integers; same size, so MPI itself moves the data): the arrival notices
  // disagree and every rank reports it.
  Communicator c(MPI_COMM_WORLD, "test");
  std::vector<float> f(2, 1.0f);
  std::vector<std::int32_t> k(2, 1);
  bool caught = false;
  try {
    if (c.rank() == 1)
      c.allreduce_sum(f.data(), 2);
    else
      c.allreduce_sum(k.data(), 2);
  } catch (const Error& e) {
    caught = std::string(e.what()).find("out of step") != std::string::npos;
  }
  int all = caught ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  EXPECT_EQ(all, 1) << "every rank reports the mismatch";
}

ModelCfg tiny_model() {
  ModelCfg m;
  m.d_model = 16;
  m.vocab_size = 40;
  m.init_std = 0.3;
  return m;
}

std::vector<float> random_vec(std::int64_t n, unsigned seed, float scale, float mean = 0.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = mean + scale * nd(gen);
  return v;
}

// Each rank routes its own tokens; ep = 4 ranks hold 2 of the 8 experts each. Experts 6 and 7
// are never chosen (their router rows push the logits down), so rank 3 receives no rows. The
// sharded layer runs its experts' GEMMs as `gemms` says; the one-rank layer per expert. In bf16
// the rows and the output gradients travel as bf16 (d_model 16), the same values the one-rank
// layer's products round.
void expert_parallel_matches_one_rank(ExpertGemm gemms, Precision precision = Precision::Fp32) {
  const RunContext ctx = make_run_context(precision);
  Communicator ep(MPI_COMM_WORLD, "ep");
  const int me = ep.rank(), N = 24, D = 16;
  ModelCfg m = tiny_model();
  MoeCfg e;
  e.experts = 8;
  e.top_k = 2;
  e.expert_hidden = 12;
  e.lb_coef = 0.1;
  e.z_coef = 0.01;
  TensorTable full, part;
  MoeLayer one(ctx, m, e, "moe.", N, full);
  MoeCfg e_sharded = e;
  e_sharded.expert_gemm = gemms;
  const MpiDataPlane ep_data(ep);  // as ProcessGrid builds it: staged on device memory
  MoeLayer sharded(ctx, m, e_sharded, "moe.", N, part, &ep, &ep_data.get());
  full.allocate();
  part.allocate();
  full.initialize(5);
  part.initialize(5);  // layout-independent: the same global values
  auto set_router = [&](TensorTable& t) {
    const int r = t.find("moe.router");
    auto w = host(t.param(r), 8 * D);
    for (int x = 6; x < 8; ++x)
      for (int d = 0; d < D; ++d) w[x * D + d] = -5.0f;
    fill(t.param(r), w);
  };
  set_router(full);
  set_router(part);
  View1F x("x", N * D), y1("y1", N * D), y2("y2", N * D), dy("dy", N * D);
  View1F dx1("dx1", N * D), dx2("dx2", N * D);
  fill(x.data(), random_vec(N * D, 11 + me, 0.5f, 1.0f));  // positive: experts 6, 7 lose
  fill(dy.data(), random_vec(N * D, 31 + me, 0.1f));
  Workspace s1, s2;
  one.forward(full, as_cmat(x.data(), N, D), as_mat(y1.data(), N, D), s1);
  sharded.forward(part, as_cmat(x.data(), N, D), as_mat(y2.data(), N, D), s2);
  const MoeStats a = one.report(), b = sharded.report();
  EXPECT_EQ(a.load, b.load);
  EXPECT_EQ(a.load[6] + a.load[7], 0);
  EXPECT_DOUBLE_EQ(a.lb, b.lb);
  // The same rows through the same experts; only the GEMMs' row blocks differ.
  EXPECT_LE(max_rel(host(y2.data(), N * D), host(y1.data(), N * D)), 1e-5);
  one.backward(full, as_cmat(x.data(), N, D), as_cmat(dy.data(), N, D), as_mat(dx1.data(), N, D),
               s1, 0.5f);
  sharded.backward(part, as_cmat(x.data(), N, D), as_cmat(dy.data(), N, D),
                   as_mat(dx2.data(), N, D), s2, 0.5f);
  EXPECT_LE(max_rel(host(dx2.data(), N * D), host(dx1.data(), N * D)), 1e-5);
  // The router gradient is this rank's own; an expert's gradient on its rank is the sum over
  // every rank's tokens of the single-rank layer's gradient.
  for (const char* name : {"moe.router", "moe.experts.w1", "moe.experts.w3", "moe.experts.w2"}) {
    const TensorEntry& f = full.entry(full.find(name));
    const TensorEntry& p = part.entry(part.find(name));
    auto gf = host(full.grad(full.find(name)), f.size);
    if (std::string(name) != "moe.router") ep.allreduce_sum(gf.data(), gf.size());
    const std::int64_t first = p.spec.row_begin * p.spec.row_elements();
    std::vector<float> slice(gf.begin() + first, gf.begin() + first + p.size);
    EXPECT_LE(max_rel(host(part.grad(part.find(name)), p.size), slice), 1e-5) << name;
    EXPECT_EQ(p.spec.row_begin, std::string(name) == "moe.router" ? 0 : 2 * me) << name;
  }
}

TEST(ExpertParallel, MatchesAllExpertsOnOneRank) {
  expert_parallel_matches_one_rank(ExpertGemm::PerExpert);
}

TEST(ExpertParallel, GroupedExpertGemmsMatchAllExpertsOnOneRank) {
  expert_parallel_matches_one_rank(ExpertGemm::Grouped);
}

TEST(ExpertParallel, Bf16MatchesAllExpertsOnOneRank) {
  expert_parallel_matches_one_rank(ExpertGemm::PerExpert, Precision::Bf16);
  expert_parallel_matches_one_rank(ExpertGemm::Grouped, Precision::Bf16);
}

TEST(EngramSharding, MatchesTheReplicatedTable) {
  // All 4 ranks hold row blocks of one table (parallel.engram_shard = stage); each looks up its
  // own tokens. Outputs and input gradients equal the replicated layer's; each rank's row block
  // of the table gradient is the sum over ranks of the replicated layer's.
  Communicator group(MPI_COMM_WORLD, "stage");
  const int me = group.rank(), T = 8, N = 2 * T, D = 16;
  ModelCfg m = tiny_model();
  EngramCfg g;
  g.layers = {0};
  g.max_ngram = 3;
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {11, 13};
  g.kernel = 3;
  g.init_std = 0.3;
  auto plans = engram_hash_plans(g, m.vocab_size);
  TensorTable full, part;
  EngramLayer one(RunContext(), m, g, plans[0], "e.", N, T, full);
  EngramSharding sh;
  sh.kind = Shard::Stage;
  const MpiDataPlane group_data(group);  // as ProcessGrid builds it: staged on device memory
  sh.comm = &group;
  sh.data = &group_data.get();
  EngramLayer sharded(RunContext(), m, g, plans[0], "e.", N, T, part, sh);
  full.allocate();
  part.allocate();
  full.initialize(3);
  part.initialize(3);
  View1F x("x", N * D), o1("o1", N * D), o2("o2", N * D), dout("dout", N * D);
  View1F dx1("dx1", N * D), dx2("dx2", N * D);
  fill(x.data(), random_vec(N * D, 7 + me, 1.0f));
  fill(dout.data(), random_vec(N * D, 17 + me, 0.1f));
  View1I tokens("tokens", N);
  {
    auto h = Kokkos::create_mirror_view(tokens);
    std::mt19937 gen(100 + me);
    for (int i = 0; i < N; ++i) h(i) = gen() % m.vocab_size;
    Kokkos::deep_copy(tokens, h);
  }
  const ConstIVec tok(tokens.data(), N);
  one.forward(full, as_cmat(x.data(), N, D), tok, as_mat(o1.data(), N, D));
  sharded.forward(part, as_cmat(x.data(), N, D), tok, as_mat(o2.data(), N, D));
  EXPECT_EQ(host(o2.data(), N * D), host(o1.data(), N * D));  // the same rows, bit for bit
  Workspace ws;
  one.backward(full, as_cmat(x.data(), N, D), as_cmat(dout.data(), N, D), as_mat(dx1.data(), N, D),
               ws);
  sharded.backward(part, as_cmat(x.data(), N, D), as_cmat(dout.data(), N, D),
                   as_mat(dx2.data(), N, D), ws);
  EXPECT_EQ(host(dx2.data(), N * D), host(dx1.data(), N * D));
  const TensorEntry& f = full.entry(full.find("e.table"));
  const TensorEntry& p = part.entry(part.find("e.table"));
  EXPECT_EQ(p.spec.shard, Shard::Stage);
  auto gf = host(full.grad(full.find("e.table")), f.size);
  group.allreduce_sum(gf.data(), gf.size());
  const std::int64_t first = p.spec.row_begin * p.spec.row_elements();
  std::vector<float> slice(gf.begin() + first, gf.begin() + first + p.size);
  EXPECT_LE(max_rel(host(part.grad(part.find("e.table")), p.size), slice), 1e-6);
  // The blocks tile the table: sizes summed over the ranks give every row once.
  std::int64_t rows = p.spec.local_rows();
  MPI_Allreduce(MPI_IN_PLACE, &rows, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(rows, p.spec.global_rows());
}

// The memory check's per-rank share with experts over 4 ep ranks and Engram rows over 4
// holders: exactly what each rank's Stage declares (the last rank's row block may be shorter,
// so the estimate is at least its table and at most one row block more).
TEST(RankShare, ExpertsAndEngramRowsSplitOverTheGroup) {
  Communicator group(MPI_COMM_WORLD, "ep", 60.0);
  const int P = group.size();
  ModelCfg m = tiny_model();
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 2;
  m.ffn_hidden = 24;
  MoeCfg e;
  e.experts = 8;
  e.top_k = 2;
  e.expert_hidden = 12;
  e.dense_layers = {0};
  EngramCfg g;
  g.layers = {1};
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {11, 13};
  LayerComms comms;
  const MpiDataPlane group_data(group);  // as ProcessGrid builds it: staged on device memory
  comms.ep = &group;
  comms.ep_data = &group_data.get();
  comms.engram = &group;
  comms.engram_data = &group_data.get();
  comms.engram_shard = Shard::Stage;
  TensorTable table;
  Stage stage(RunContext(), m, e, 2, 8, table, g, StagePlan::whole(), comms);
  RankShare r;
  r.first_block = 0;
  r.last_block = 2;
  r.ep = P;
  r.engram_members = P;
  const RankMemory mem = rank_memory(m, e, g, 2, 8, r);
  const auto plans = engram_hash_plans(g, m.vocab_size);
  const std::int64_t block_rows = (plans[0].rows + P - 1) / P, dh = g.embed_per_ngram / g.heads;
  EXPECT_GE(mem.elements, table.total_elements());
  EXPECT_LE(mem.elements, table.total_elements() + block_rows * dh);
  if (group.rank() == 0) {
    EXPECT_EQ(mem.elements, table.total_elements());  // a full row block
  }
}

// The agreement helpers every rank-0-only file operation goes through: the first message in
// member order reaches every member; an error on member 0 is every member's SharedError.
TEST(Agreement, FirstMessageAndOnRoot) {
  Communicator world(MPI_COMM_WORLD, "world", 60.0);
  const int me = world.rank();
  EXPECT_EQ(world.first_message(""), "");
  EXPECT_EQ(world.first_message(me >= 1 ? "from " + std::to_string(me) : ""),
            world.size() > 1 ? "from 1" : "");
  int ran = 0;
  world.on_root([&] { ++ran; });
  EXPECT_EQ(ran, me == 0 ? 1 : 0);
  try {
    world.on_root([] { KMOE_FAIL("disk full on the root"); });
    ADD_FAILURE() << "no error";
  } catch (const SharedError& e) {
    EXPECT_STREQ(e.what(), "disk full on the root");
  }
}

}  // namespace
}  // namespace kmoe
