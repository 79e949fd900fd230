// Gradient reduction over the process grid (RUNTIME.md section 1), bucketed: dense tensors are
// summed over the stage's dp*ep ranks, Ep-sharded experts over the dp ranks that hold the same
// experts, Stage-sharded rows not at all. Tensors are grouped into buckets of about
// parallel.bucket_mb in reverse declaration order (the order backward finalizes them); during the
// step's last backward, a bucket's nonblocking all-reduce starts as soon as every tensor in it is
// final. Then, with tied embeddings over pp > 1, stage 0's and the last stage's embedding
// gradients are summed.
#pragma once

#include <vector>

#include "core/tensor_table.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

class GradReducer {
 public:
  GradReducer(TensorTable& table, const ProcessGrid& grid, double bucket_mb, bool tied);

  // Every tensor with table index >= first_final holds its final gradient: start the buckets
  // made only of such tensors, in bucket order.
  void ready_from(int first_final);
  // Starts what is left, waits for everything, sums the tied embedding.
  void finish();

 private:
  struct Bucket {
    int first_tensor;  // lowest table index in the bucket
    std::int64_t offset, size;
    const DataComm* comm;
  };
  TensorTable& table_;
  const ProcessGrid& grid_;
  int tied_ = -1;  // embed.weight (or its tied copy) when summed across stages
  std::vector<Bucket> buckets_;
  std::vector<Pending> pending_;
  std::size_t next_ = 0;
};

}  // namespace kmoe
