// Where each tensor of the TensorTable lives on the process grid (RUNTIME.md sections 1 and 4):
// which ranks own it (write it to checkpoints and count it in the gradient norm), which
// communicator sums its gradient, and the model-wide list of tensors that every rank needs for
// collective checkpoint I/O even when its stage holds only some of them.
#pragma once

#include <string>
#include <vector>

#include "modules/model/stage.hpp"
#include "parallel/layer_comms.hpp"
#include "parallel/process_grid.hpp"
#include "train/tensor_table.hpp"

namespace kmoe {

// True on exactly one rank per element of the global tensor: dense tensors on (dp 0, ep 0) of
// their stage, Ep-sharded rows on dp 0, Stage-sharded rows on their holder; never a tied copy.
bool owns(const TensorSpec& spec, const ProcessGrid& grid);

// The communicator over which the tensor's gradient is summed (stage, dp axis), or nullptr
// when its rows have a single holder.
const Communicator* gradient_comm(const TensorSpec& spec, const ProcessGrid& grid);

// Every tensor of the model (all stages), in model order: name, global shape, trainable.
std::vector<TensorSpec> global_catalog(const TensorTable& table, const ProcessGrid& grid);

// The blocks, embedding and head of this rank's pipeline stage.
StagePlan stage_plan(const ProcessGrid& grid);
// The groups this rank's layers talk to: the ep axis for MoE, the Engram shard group.
LayerComms layer_comms(const Config& cfg, const ProcessGrid& grid);

}  // namespace kmoe
