// Engram addressing (MODEL.md section 4, steps 1-6): golden values computed independently by
// tests/reference/engram_hash_reference.py (regenerate: /usr/bin/python3
// tests/reference/engram_hash_reference.py), and the facts the spec states.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "modules/engram/engram_hash.hpp"

namespace kmoe {
namespace {

// config: V' = 320 (identity), N = 3, K = 4, table_size 1600 per order, seed 0, layers {1, 3}.
EngramCfg golden_cfg() {
  EngramCfg c;
  c.layers = {3, 1};  // unsorted on purpose: primes are drawn in increasing block order
  c.max_ngram = 3;
  c.heads = 4;
  c.table_size = {1600, 1600};
  c.seed = 0;
  c.pad_id = 0;
  return c;
}

const std::vector<int> kHello = {72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100};

std::vector<std::vector<int>> rows_of(const EngramHashPlan& plan, const EngramCfg& c,
                                      const std::vector<int>& tokens, int T, int pad) {
  EngramHasher hasher(plan, c.max_ngram, c.heads, pad);
  View1I dev("tokens", tokens.size());
  auto h = Kokkos::create_mirror_view(dev);
  for (std::size_t i = 0; i < tokens.size(); ++i) h(i) = tokens[i];
  Kokkos::deep_copy(dev, h);
  Kokkos::View<int**, Layout, MemSpace> rows("rows", tokens.size(), hasher.heads_total());
  hasher.rows(ConstIVec(dev.data(), tokens.size()), T, rows);
  auto hr = Kokkos::create_mirror_view_and_copy(HostSpace(), rows);
  std::vector<std::vector<int>> out(tokens.size(), std::vector<int>(hasher.heads_total()));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    for (int j = 0; j < hasher.heads_total(); ++j) out[i][j] = hr(i, j);
  return out;
}

TEST(EngramHash, GoldenMultipliersAndModuli) {
  const auto plans = engram_hash_plans(golden_cfg(), 320);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].layer, 1);
  EXPECT_EQ(
      plans[0].multipliers,
      (std::vector<std::uint64_t>{4613788058582655ull, 19701431026589519ull, 1876694149391263ull}));
  EXPECT_EQ(
      plans[1].multipliers,
      (std::vector<std::uint64_t>{1700078423239473ull, 16049148799352551ull, 8168503084605559ull}));
  EXPECT_EQ(plans[0].primes,
            (std::vector<std::int64_t>{1601, 1607, 1609, 1613, 1619, 1621, 1627, 1637}));
  EXPECT_EQ(plans[0].offsets,
            (std::vector<std::int64_t>{0, 1601, 3208, 4817, 6430, 8049, 9670, 11297}));
  EXPECT_EQ(plans[0].rows, 12934);
  EXPECT_EQ(plans[1].primes,
            (std::vector<std::int64_t>{1657, 1663, 1667, 1669, 1693, 1697, 1699, 1709}));
  EXPECT_EQ(plans[1].rows, 13454);
}

TEST(EngramHash, GoldenRowIndices) {
  const EngramCfg c = golden_cfg();
  const auto plans = engram_hash_plans(c, 320);
  const int expected[12][8] = {
      {202, 2711, 4559, 5338, 7535, 9128, 9943, 11502},
      {1285, 2611, 4672, 5188, 7881, 8988, 9675, 11392},
      {1299, 3146, 4396, 5692, 7869, 9156, 10251, 12062},
      {996, 1674, 3215, 6326, 7737, 8979, 10485, 12500},
      {499, 2422, 3476, 4893, 7585, 9008, 10798, 11785},
      {1027, 2139, 4606, 5821, 7219, 8816, 10076, 12718},
      {1313, 2685, 4746, 5776, 7654, 9393, 11080, 12770},
      {533, 1783, 4549, 5756, 6867, 8276, 10385, 12519},
      {260, 2430, 4046, 5058, 6668, 8810, 11187, 12112},
      {1078, 1680, 4615, 4932, 6933, 9293, 10974, 12916},
      {1400, 2859, 3811, 5074, 7833, 9612, 11227, 12876},
      {314, 3178, 3925, 4960, 6874, 8579, 10749, 11317},
  };
  const auto rows = rows_of(plans[0], c, kHello, 12, c.pad_id);
  for (int t = 0; t < 12; ++t)
    for (int j = 0; j < 8; ++j) EXPECT_EQ(rows[t][j], expected[t][j]) << "t " << t << " j " << j;
}

