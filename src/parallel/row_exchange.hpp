// "Send these rows to their owners and bring the answers back" (RUNTIME.md section 1): one
// object owns the plan (where each local row goes, how many rows arrive from each member), the
// transfers both ways and their buffers; a layer only says where its rows go. The expert
// dispatch (modules/moe/moe_dispatch) and the sharded Engram table (modules/engram/
// engram_shard) are its users.
//
// Order, on which the layers' fixed summation orders rest: rows leave grouped by destination
// member and, within one destination, in their local order; they arrive source-major (member
// 0's rows first), each source's rows in its sending order. reverse() is the exact inverse: a
// received-shaped array goes back and each row lands where its original was.
//
// Counts go over the group's MPI communicator (a few integers per member), rows over its data
// plane (MPI, staged MPI or NCCL); both must be the same members in the same order. Every
// member calls plan/forward/reverse the same number of times (they are collective); members
// may send or receive no rows at all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/bucket_sort.hpp"
#include "core/kokkos_types.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

class RowExchange {
 public:
  RowExchange(const Communicator& control, const DataComm& data, std::string name);

  int members() const { return P_; }

  // Rows in any order: dest (n) is each local row's destination member, in [0, members()).
  // Reads the per-member counts back to the host (one copy of members()+1 ints).
  void plan(ConstIVec dest, int n);
  // Rows already grouped by destination: block_rows[p*K + b] rows for member p's block b (K =
  // blocks_per_member), back to back in that order. The block counts travel too, so the
  // receiver learns each source's block sizes (received_blocks()).
  void plan_grouped(const std::vector<std::int64_t>& block_rows, int blocks_per_member);

  std::int64_t rows_sent() const { return sent_; }
  std::int64_t rows_received() const { return received_; }
  // Rows received per (source member q, block b) at [q*K + b]; K = 1 for plan().
  const std::vector<std::int64_t>& received_blocks() const { return recv_blocks_; }

  // in: (rows_sent, width) local rows -> out: (rows_received, width) as received.
  void forward(const float* in, float* out, int width);
  void forward(const int* in, int* out, int width);  // bit for bit, e.g. row ids
  // bf16 rows bit for bit (width even: they travel as width / 2 4-byte words).
  void forward(const std::uint16_t* in, std::uint16_t* out, int width);
  // in: (rows_received, width) in received order -> out: (rows_sent, width), each row at the
  // local position of the row it answers.
  void reverse(const float* in, float* out, int width);

 private:
  // The per-member row counts of both directions, times width (floats per transfer block).
  void counts(int width, std::vector<std::int64_t>& send, std::vector<std::int64_t>& recv) const;
  void transfer(const float* in, float* out, int width, bool forward_direction);

  const Communicator& control_;
  const DataComm& data_;
  std::string name_;
  int P_ = 1;
  bool grouped_ = true;  // no packing: the local rows are already in sending order
  std::int64_t sent_ = 0, received_ = 0;
  std::vector<std::int64_t> send_rows_, recv_rows_;  // per member
  std::vector<std::int64_t> recv_blocks_;
  KeyBuckets by_dest_;  // plan(): the local rows grouped by destination, in local order
  View1F packed_;       // plan(): rows in sending order (forward) or as returned (reverse)
};

}  // namespace kmoe
