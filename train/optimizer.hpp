// AdamW with per-tensor groups and the learning-rate schedules of MODEL.md section 6.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.hpp"
#include "core/tensor_table.hpp"

namespace kmoe {

// lr(s) for step s in 1..max_steps: linear warmup, then cosine | constant | wsd.
double learning_rate(const OptimizerCfg& o, int max_steps, int step);

// The gradient norm and the AdamW update over the table's flat buffers: one launch each per
// step, whatever the number of tensors. The buffers are cut into chunks of one tensor each
// (at most kChunk elements on parallel backends; whole tensors on Serial), built once. Tensors
// in host memory (TensorSpec::host_resident) are cut the same way and handled by host threads
// with the same arithmetic; their chunk sums take their place in the one summation order.
class FlatOptimizer {
 public:
  static constexpr std::int64_t kChunk = std::int64_t(1) << 16;
  static constexpr int kGroup = 64;  // chunk sums a thread adds up for the gradient norm

  // counted: per tensor, whether its squares join the gradient norm (the tensors this rank
  // owns, so a sum over the grid counts each parameter once); all tensors when null. Only each
  // tensor's moment slice (TensorTable::moments) is counted and updated: a split slice
  // (optimizer.shard) always counts, being this rank's alone.
  FlatOptimizer(const TensorTable& table, const std::vector<char>* counted = nullptr);

  // Sum of squared gradients of the counted tensors, in double: each chunk's sum, then the
  // chunks' in order (deterministic on every backend; on Serial the per-tensor sums in tensor
  // order). One host synchronization, for the result.
  double grad_sq_sum(const TensorTable& table) const;

  // One AdamW update with AdamW step t (1-based), schedule value lr and clip scale:
  //   g = clip_scale * grad; m, v moments; theta -= lr*lr_mult*(wd*theta + m^/(sqrt(v^)+eps)).
  // Tensors that are not trainable are left alone. A tensor kept as a bf16 compute copy
  // updates its fp32 master rows and writes them, rounded, into its copy.
  void adamw_step(const OptimizerCfg& o, TensorTable& table, int t, double lr,
                  double clip_scale) const;

 private:
  Kokkos::View<std::int64_t*, Layout, MemSpace> begin_, end_;  // (chunks) gradient elements
  Kokkos::View<std::int64_t*, Layout, MemSpace> moment_;       // (chunks) first moment element
  Kokkos::View<std::int64_t*, Layout, MemSpace> param_;        // (chunks) first fp32 parameter
  Kokkos::View<std::int64_t*, Layout, MemSpace> copy_;  // (chunks) first bf16 copy element, or -1
  View1D lr_mult_;                                             // (chunks) of the chunk's tensor
  View1I flags_;            // (chunks) bit 0 counted, bit 1 trainable, bit 2 weight decay
  mutable View1D partial_;  // chunk sums, the total, then the sums of kGroup chunks each
  int chunks_ = 0;
  // The chunks of host_resident tensors (offsets into the table's host buffers), which the
  // host sums and updates; their sums reach partial_ through host_sums_.
  struct HostChunk {
    int chunk;
    std::int64_t begin, end, moment, param;
    double lr_mult;
    int flags;
  };
  std::vector<HostChunk> host_;
  View1D host_sums_;                                         // (chunks)
  Kokkos::View<double*, Layout, PinnedSpace> host_sums_h_;  // (chunks)
};

// One-off forms of the above (tests): a FlatOptimizer built for the call.
double grad_sq_sum(const TensorTable& table, const std::vector<char>* counted = nullptr);
void adamw_step(const OptimizerCfg& o, TensorTable& table, int t, double lr, double clip_scale);

}  // namespace kmoe