TEST(EngramHash, MultipliersOddAndBelowTheBound) {
  for (std::int64_t v : {2, 320, 50304, 1000003})
    for (int layer : {0, 1, 7})
      for (std::uint64_t m : engram_multipliers(12345, layer, 5, v)) {
        EXPECT_EQ(m % 2, 1u);
        EXPECT_LT(m, 9223372036854775807ull / std::uint64_t(v));
      }
}

TEST(EngramHash, ModuliPrimeUniqueAndIncreasingWithinAnOrder) {
  EngramCfg c;
  c.layers = {0, 2, 5};
  c.max_ngram = 4;
  c.heads = 6;
  c.table_size = {100, 50, 100};  // orders overlap: primes must still be distinct
  std::set<std::int64_t> all;
  for (const auto& p : engram_hash_plans(c, 64)) {
    ASSERT_EQ(p.primes.size(), 18u);
    for (std::size_t j = 0; j < p.primes.size(); ++j) {
      const std::int64_t q = p.primes[j];
      for (std::int64_t d = 2; d * d <= q; ++d) ASSERT_NE(q % d, 0) << q;
      EXPECT_TRUE(all.insert(q).second) << q << " used twice";
      if (j % 6 != 0) {
        EXPECT_GT(q, p.primes[j - 1]);
      }
      EXPECT_GT(q, c.table_size[j / 6] - 1);
    }
  }
}

// Rows depend only on the current and previous tokens of the same sequence: changing x[t+1]
// leaves rows at <= t; changing x[t-2] moves only the 3-gram heads at t; sequences restart.
TEST(EngramHash, CausalPerSequenceAndInRange) {
  EngramCfg c = golden_cfg();
  c.pad_id = 7;
  const auto plans = engram_hash_plans(c, 320);
  std::vector<int> two = kHello;
  two.insert(two.end(), kHello.begin(), kHello.end());  // two sequences of T = 12
  const auto base = rows_of(plans[0], c, two, 12, c.pad_id);
  for (int t = 0; t < 24; ++t)
    for (int j = 0; j < 8; ++j) {
      EXPECT_GE(base[t][j], plans[0].offsets[j]);
      EXPECT_LT(base[t][j], plans[0].offsets[j] + plans[0].primes[j]);
      EXPECT_EQ(base[t][j], base[t % 12][j]) << "sequence 2 restarts its n-grams";
    }
  std::vector<int> changed = two;
  changed[6] = 200;  // x[6]
  const auto r = rows_of(plans[0], c, changed, 12, c.pad_id);
  for (int t = 0; t < 6; ++t) EXPECT_EQ(r[t], base[t]) << "the future never changes the past";
  for (int j = 0; j < 4; ++j) EXPECT_EQ(r[8][j], base[8][j]) << "x[t-2] is outside the 2-gram";
  bool moved = false;
  for (int j = 4; j < 8; ++j) moved = moved || r[8][j] != base[8][j];
  EXPECT_TRUE(moved) << "x[t-2] is inside the 3-gram";
  // The pad enters before the sequence start.
  const auto other_pad = rows_of(plans[0], c, two, 12, 9);
  EXPECT_NE(other_pad[0], base[0]);
  EXPECT_EQ(other_pad[2], base[2]);
}

// engram.compression_map: a headerless uint32 file of V canonical ids; V' = 1 + the largest.
TEST(EngramHash, CompressionMapFile) {
  EngramCfg c;
  EXPECT_EQ(load_engram_compression(c, 40).vocab_c, 40);
  EXPECT_EQ(load_engram_compression(c, 40).map[17], 17);
  const std::string path = "/tmp/kmoe_compress_" + std::to_string(::getpid()) + ".bin";
  auto write = [&](int n) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    for (std::uint32_t v = 0; v < std::uint32_t(n); ++v) {
      const std::uint32_t id = v % 10;
      std::fwrite(&id, 4, 1, f);
    }
    std::fclose(f);
  };
  write(40);
  c.compression_map = path;
  const EngramCompression comp = load_engram_compression(c, 40);
  EXPECT_EQ(comp.vocab_c, 10);
  EXPECT_EQ(comp.map[23], 3);
  write(39);
  try {
    load_engram_compression(c, 40);
    ADD_FAILURE() << "a short map must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("engram.compression_map = " + path + " holds 39 ids"),
              std::string::npos)
        << e.what();
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kmoe
