// Parameter counts, model FLOPs and memory estimates from the config alone, for --dry-run,
// MFU and the memory check before a run allocates (docs/CONVENTIONS.md "Loss and metrics":
// FLOPs/token = 6 x active non-embedding parameters + 6 x layers x d_model x T). Every size is
// checked 64-bit arithmetic: a deck whose sizes overflow is an error naming the keys that drive
// them. Unit tests check the counts against built TensorTables.
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

// The whole model on one rank (activations as an fp32 run keeps them). Engram tables count in
// total_params; per token only their d_mem looked-up entries count as active, and like the
// embedding the lookup adds no matmul FLOPs.
ModelSize model_size(const ModelCfg& m, const MoeCfg& e, int micro_batch, int seq_len,
                     const EngramCfg& g = EngramCfg());

// What one rank of a grid holds (RUNTIME.md section 1): its stage's blocks, the embedding on the
// first stage and the head on the last, its ep rank's experts, its row block of each Engram
// table, and one set of activations per micro-batch in flight.
struct RankShare {
  int first_block = 0, last_block = 0;  // [first, last)
  bool embed = true, head = true;
  int ep = 1;              // experts split over ep ranks
  int engram_members = 1;  // ranks an Engram table's rows are split over
  int in_flight = 1;       // Stage instances (max_in_flight of the pipeline schedule)
  // train.precision: bf16 keeps the activations MODEL.md section 8 lists as bf16 (2 bytes).
  Precision precision = Precision::Fp32;
  AttentionKernel attention = AttentionKernel::Auto;  // train.attention: the core's saved state
  // The run context's host threads for side-by-side expert products (per-thread scratch); the
  // dry run, planning for other machines, counts 1.
  int batch_threads = 1;
  bool recompute = false;  // train.recompute = block: the blocks share one pool of saved buffers
  // optimizer.shard = replicas: the ranks a dense tensor's and an expert's AdamW moments are
  // split over (the stage's dp*ep replicas, the dp group); 1 unsharded. In bf16 runs the
  // tensors only products read are kept as bf16 compute copies, their fp32 master rows split
  // the same way.
  int dense_replicas = 1, expert_replicas = 1;
  // engram.offload = host: the Engram tables (and their gradients and moments) in host memory;
  // each instance keeps a device row cache of one lookup's rows.
  bool engram_offload = false;
};

struct RankMemory {
  std::int64_t elements = 0;          // this rank's TensorTable (parameters and buffers)
  std::int64_t expert_elements = 0;   // of which its routed experts' weights
  std::int64_t sharded_elements = 0;  // of which its row blocks of sharded Engram tables
  std::int64_t gemm_elements = 0;     // of which dense tensors only products read
  std::int64_t copy_elements = 0;     // of which kept as bf16 compute copies (dense and experts)
  std::int64_t moment_elements = 0;   // the AdamW moments it keeps (fewer when sharded)
  std::int64_t param_bytes = 0;       // fp32 values (master rows of the copies) and copies
  std::int64_t state_bytes = 0;       // parameters, gradients, moments
  std::int64_t activation_bytes = 0;  // every instance's saved activations and the workspace
                                      // (one pool under recompute)
  // Of the activations, the expert side's under expert parallelism: received rows, hidden
  // activations, received gradients and transfer buffers, at twice a balanced share of rows.
  std::int64_t expert_side_bytes = 0;
  // engram.offload = host: its Engram table rows in host memory (not in `elements`), the host
  // bytes they take with gradients and moments, the row caches' host buffers and the
  // rows-touched flags, and the device row caches (in activation_bytes).
  std::int64_t host_elements = 0;
  std::int64_t host_bytes = 0;
  std::int64_t row_cache_bytes = 0;
  // Host <-> device bytes of one micro-batch's lookups and row gradients, at most (every
  // lookup a distinct row; a holder of a sharded table serving a balanced share).
  std::int64_t offload_to_device = 0, offload_from_device = 0;
  std::int64_t total() const { return state_bytes + activation_bytes; }  // device memory
};

RankMemory rank_memory(const ModelCfg& m, const MoeCfg& e, const EngramCfg& g, int micro_batch,
                       int seq_len, const RankShare& share);

// The deck keys the sizes follow, for error messages.
const char* size_keys();

}  // namespace kmoe
