// Gradient reduction over the process grid (RUNTIME.md section 1), bucketed: dense tensors are
// summed over the stage's dp*ep ranks, Ep-sharded experts over the dp ranks that hold the same
// experts, Stage-sharded rows not at all. Tensors are grouped into buckets of about
// parallel.bucket_mb in reverse declaration order (the order backward finalizes them); during the
// step's last backward, a bucket's nonblocking reduction starts as soon as every tensor in it is
// final. Then, with tied embeddings over pp > 1, stage 0's and the last stage's embedding
// gradients are summed.
//
// With optimizer.shard = replicas (ZeRO-1) each bucket is split into one block per member of
// its group, at row boundaries of its tensors: a bucket is reduce-scattered (each member gets
// the sum of its block), the member's AdamW updates its block with the moments it alone keeps
// (moment_slices()), and gather_params() sends every block's updated parameters to all. The
// tied embedding (pp > 1) stays whole: it is summed across stages after the buckets. In bf16
// runs (`bf16_copies`) a bucket holds either gemm_only tensors, which the table keeps as bf16
// compute copies with fp32 master rows for the member's block only (TensorTable::allocate), or
// other tensors, never both: the gather sends a copy bucket's blocks as bf16 (half the bytes)
// and the others' as fp32. Tensors kept in host memory are summed in place there over the
// group's MPI communicator, once, in finish().
#pragma once

#include <vector>

#include "core/tensor_table.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

class GradReducer {
 public:
  GradReducer(TensorTable& table, const ProcessGrid& grid, double bucket_mb, bool tied,
              bool shard = false, bool bf16_copies = false);

  // Every tensor with table index >= first_final holds its final gradient: start the buckets
  // made only of such tensors, in bucket order.
  void ready_from(int first_final);
  // Starts what is left, waits for everything, sums the tied embedding.
  void finish();
  // Sharded: sends each member's updated block of every split bucket to the group (after
  // AdamW) and waits. Nothing to do unsharded.
  void gather_params();

  // The moments this rank keeps per tensor (TensorTable::shard_moments): every tensor whole
  // unsharded; sharded, the rows of this rank's block of each split bucket.
  const std::vector<MomentSlice>& moment_slices() const { return slices_; }

 private:
  struct Bucket {
    int first_tensor, last_tensor;  // table indices [first, last]
    std::int64_t offset, size;
    const DataComm* comm;
    std::vector<std::int64_t> blocks;  // split: each member's elements, in member order
  };
  // Splits bucket b, the k-th split bucket of its group, into member blocks at row boundaries,
  // as equal as rows allow.
  void split(Bucket& b, int k) const;
  TensorTable& table_;
  const ProcessGrid& grid_;
  int tied_ = -1;  // embed.weight (or its tied copy) when summed across stages
  std::vector<Bucket> buckets_;
  // Tensors in host memory (TensorSpec::host_resident): each summed whole, over MPI, at
  // finish(); never split by optimizer.shard (their moments stay whole, in host memory).
  struct HostSum {
    int tensor;
    const Communicator* comm;
  };
  std::vector<HostSum> host_;
  std::vector<Pending> pending_;
  std::vector<MomentSlice> slices_;
  std::size_t next_ = 0;
};

}  // namespace kmoe
