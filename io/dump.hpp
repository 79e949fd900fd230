// Step dumps (RUNTIME.md section 5, output.dump_step): what an independent implementation needs
// to check one kmoe step: the global batch's token ids, the step loss and every reduced
// gradient before clipping, at global shapes. <output.dir>/dump_step<s>.h5:
//   /batch/tokens int32 [G, T]; root attrs step, loss, ce, aux, grad_norm, lr;
//   /grad/<path> float32 (paths as in checkpoints' /model);
//   /route/<block> int32 [G*T, k] per MoE block: the experts each token selected.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "core/tensor_table.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

struct StepDump {
  int step = 0;
  double loss = 0, ce = 0, aux = 0, grad_norm = 0, lr = 0;
  std::vector<std::int32_t> tokens;  // (G * T), only needed on the writing rank
  int global_batch = 0, seq_len = 0;
  // Per MoE block: (block index, (G*T*k) selected experts of the global batch).
  std::vector<std::pair<int, std::vector<std::int32_t>>> routes;
  int top_k = 0;
};

// Collective over grid.world: world rank 0 writes the tokens and routes, each gradient element
// is written by its owner (parallel/placement.hpp).
void write_step_dump(const Config& cfg, const ProcessGrid& grid, const TensorTable& table,
                     const StepDump& d);

}  // namespace kmoe
