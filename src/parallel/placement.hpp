// Where each tensor of the TensorTable lives on the process grid (RUNTIME.md sections 1 and 4):
// which ranks own it (write it to checkpoints and count it in the gradient norm), which
// communicator sums its gradient, and the model-wide list of tensors that every rank needs for
// collective checkpoint I/O even when its stage holds only some of them.
#pragma once

#include <vector>

#include "core/tensor_table.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

// True on exactly one rank per element of the global tensor: dense tensors on (dp 0, ep 0) of
// their stage, Ep-sharded rows on dp 0, Stage-sharded rows on their holder; never a tied copy.
bool owns(const TensorSpec& spec, const ProcessGrid& grid);

// The rows of table tensor i on the optimizer's side (its AdamW moments; its reduced gradient in
// step dumps): the tensor's moment slice as global rows [first, first + rows), at local row
// `local_first`. `write`: this rank writes them (a split slice, which is its alone; a whole
// tensor where it owns the tensor).
struct MomentRows {
  std::int64_t first = 0, rows = 0, local_first = 0;
  bool write = false;
};
MomentRows moment_rows(const TensorTable& table, int i, const ProcessGrid& grid);

// The communicator over which the tensor's gradient is summed (stage, dp axis), or nullptr
// when its rows have a single holder.
const Communicator* gradient_comm(const TensorSpec& spec, const ProcessGrid& grid);

// Every tensor of the model (all stages), in model order: name, global shape, trainable.
// Collective over grid.world.
std::vector<TensorSpec> global_catalog(const TensorTable& table, const ProcessGrid& grid);

}  // namespace kmoe
