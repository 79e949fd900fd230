// HDF5 checkpoints (RUNTIME.md section 4): one shared file per checkpoint, written collectively
// through the TensorTable at global shapes, first under a temporary name, then renamed;
// <dir>/latest names the newest complete file; the newest checkpoint.keep files are kept.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/tensor_table.hpp"
#include "parallel/process_grid.hpp"

namespace kmoe {

// What, besides the tensors, a run needs to continue.
struct TrainState {
  int step = 0;  // steps completed: the file holds the state after it
  std::int64_t tokens_seen = 0;
  std::int64_t next_position = 0;  // data-stream position of step + 1
};

std::string checkpoint_file_name(int step);  // "step00000025.h5"

// Collective over grid.world. Writes <dir>/stepNNNNNNNN.h5 atomically, updates latest, prunes.
void save_checkpoint(const Config& cfg, const ProcessGrid& grid, const TensorTable& table,
                     const TrainState& state);

// On one process, without a process grid: writes `path` (through a temporary name) as the
// checkpoint of `cfg`'s model after step 0, AdamW moments zero and the data stream at its
// start, its tensors those of `catalog` (global shapes, model order) with the values
// `values(spec, v)` leaves in v (sized to the tensor, zeroed): a model brought in from
// elsewhere (kmoe-import). Any layout resumes from it.
void write_initial_checkpoint(
    const std::string& path, const Config& cfg, const std::vector<TensorSpec>& catalog,
    const std::function<void(const TensorSpec&, std::vector<float>&)>& values);

// The file a run resumes from: checkpoint.resume = none -> ""; auto -> the file <dir>/latest
// names, or "" for a fresh run; anything else is a path that must exist.
std::string resume_file(const CheckpointCfg& c);

// On one process: validates the file's format, version, the deck's model section and step
// attributes (not the tensors) and returns its state; for the dry run.
TrainState check_checkpoint(const std::string& path, const Config& cfg, std::string* changes);

// Throws kmoe::Error naming `file`, `dataset`, the row and element of the first non-finite value
// among `n` values of tensor `spec` that start at row `first_row` ("refusing to <action> it"):
// trained on or exported, a NaN or Inf would spread or load silently elsewhere.
void require_finite(const std::string& file, const std::string& dataset, const TensorSpec& spec,
                    std::int64_t first_row, const float* values, std::int64_t n,
                    const char* action);

// Collective. Validates the file (format, version, shapes, the deck's model section) and reads
// the parameters, and with `with_optimizer` the AdamW moments. `changes` receives a
// description of the non-model deck keys that differ from the file's.
TrainState load_checkpoint(const std::string& path, const Config& cfg, const ProcessGrid& grid,
                           TensorTable& table, bool with_optimizer, std::string* changes);

// "blocks.3.attn.wq" -> "blocks/3/attn/wq".
std::string tensor_path(const std::string& name);

}  // namespace kmoe
