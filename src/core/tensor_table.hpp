// The TensorTable: one entry per parameter (MODEL.md section 5 names, global shapes), living in
// flat fp32 buffers for parameters, gradients and the two AdamW moments. Initialization,
// gradient reduction, norms, the optimizer and checkpoint I/O iterate this table; nothing else
// knows the list of parameters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/gemm.hpp"
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

// A tensor's declaration. Modules declare through the named kinds, which say what a tensor is
// (MODEL.md section 7), refined where needed:
//   TensorSpec::matrix("blocks.0.attn.wq", {qd, D}, std)  N(0, std) cut at 3 std, decayed
//   TensorSpec::gain("final_norm.weight", D)              ones, not decayed
//   TensorSpec::zeros("blocks.1.engram.bk", {D})          zeros, not decayed
//   TensorSpec::buffer("blocks.0.moe.router_bias", {E})   zeros; no gradient, no optimizer state
//   .no_decay()  .with_lr_mult(x)  .row_block(shard, first_row, rows)  .as_tied_copy()
//   .gemm_weight()  .in_host_memory()
struct TensorSpec {
  std::string name;                 // e.g. "blocks.3.attn.wq"
  std::vector<std::int64_t> shape;  // global shape
  InitKind init = InitKind::Normal;
  double init_std = 0.02;     // for InitKind::Normal (truncated at 3 std)
  bool weight_decay = false;  // AdamW decoupled decay applies
  double lr_mult = 1.0;       // group learning rate = lr(s) * lr_mult
  // false: a buffer (e.g. moe.router_bias): checkpointed with the model, but no gradient, no
  // optimizer update and no AdamW moments in checkpoints.
  bool trainable = true;
  // This rank's part: rows [row_begin, row_begin + rows) of dimension 0 (rows < 0: all).
  Shard shard = Shard::None;
  std::int64_t row_begin = 0, rows = -1;
  // The last pipeline stage's replica of a tied embedding: its gradient is summed with stage
  // 0's; it is not saved and not counted in the gradient norm (stage 0's copy is).
  bool tied_copy = false;
  // Read only as a GEMM's weight operand (TensorTable::weight): a bf16 run keeps it as a bf16
  // compute copy, rounded once per optimizer step, with fp32 values for the rows whose AdamW
  // moments this rank keeps (all of them unless optimizer.shard splits the tensor).
  bool gemm_only = false;
  // Kept in host memory (engram.offload = host): its values, gradient and moments live in the
  // table's host buffers, never in device memory.
  // Kernels do not read it; its layer stages the rows it needs (modules/engram/row_cache), and
  // the optimizer, the gradient norm, the reduction and checkpoints handle it on the host.
  bool host_resident = false;

  static TensorSpec matrix(std::string name, std::vector<std::int64_t> shape, double init_std);
  static TensorSpec gain(std::string name, std::int64_t size);
  static TensorSpec zeros(std::string name, std::vector<std::int64_t> shape);
  static TensorSpec buffer(std::string name, std::vector<std::int64_t> shape);
  TensorSpec no_decay() const;
  TensorSpec with_lr_mult(double mult) const;
  // This rank holds rows [first_row, first_row + n_rows) of dimension 0, sharded as `how`.
  TensorSpec row_block(Shard how, std::int64_t first_row, std::int64_t n_rows) const;
  // The last pipeline stage's replica of a tensor that lives on stage 0 (see tied_copy).
  TensorSpec as_tied_copy() const;
  // A tensor read only by products (see gemm_only).
  TensorSpec gemm_weight() const;
  // A tensor kept in host memory (see host_resident).
  TensorSpec in_host_memory() const;

  std::int64_t global_rows() const { return shape.empty() ? 1 : shape[0]; }
  std::int64_t local_rows() const { return rows < 0 ? global_rows() : rows; }
  std::int64_t row_elements() const;  // product of dimensions 1..
  std::vector<std::int64_t> local_shape() const;
};

struct TensorEntry {
  TensorSpec spec;
  // Into the flat gradients (and parameters, without compute copies): the device buffers, or
  // the host buffers for a host_resident tensor.
  std::int64_t offset = 0;
  std::int64_t size = 0;    // local elements
};

// The rows of a tensor whose AdamW moments this rank keeps: local rows [first, first + rows)
// at element `offset` of exp_avg / exp_avg_sq. Without optimizer.shard every tensor whole, at
// its own offset; with it, a replicated tensor's replicas keep disjoint row ranges (`split`:
// each writes its own to checkpoints and counts its own in the gradient norm). A host_resident
// tensor's slice is whole, its offset into the host moments.
struct MomentSlice {
  std::int64_t first = 0, rows = 0, offset = 0;
  bool split = false;
};

