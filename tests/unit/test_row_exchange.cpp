// RowExchange (src/parallel/row_exchange.hpp) at 1, 2 and 4 ranks: rows reach their destinations
// source-major in sending order, reverse() returns each answer to its original row, bf16 rows
// travel bit for bit, grouped plans carry the block counts, and members that send or receive
// nothing take part like the others.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/error.hpp"
#include "parallel/row_exchange.hpp"
#include "parallel/staged_comm.hpp"

namespace kmoe {
namespace {

template <class T>
Kokkos::View<T*, Layout, MemSpace> device(const std::vector<T>& h) {
  Kokkos::View<T*, Layout, MemSpace> v("v", h.size());
  auto m = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < h.size(); ++i) m(i) = h[i];
  Kokkos::deep_copy(v, m);
  return v;
}

template <class V>
std::vector<typename V::value_type> host(const V& v, std::int64_t n) {
  auto m = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
  return std::vector<typename V::value_type>(m.data(), m.data() + n);
}

float value(int r, int i, int c) { return 1000.0f * r + 10.0f * i + c; }

// A bf16 bit pattern per (rank, row, column); column 0 pairs with column 1 into a 4-byte word
// that is a signalling NaN as fp32, column 2 is a NaN, column 3 anything: nothing may convert.
std::uint16_t bits(int r, int i, int c) {
  switch (c) {
    case 0: return static_cast<std::uint16_t>(0x0001 + r * 64 + i);
    case 1: return 0x7F81;
    case 2: return static_cast<std::uint16_t>(0xFFC0 | (i & 0x3F));
    default: return static_cast<std::uint16_t>((r * 977 + i * 131 + c * 7919) & 0xFFFF);
  }
}

// Who sends what: rows(r) local rows on rank r, row i going to member dest(r, i).
struct Scenario {
  const char* what;
  std::function<int(int r)> rows;
  std::function<int(int r, int i)> dest;
};

// Plans `ex` for the scenario, forwards ids and rows, checks what arrived (source-major, each
// source's rows in local order), answers each row and checks every answer lands on its row.
void exchange_and_answer(RowExchange& ex, const Scenario& sc, int P, int me) {
  SCOPED_TRACE(sc.what);
  const int W = 3, n = sc.rows(me);
  std::vector<int> dest(n), ids(n);
  std::vector<float> rows(std::size_t(n) * W);
  for (int i = 0; i < n; ++i) {
    dest[i] = sc.dest(me, i);
    ids[i] = me * 100 + i;
    for (int c = 0; c < W; ++c) rows[i * W + c] = value(me, i, c);
  }
  auto d_dest = device(dest.empty() ? std::vector<int>(1) : dest);
  auto d_ids = device(ids.empty() ? std::vector<int>(1) : ids);
  auto d_rows = device(rows.empty() ? std::vector<float>(W) : rows);
  ex.plan(ConstIVec(d_dest.data(), n), n);

  std::vector<int> want_ids;
  std::vector<float> want_rows;
  for (int q = 0; q < P; ++q)
    for (int i = 0; i < sc.rows(q); ++i)
      if (sc.dest(q, i) == me) {
        want_ids.push_back(q * 100 + i);
        for (int c = 0; c < W; ++c) want_rows.push_back(value(q, i, c));
      }
  const int m = static_cast<int>(want_ids.size());
  EXPECT_EQ(ex.rows_sent(), n);
  ASSERT_EQ(ex.rows_received(), m);
  for (int q = 0; q < P; ++q) {
    int from_q = 0;
    for (int i = 0; i < sc.rows(q); ++i) from_q += sc.dest(q, i) == me;
    EXPECT_EQ(ex.received_blocks()[q], from_q) << "from " << q;
  }
  View1I got_ids("got_ids", std::max(m, 1));
  View1F got_rows("got_rows", std::max(m, 1) * W);
  ex.forward(d_ids.data(), got_ids.data(), 1);
  ex.forward(d_rows.data(), got_rows.data(), W);
  EXPECT_EQ(host(got_ids, m), want_ids);
  EXPECT_EQ(host(got_rows, std::int64_t(m) * W), want_rows);

  // bf16 rows (4 wide) arrive bit for bit; an odd width cannot travel as word pairs.
  const int W16 = 4;
  std::vector<std::uint16_t> rows16(std::max(n, 1) * W16), want16;
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < W16; ++c) rows16[i * W16 + c] = bits(me, i, c);
  for (int q = 0; q < P; ++q)
    for (int i = 0; i < sc.rows(q); ++i)
      if (sc.dest(q, i) == me)
        for (int c = 0; c < W16; ++c) want16.push_back(bits(q, i, c));
  auto d_rows16 = device(rows16);
  Kokkos::View<std::uint16_t*, Layout, MemSpace> got16("got16", std::max(m, 1) * W16);
  ex.forward(d_rows16.data(), got16.data(), W16);
  EXPECT_EQ(host(got16, std::int64_t(m) * W16), want16);
  EXPECT_THROW(ex.forward(d_rows16.data(), got16.data(), 3), Error);

