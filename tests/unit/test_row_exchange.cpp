// RowExchange (src/parallel/row_exchange.hpp) at 1, 2 and 4 ranks: rows reach their
// destinations source-major in sending order, reverse() returns each answer to its original
// row, grouped plans carry the block counts, and members that send or receive nothing take
// part like the others.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.hpp"
#include "parallel/row_exchange.hpp"

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

// Rank r's local rows: n(r) of them (rank 1 has none when P > 1), row i going to dest(r, i).
// Nobody sends to the last member when P > 2, so it receives nothing.
int rows_of(int r, int P) { return P > 1 && r == 1 ? 0 : 5 + 3 * r; }
int dest_of(int r, int i, int P) {
  const int targets = P > 2 ? P - 1 : P;
  return (i * 7 + r * 3) % targets;
}
float value(int r, int i, int c) { return 1000.0f * r + 10.0f * i + c; }

TEST(RowExchange, RowsReachTheirDestinationsAndAnswersComeBack) {
  Communicator comm(MPI_COMM_WORLD, "exchange", 60.0);
  const int P = comm.size(), me = comm.rank(), W = 3;
  const int n = rows_of(me, P);
  std::vector<int> dest(n), ids(n);
  std::vector<float> rows(std::size_t(n) * W);
  for (int i = 0; i < n; ++i) {
    dest[i] = dest_of(me, i, P);
    ids[i] = me * 100 + i;
    for (int c = 0; c < W; ++c) rows[i * W + c] = value(me, i, c);
  }
  auto d_dest = device(dest);
  auto d_ids = device(ids);
  auto d_rows = device(rows);
  RowExchange ex(comm, comm, "test");
  ex.plan(ConstIVec(d_dest.data(), n), n);

  // What must arrive: source-major, each source's rows to me in its local order.
  std::vector<int> want_ids;
  std::vector<float> want_rows;
  for (int q = 0; q < P; ++q)
    for (int i = 0; i < rows_of(q, P); ++i)
      if (dest_of(q, i, P) == me) {
        want_ids.push_back(q * 100 + i);
        for (int c = 0; c < W; ++c) want_rows.push_back(value(q, i, c));
      }
  const int m = static_cast<int>(want_ids.size());
  EXPECT_EQ(ex.rows_sent(), n);
  ASSERT_EQ(ex.rows_received(), m);
  if (P > 2 && me == P - 1) {
    EXPECT_EQ(m, 0);  // nobody sends to the last member
  }
  for (int q = 0; q < P; ++q) {
    int from_q = 0;
    for (int i = 0; i < rows_of(q, P); ++i) from_q += dest_of(q, i, P) == me;
    EXPECT_EQ(ex.received_blocks()[q], from_q) << "from " << q;
  }

  View1I got_ids("got_ids", std::max(m, 1));
  View1F got_rows("got_rows", std::max(m, 1) * W);
  ex.forward(d_ids.data(), got_ids.data(), 1);
  ex.forward(d_rows.data(), got_rows.data(), W);
  EXPECT_EQ(host(got_ids, m), want_ids);
  EXPECT_EQ(host(got_rows, std::int64_t(m) * W), want_rows);

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
  RowExchange ex(comm, comm, "test");
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
  EXPECT_THROW(RowExchange(world, self, "test"), Error);
}

}  // namespace
}  // namespace kmoe
