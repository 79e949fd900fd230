// StepStats (src/core/step_stats.hpp), the layers' step statistics: declarations, the finish
// rules, host and device accumulators, counters, console summaries; every Stage declares the
// whole model's columns in metrics.csv order; the metrics writer's header and compact line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/error.hpp"
#include "core/step_stats.hpp"
#include "io/metrics.hpp"
#include "modules/model/stage.hpp"

namespace kmoe {
namespace {

// Kernels outside the TEST bodies (a device lambda may not sit in a private member function).
void add_on_device(Kokkos::View<double*, Layout, MemSpace, Unmanaged> v, double x) {
  Kokkos::parallel_for(
      "test::add", Range(0, 1), KOKKOS_LAMBDA(int) { v(0) += x; });
}
void count_mod3_on_device(IVec c, int n) {
  Kokkos::parallel_for(
      "test::count", Range(0, n), KOKKOS_LAMBDA(int i) { Kokkos::atomic_add(&c(i % 3), 1); });
}

TEST(StepStats, DeclaringAgainFindsTheColumnAndMismatchesAreErrors) {
  StepStats s;
  const int a = s.add(StatColumn::mean_per_micro_batch("a"));
  const int b = s.add(StatColumn::max_over_mean("b", 4));
  EXPECT_EQ(s.add(StatColumn::mean_per_micro_batch("a")), a);
  EXPECT_EQ(s.add(StatColumn::max_over_mean("b", 4)), b);
  EXPECT_EQ(s.size(), 2);
  EXPECT_THROW(s.add(StatColumn::max_over_mean("b", 5)), Error);
  EXPECT_THROW(s.add(StatColumn::sum("a")), Error);
  EXPECT_THROW(s.add(StatColumn::fraction_of("c", "nothing")), Error);
  EXPECT_EQ(s.num_sums(), 5);
  EXPECT_EQ(s.names(), (std::vector<std::string>{"a", "b"}));
}

TEST(StepStats, FinishRules) {
  StepStats s;
  const int mean = s.add(StatColumn::mean_per_micro_batch("mean"));
  const int load = s.add(StatColumn::max_over_mean("load", 3));
  const int idle = s.add(StatColumn::max_over_mean("idle", 2));
  const int drop = s.add(StatColumn::fraction_of("drop", "load"));
  const int sum = s.add(StatColumn::sum("sum"));
  s.begin_step();
  s.host(mean)[0] += 1.5;
  s.host(mean)[0] += 4.5;
  double* l = s.host(load);
  l[0] = 1;
  l[1] = 3;
  l[2] = 2;
  s.host(drop)[0] = 1.5;
  s.host(sum)[0] = 0.25;
  const auto f = s.finish(3);
  ASSERT_EQ(f.size(), 5u);
  EXPECT_EQ(f[mean], std::make_pair(std::string("mean"), 2.0));
  EXPECT_DOUBLE_EQ(f[load].second, 3.0 / (6.0 / 3));
  EXPECT_EQ(f[idle].second, 0.0);  // no assignments at all
  EXPECT_DOUBLE_EQ(f[drop].second, 1.5 / 6.0);
  EXPECT_EQ(f[sum].second, 0.25);
  s.begin_step();
  for (const auto& [name, value] : s.finish(3)) EXPECT_EQ(value, 0.0) << name;
}

TEST(StepStats, DeviceAccumulatorsAndCountersAreGatheredAndReset) {
  StepStats s;
  const int g = s.add(StatColumn::mean_per_micro_batch("gate"));
  const int t = s.add(StatColumn::sum("touched"));
  s.begin_step();
  s.host(g)[0] = 1.0;
  add_on_device(s.device(g), 0.5);
  auto c = s.counters(t, 7);
  EXPECT_EQ(s.counters(t, 7).data(), c.data());  // every instance counts into the same rows
  EXPECT_THROW(s.counters(t, 8), Error);
  count_mod3_on_device(c, 10);
  s.gather_device();
  EXPECT_EQ(s.host(g)[0], 1.5);
  auto hc = Kokkos::create_mirror_view_and_copy(HostSpace(), c);
  EXPECT_EQ(hc(0), 4);
  EXPECT_EQ(hc(2), 3);
  EXPECT_EQ(hc(3), 0);
  s.begin_step();
  s.gather_device();
  EXPECT_EQ(s.host(g)[0], 0.0);
  hc = Kokkos::create_mirror_view_and_copy(HostSpace(), c);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(hc(i), 0) << i;
}

TEST(StepStats, SummariesTakeTheMaxOrTheMeanOverTheirColumns) {
  StepStats s;
  s.add(StatColumn::mean_per_micro_batch("g1").summarized("engram gate", StatSummary::Mean));
  s.add(StatColumn::max_over_mean("l1", 1).summarized("moe load", StatSummary::Max));
  s.add(StatColumn::mean_per_micro_batch("g2").summarized("engram gate", StatSummary::Mean));
  s.add(StatColumn::max_over_mean("l2", 1).summarized("moe load", StatSummary::Max));
  s.add(StatColumn::sum("plain"));
  const std::vector<std::pair<std::string, double>> finished = {
      {"g1", 0.25}, {"l1", 3.0}, {"g2", 0.75}, {"l2", 1.5}, {"plain", 9.0}};
  const auto sum = s.summaries(finished);
  ASSERT_EQ(sum.size(), 2u);
  EXPECT_EQ(sum[0], std::make_pair(std::string("engram gate"), 0.5));
  EXPECT_EQ(sum[1], std::make_pair(std::string("moe load"), 3.0));
}

// Every rank must declare the same columns whatever blocks its stage holds (the world's sum
// has one size): a last stage holding blocks 2..3 declares blocks 0..3's columns, MoE first.
TEST(StepStats, EveryStageDeclaresTheWholeModelsColumns) {
  ModelCfg m;
  m.vocab_size = 40;
  m.d_model = 16;
  m.n_layers = 4;
  m.n_heads = 2;
  m.n_kv_heads = 2;
  m.ffn_hidden = 24;
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 8;
  e.dense_layers = {0};
  e.capacity_factor = 1.0;
  EngramCfg g;
  g.layers = {2, 1};
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {11, 13};
  const std::vector<std::string> want = {"moe1_lb",
                                         "moe1_rz",
                                         "moe1_load_max_mean",
                                         "moe1_drop",
                                         "moe2_lb",
                                         "moe2_rz",
                                         "moe2_load_max_mean",
                                         "moe2_drop",
                                         "moe3_lb",
                                         "moe3_rz",
                                         "moe3_load_max_mean",
                                         "moe3_drop",
                                         "engram1_gate",
                                         "engram1_rows_touched",
                                         "engram2_gate",
                                         "engram2_rows_touched"};
  for (const auto& [first, last] : {std::pair{0, 2}, std::pair{2, 4}, std::pair{0, 4}}) {
    StagePlan plan;
    plan.first_block = first;
    plan.last_block = last;
    plan.embed = first == 0;
    plan.head = last == 4;
    TensorTable table;
    StepStats stats;
    Stage stage(RunContext(), m, e, 1, 8, table, g, plan, LayerComms(), &stats);
    EXPECT_EQ(stats.names(), want) << "blocks " << first << ".." << last;
    EXPECT_EQ(stats.num_sums(), 3 * (1 + 1 + 4 + 1) + 2 * 2);
  }
}

TEST(Metrics, CsvColumnsThenLayerColumnsThenCommAndAConsoleLineWithSummaries) {
  const std::string dir =
      std::filesystem::temp_directory_path() / ("kmoe-metrics-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  StepMetrics m;
  m.step = 7;
  m.loss = 2.5;
  m.comm_s = 0.125;
  for (int l = 0; l < 16; ++l)
    m.layer_stats.emplace_back("moe" + std::to_string(l) + "_load_max_mean", 1.0 + l);
  m.summaries = {{"moe load max/mean", 16.0}, {"engram gate", 0.5}};
  {
    MetricsWriter w(dir, false, {"moe0_load_max_mean", "moe1_load_max_mean"});
    m.layer_stats.resize(2);
    w.write(m);
  }
  std::ifstream in(dir + "/metrics.csv");
  std::string header, row;
  std::getline(in, header);
  std::getline(in, row);
  EXPECT_EQ(header, std::string(MetricsWriter::csv_header()) +
                        ",moe0_load_max_mean,moe1_load_max_mean,comm_s");
  const std::string tail = ",1,2,0.125";
  EXPECT_TRUE(row.size() > tail.size() &&
              row.compare(row.size() - tail.size(), tail.size(), tail) == 0)
      << row;
  const std::string line = MetricsWriter::console_line(m);
  EXPECT_NE(line.find("moe load max/mean 16.000"), std::string::npos) << line;
  EXPECT_NE(line.find("engram gate 0.500"), std::string::npos) << line;
  EXPECT_EQ(line.find("moe0_"), std::string::npos) << line;
  EXPECT_LT(line.size(), 240u) << line;
  std::filesystem::remove_all(dir);
}

// A resume appends after the rows it keeps: a last row cut short (a full disk, a kill) and the
// rows after the resumed step go.
TEST(Metrics, AResumeDropsACutRowAndTheRowsAfterItsStep) {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("kmoe-metrics-resume-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/metrics.csv");
    f << "step,loss\n1,a\n2,b\n3,c\n4,d\n5,e";  // row 5 cut short
  }
  { MetricsWriter w(dir, true, {}, 3); }
  std::ifstream in(dir + "/metrics.csv");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "step,loss\n1,a\n2,b\n3,c\n");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kmoe