  // Answers: each received row negated and tagged with the answering member; back in place.
  auto answers = host(got_rows, std::int64_t(m) * W);
  for (auto& a : answers) a = -a + 0.5f * me;
  auto d_answers = device(answers.empty() ? std::vector<float>(W) : answers);
  View1F back("back", std::max(n, 1) * W);
  ex.reverse(d_answers.data(), back.data(), W);
  const auto b = host(back, std::int64_t(n) * W);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < W; ++c)
      EXPECT_EQ(b[i * W + c], -value(me, i, c) + 0.5f * dest[i]) << "row " << i << " col " << c;
}

TEST(RowExchange, RowsReachTheirDestinationsAndAnswersComeBack) {
  Communicator comm(MPI_COMM_WORLD, "exchange", 60.0);
  const int P = comm.size(), me = comm.rank();
  // Rank 1 sends nothing; with more than 2 members nobody sends to the last one.
  const Scenario spread{"spread", [P](int r) { return P > 1 && r == 1 ? 0 : 5 + 3 * r; },
                        [P](int r, int i) { return (i * 7 + r * 3) % (P > 2 ? P - 1 : P); }};
  // Twice as many rows (the plan and the buffers grow), all to member 0: the others receive
  // nothing.
  const Scenario to_first{"all to member 0", [](int r) { return 11 + 6 * r; },
                          [](int, int) { return 0; }};
  const MpiDataPlane data(comm);  // as ProcessGrid builds it: staged on device memory
  RowExchange ex(comm, data.get(), "test");
  exchange_and_answer(ex, spread, P, me);
  exchange_and_answer(ex, to_first, P, me);
  exchange_and_answer(ex, spread, P, me);  // and back to a smaller plan
  if (P > 2 && me == P - 1) {
    EXPECT_EQ(ex.rows_received(), 0);
  }
}

TEST(RowExchange, GroupedRowsCarryTheirBlockCounts) {
  // Rows already grouped by (destination, block), K = 2 blocks per member; block (q, b) of rank
  // r has (r + q + b) % 3 rows, so some blocks and some whole transfers are empty.
  Communicator comm(MPI_COMM_WORLD, "exchange", 60.0);
  const int P = comm.size(), me = comm.rank(), K = 2, W = 2;
  auto block = [](int r, int q, int b) { return (r + q + b) % 3; };
  std::vector<std::int64_t> counts;
  std::vector<float> rows;
  for (int q = 0; q < P; ++q)
    for (int b = 0; b < K; ++b) {
      counts.push_back(block(me, q, b));
      for (int i = 0; i < block(me, q, b); ++i)
        for (int c = 0; c < W; ++c) rows.push_back(value(me, 10 * q + b, 10 * i + c));
    }
  const std::int64_t n = rows.size() / W;
  auto d_rows = device(rows.empty() ? std::vector<float>(W) : rows);
  const MpiDataPlane data(comm);  // as ProcessGrid builds it: staged on device memory
  RowExchange ex(comm, data.get(), "test");
  ex.plan_grouped(counts, K);
  std::vector<float> want;
  for (int q = 0; q < P; ++q)
    for (int b = 0; b < K; ++b) {
      EXPECT_EQ(ex.received_blocks()[q * K + b], block(q, me, b)) << q << " " << b;
      for (int i = 0; i < block(q, me, b); ++i)
        for (int c = 0; c < W; ++c) want.push_back(value(q, 10 * me + b, 10 * i + c));
    }
  EXPECT_EQ(ex.rows_sent(), n);
  ASSERT_EQ(ex.rows_received(), std::int64_t(want.size()) / W);
  View1F got("got", std::max<std::size_t>(want.size(), 1));
  ex.forward(d_rows.data(), got.data(), W);
  EXPECT_EQ(host(got, want.size()), want);
  View1F back("back", std::max<std::size_t>(rows.size(), 1));
  ex.reverse(got.data(), back.data(), W);
  EXPECT_EQ(host(back, rows.size()), rows);
}

TEST(RowExchange, RefusesAMismatchedDataPlane) {
  Communicator world(MPI_COMM_WORLD, "world", 60.0);
  Communicator self(MPI_COMM_SELF, "self", 60.0);
  if (world.size() == 1) GTEST_SKIP() << "needs two groups of different sizes";
  const MpiDataPlane self_data(self);
  EXPECT_THROW(RowExchange(world, self_data.get(), "test"), Error);
}

}  // namespace
}  // namespace kmoe
