#include "parallel/row_exchange.hpp"

#include <numeric>

#include "core/buffers.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {
// Row ids travel through the float data plane bit for bit (4-byte items; nothing converts).
static_assert(sizeof(int) == sizeof(float), "row ids travel as 4-byte words");
const float* as_words(const int* p) { return reinterpret_cast<const float*>(p); }
float* as_words(int* p) { return reinterpret_cast<float*>(p); }
// bf16 values travel in pairs, one 4-byte word each.
const float* as_words(const std::uint16_t* p) { return reinterpret_cast<const float*>(p); }
float* as_words(std::uint16_t* p) { return reinterpret_cast<float*>(p); }

std::int64_t total(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t(0));
}
}  // namespace

RowExchange::RowExchange(const Communicator& control, const DataComm& data, std::string name)
    : control_(control), data_(data), name_(std::move(name)), P_(control.size()) {
  KMOE_REQUIRE(data.size() == control.size() && data.rank() == control.rank(),
               name_ << ": the data plane (" << data.size() << " members, rank " << data.rank()
                     << ") is not the group of its communicator (" << control.size()
                     << " members, rank " << control.rank() << ")");
  send_rows_.assign(P_, 0);
  recv_rows_.assign(P_, 0);
}

void RowExchange::plan(ConstIVec dest, int n) {
  grouped_ = false;
  if (by_dest_.offsets.extent(0) == 0 || int(by_dest_.order.extent(0)) < n)
    by_dest_ = KeyBuckets(std::max(1, n + n / 4), P_);
  by_dest_.build(ConstIVec(dest.data(), n));
  auto off = read_to_host("row exchange counts", by_dest_.offsets);
  for (int q = 0; q < P_; ++q) send_rows_[q] = off(q + 1) - off(q);
  control_.all_to_all(send_rows_.data(), recv_rows_.data(), 1);
  recv_blocks_ = recv_rows_;
  sent_ = n;
  received_ = total(recv_rows_);
}

void RowExchange::plan_grouped(const std::vector<std::int64_t>& block_rows, int blocks_per_member) {
  const int K = blocks_per_member;
  KMOE_REQUIRE(K >= 1 && block_rows.size() == std::size_t(P_) * K,
               name_ << ": " << block_rows.size() << " block counts for " << P_ << " members of "
                     << K << " blocks");
  grouped_ = true;
  recv_blocks_.assign(std::size_t(P_) * K, 0);
  control_.all_to_all(block_rows.data(), recv_blocks_.data(), K);
  for (int q = 0; q < P_; ++q) {
    send_rows_[q] = recv_rows_[q] = 0;
    for (int b = 0; b < K; ++b) {
      send_rows_[q] += block_rows[std::size_t(q) * K + b];
      recv_rows_[q] += recv_blocks_[std::size_t(q) * K + b];
    }
  }
  sent_ = total(send_rows_);
  received_ = total(recv_rows_);
}

void RowExchange::counts(int width, std::vector<std::int64_t>& send,
                         std::vector<std::int64_t>& recv) const {
  send.resize(P_);
  recv.resize(P_);
  for (int q = 0; q < P_; ++q) {
    send[q] = send_rows_[q] * width;
    recv[q] = recv_rows_[q] * width;
  }
}

void RowExchange::transfer(const float* in, float* out, int width, bool forward_direction) {
  std::vector<std::int64_t> send, recv;
  counts(width, send, recv);
  if (forward_direction)
    data_.all_to_all_v(in, send, out, recv);
  else
    data_.all_to_all_v(in, recv, out, send);
}

void RowExchange::forward(const float* in, float* out, int width) {
  if (grouped_) {
    transfer(in, out, width, true);
    return;
  }
  // Pack: sending position a holds local row order(a) (grouped by destination, local order).
  const int n = static_cast<int>(sent_);
  ensure_size(packed_, std::int64_t(n) * width, name_ + "::packed");
  auto ord = by_dest_.order;
  auto from = ConstMat(in, n, width);
  auto to = Mat(packed_.data(), n, width);
  Kokkos::parallel_for(
      name_ + "::pack", Range2({0, 0}, {n, width}),
      KOKKOS_LAMBDA(int a, int i) { to(a, i) = from(ord(a), i); });
  transfer(packed_.data(), out, width, true);
}

void RowExchange::forward(const int* in, int* out, int width) {
  forward(as_words(in), as_words(out), width);
}

void RowExchange::forward(const std::uint16_t* in, std::uint16_t* out, int width) {
  KMOE_REQUIRE(width % 2 == 0, name_ << ": bf16 rows of odd width " << width);
  forward(as_words(in), as_words(out), width / 2);
}

void RowExchange::reverse(const float* in, float* out, int width) {
  if (grouped_) {
    transfer(in, out, width, false);
    return;
  }
  // The answers come back in sending order; unpack each to its local row.
  const int n = static_cast<int>(sent_);
  ensure_size(packed_, std::int64_t(n) * width, name_ + "::packed");
  transfer(in, packed_.data(), width, false);
  auto ord = by_dest_.order;
  auto from = ConstMat(packed_.data(), n, width);
  auto to = Mat(out, n, width);
  Kokkos::parallel_for(
      name_ + "::unpack", Range2({0, 0}, {n, width}),
      KOKKOS_LAMBDA(int a, int i) { to(ord(a), i) = from(a, i); });
}

}  // namespace kmoe