class TensorTable {
 public:
  // Declares a tensor; returns its index. Tensors declared back to back are adjacent in every
  // flat buffer, which modules use to fuse GEMMs (wq|wk|wv, w1|w3). After allocate(), add()
  // returns the index of the existing tensor of that name instead (same shape and rows
  // required): further instances of a module (one Stage per micro-batch in flight) share the
  // parameters of the first.
  int add(TensorSpec spec);
  // Allocates the flat buffers (zeroed). No new tensors after this. With `moments` (one slice
  // per tensor, in table order, offsets packed: optimizer.shard) exp_avg and exp_avg_sq hold
  // only those slices. With `bf16_copies` (train.precision = bf16), every trainable gemm_only
  // tensor is kept as a bf16 compute copy in `weights_b16`, which products read (GEMMs take
  // it as it is: no rounding per call), and its fp32 values (the master weights AdamW updates
  // and rounds into the copy) in `params` for its moment slice's rows only: every local row
  // without a split, this rank's rows with one (ZeRO-1's sharded fp32 master weights).
  void allocate(const std::vector<MomentSlice>* moments = nullptr, bool bf16_copies = false);

  int size() const { return static_cast<int>(entries_.size()); }
  bool host(int i) const { return entries_[i].spec.host_resident; }
  const TensorEntry& entry(int i) const { return entries_[i]; }
  const std::vector<TensorEntry>& entries() const { return entries_; }
  int find(const std::string& name) const;  // -1 if absent
  std::int64_t total_elements() const { return total_; }  // in device memory
  std::int64_t host_elements() const { return host_total_; }

  const MomentSlice& moments(int i) const { return moments_[i]; }
  // The moments' first element in the flat parameter / gradient buffers.
  std::int64_t moment_begin(int i) const {
    return entries_[i].offset + moments_[i].first * entries_[i].spec.row_elements();
  }

  // Whether tensor i is kept as a bf16 compute copy (allocate's bf16_copies).
  bool has_copy(int i) const { return copy_at_[i] >= 0; }
  // The fp32 values of tensor i (kernels that read fp32 weights: norms, embedding, router);
  // not for a tensor kept as a compute copy.
  float* param(int i) const;
  // Tensor i as a GEMM operand: the (rows, cols) matrix at element `offset` of its local part,
  // from its fp32 values or its bf16 compute copy.
  Operand weight(int i, int rows, int cols, std::int64_t offset = 0) const {
    if (entries_[i].spec.host_resident) host_tensor_as_weight(i);  // throws
    if (copy_at_[i] >= 0) return {nullptr, weights_b16.data() + copy_at_[i] + offset, rows, cols};
    return {params.data() + param_at_[i] + offset, nullptr, rows, cols};
  }
  // The fp32 values this rank keeps of tensor i: local rows [master_first(i), + master_rows(i))
  // from element param_offset(i) of `params` (every row unless it has a compute copy, whose
  // fp32 rows are its moment slice's).
  std::int64_t param_offset(int i) const { return param_at_[i]; }
  std::int64_t master_first(int i) const { return has_copy(i) ? moments_[i].first : 0; }
  std::int64_t master_rows(int i) const {
    return has_copy(i) ? moments_[i].rows : entries_[i].spec.local_rows();
  }
  // Where tensor i's compute copy starts in weights_b16 (-1: none).
  std::int64_t copy_offset(int i) const { return copy_at_[i]; }
  float* grad(int i) const;
  // A host_resident tensor's values, gradient and moments in the host buffers.
  float* host_param(int i) const;
  float* host_grad(int i) const;
  float* host_m(int i) const;  // exp_avg
  float* host_v(int i) const;  // exp_avg_sq
  // Zeroes every gradient: the device buffer in stream order, the host buffer now.
  void zero_grads();

  // Deterministic, layout-independent initialization (MODEL.md section 7): element j of tensor
  // `name` depends only on (seed, name, j).
  void initialize(std::uint64_t seed);

  View1F params;  // fp32 values in table order (total_elements() long without compute copies)
  View1F grads;   // flat, total_elements() long
  View1F exp_avg, exp_avg_sq;  // flat over the moment slices (total_elements() unsharded)
  Kokkos::View<std::uint16_t*, Layout, MemSpace> weights_b16;  // the compute copies, if any
  // The host_resident tensors' values, gradients and moments (host_elements() long each), in
  // ordinary host memory: only host threads touch them (what travels to the device goes through
  // page-locked staging buffers), and page-locking tens of GB a rank would only slow the start.
  using HostFloats = Kokkos::View<float*, Layout, HostSpace>;
  HostFloats host_params, host_grads, host_exp_avg, host_exp_avg_sq;

 private:
  void initialize_host(int i, std::uint64_t seed);
  void host_tensor_as_weight(int i) const;  // throws
  std::vector<TensorEntry> entries_;
  std::vector<MomentSlice> moments_;
  std::vector<std::int64_t> param_at_, copy_at_;
  std::int64_t total_ = 0, host_total_ = 0;
  bool allocated_ = false;
};

}  // namespace kmoe
