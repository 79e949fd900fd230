// Parameter counts, model FLOPs and a per-rank memory estimate from the config alone, for
// --dry-run and MFU (docs/CONVENTIONS.md "Loss and metrics": FLOPs/token = 6 x active
// non-embedding parameters + 6 x layers x d_model x T). A unit test checks the counts
// against a built TensorTable.
#pragma once

#include <cstdint>

#include "core/config.hpp"

namespace kmoe {

struct ModelSize {
  std::int64_t total_params = 0;   // every trainable element
  std::int64_t active_params = 0;  // touched per token: k of the E experts
  std::int64_t embedding_params = 0;
  double flops_per_token = 0.0;       // forward + backward
  std::int64_t state_bytes = 0;       // params, grads, two moments
  std::int64_t activation_bytes = 0;  // saved activations and scratch for one micro-batch
};

// Engram tables count in total_params; per token only their d_mem looked-up entries count as
// active, and like the embedding the lookup adds no matmul FLOPs.
ModelSize model_size(const ModelCfg& m, const MoeCfg& e, int micro_batch, int seq_len,
                     const EngramCfg& g = EngramCfg());

}  // namespace kmoe
