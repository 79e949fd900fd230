// The TensorTable: one entry per parameter (MODEL.md section 5 names, global shapes), living in
// flat fp32 buffers for parameters, gradients and the two AdamW moments. Initialization,
// gradient reduction, norms, the optimizer and checkpoint I/O iterate this table; nothing else
// knows the list of parameters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"

namespace kmoe {

enum class InitKind { Normal, Ones, Zeros };

// How a tensor is spread over the ranks of its pipeline stage (RUNTIME.md section 1). Sharded
// tensors are split along dimension 0 into row blocks.
enum class Shard {
  None,   // replicated over the stage's dp*ep ranks; gradients summed over the stage
  Ep,     // row blocks over the ep axis, replicated over dp; gradients summed over dp
  Stage,  // row blocks over all dp*ep ranks of the stage; no replica, no gradient sum
};

struct TensorSpec {
  std::string name;                  // e.g. "blocks.3.attn.wq"
  std::vector<std::int64_t> shape;   // global shape
  InitKind init = InitKind::Normal;
  double init_std = 0.02;            // for InitKind::Normal (truncated at 3 std)
  bool weight_decay = false;         // AdamW decoupled decay applies
  double lr_mult = 1.0;              // group learning rate = lr(s) * lr_mult
  // false: a buffer (e.g. moe.router_bias): checkpointed with the model, but no gradient, no
  // optimizer update and no AdamW moments in checkpoints.
  bool trainable = true;
  // This rank's part: rows [row_begin, row_begin + rows) of dimension 0 (rows < 0: all).
  Shard shard = Shard::None;
  std::int64_t row_begin = 0, rows = -1;
  // The last pipeline stage's replica of a tied embedding: its gradient is summed with stage
  // 0's; it is not saved and not counted in the gradient norm (stage 0's copy is).
  bool tied_copy = false;

  std::int64_t global_rows() const { return shape.empty() ? 1 : shape[0]; }
  std::int64_t local_rows() const { return rows < 0 ? global_rows() : rows; }
  std::int64_t row_elements() const;  // product of dimensions 1..
  std::vector<std::int64_t> local_shape() const;
};

struct TensorEntry {
  TensorSpec spec;
  std::int64_t offset = 0;  // into the flat buffers, in floats
  std::int64_t size = 0;    // local elements
};

class TensorTable {
 public:
  // Declares a tensor; returns its index. Tensors declared back to back are adjacent in every
  // flat buffer, which modules use to fuse GEMMs (wq|wk|wv, w1|w3). After bind(), add() instead
  // returns the index of the existing tensor of that name (same spec required): further module
  // instances (activation slots of a pipeline stage) share the parameters.
  int add(TensorSpec spec);
  // Allocates the four flat buffers (zeroed). No new tensors after this.
  void allocate();
  void bind() { binding_ = true; }

  int size() const { return static_cast<int>(entries_.size()); }
  const TensorEntry& entry(int i) const { return entries_[i]; }
  const std::vector<TensorEntry>& entries() const { return entries_; }
  int find(const std::string& name) const;  // -1 if absent
  std::int64_t total_elements() const { return total_; }

  float* param(int i) const { return params.data() + entries_[i].offset; }
  float* grad(int i) const { return grads.data() + entries_[i].offset; }

  // Deterministic, layout-independent initialization (MODEL.md section 7): element j of tensor
  // `name` depends only on (seed, name, j).
  void initialize(std::uint64_t seed);

  View1F params, grads, exp_avg, exp_avg_sq;  // flat, total_elements() long

 private:
  std::vector<TensorEntry> entries_;
  std::int64_t total_ = 0;
  bool allocated_ = false;
  bool binding_ = false;
};

}  // namespace kmoe
