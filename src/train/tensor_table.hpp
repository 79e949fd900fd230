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
};

struct TensorEntry {
  TensorSpec spec;
  std::int64_t offset = 0;  // into the flat buffers, in floats
  std::int64_t size = 0;
};

class TensorTable {
 public:
  // Declares a tensor; returns its index. Tensors declared back to back are adjacent in every
  // flat buffer, which modules use to fuse GEMMs (wq|wk|wv, w1|w3).
  int add(TensorSpec spec);
  // Allocates the four flat buffers (zeroed). No add() after this.
  void allocate();

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
};

}  // namespace kmoe
