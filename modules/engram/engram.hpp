// Engram conditional memory, single branch (MODEL.md section 4): hashed n-gram lookup
// (engram_hash), key/value projections, the RMSNorm gate against the residual stream, a causal
// dilated depthwise convolution, Engram(x) = v + silu(conv). Forward and backward; table rows
// receive gradient only where looked up, summed in a fixed order (sort-then-reduce).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/bucket_sort.hpp"
#include "core/config.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/step_stats.hpp"
#include "core/tensor_table.hpp"
#include "core/workspace.hpp"
#include "modules/engram/engram_hash.hpp"
#include "modules/engram/engram_shard.hpp"
#include "modules/engram/row_cache.hpp"

namespace kmoe {

// An Engram layer's metrics.csv columns: engram<l>_gate (the mean gate value, averaged over the
// step's micro-batches) and engram<l>_rows_touched (the fraction of table rows the step's whole
// global batch looked up).
struct EngramStatColumns {
  int gate = -1, touched = -1;
};

class EngramLayer {
 public:
  // Declares <prefix>table [R, dh_e], wk, wv [D, d_mem], bk, bv [D], q_norm.weight,
  // k_norm.weight, conv_norm.weight [D], conv [D, kernel].
  // With `shard` (parallel.engram_shard = ep | stage) the table is split into row blocks over
  // the members of shard.comm (EngramShard): lookups fetch their rows from the holders, and the
  // row gradients go back to them.
  // With `stats`, every forward adds to the columns of its block (plan.layer).
  using Sharding = EngramSharding;
  EngramLayer(const RunContext& ctx, const ModelCfg& m, const EngramCfg& g,
              const EngramHashPlan& plan, const std::string& prefix, int max_tokens, int seq_len,
              TensorTable& table, const Sharding& shard = Sharding(), StepStats* stats = nullptr);

  // engram.offload = host, before forward (Stage::forward): the micro-batch's rows from its
  // host ids, computed and staged by the host while the device works on what came before.
  // tokens: (N) compressed ids; starts: (N) document starts, or nullptr. The next counted
  // forward reads them; a forward with none staged reads its ids back from the device first.
  void prefetch(const TensorTable& table, const std::int32_t* tokens, const int* starts, int N);
  bool host_table() const { return offload_; }
  // The next forward reads its own rows, whatever was staged (decoding: an uncounted forward
  // that is no recompute).
  void forget_staged_rows() {
    staged_n_ = -1;
    pending_ = false;
  }

  // Declares (or finds) the columns of the Engram layer at `block`.
  static EngramStatColumns declare_stats(StepStats& stats, int block);
  // Before the statistics are gathered: the rows touched by the step, from the lookup counts
  // of every in-flight instance, each row's "touched" flag summed over `counted_over` (the data
  // plane of the stage's replicas, which together hold the global batch's micro-batches for
  // this layer) and counted on the device; `write`: this rank adds the fraction to the column's
  // device accumulator (one rank per stage, so the world's sum is the value). Collective over
  // it; no host wait.
  // A table in host memory counts its rows touched on the host and sums the flags over
  // `counted_over_mpi` (the same members).
  void finish_step(StepStats& stats, const DataComm& counted_over,
                   const Communicator& counted_over_mpi, bool write) const;

  // x: (N, D) residual stream, tokens: (N) compressed ids (EngramCompression) -> out: (N, D).
  // count = false: a recompute of a forward already counted (train.recompute), which adds
  // nothing to the statistics. docs (train.document_mask): n-grams and the convolution do not
  // reach before a position's document start; kept for backward, like the buffers.
  void forward(const TensorTable& table, ConstMat x, ConstIVec tokens, Mat out, bool count = true,
               DocStarts docs = DocStarts());
  // dout: (N, D) -> dx: (N, D) gradient through the gate's RMSNorm_q(x) (assigned). Once per
  // forward: it reuses saved buffers as temporaries, and takes two (N, D), an (N) and an
  // (N, d_mem) from `ws`.
  void backward(TensorTable& table, ConstMat x, ConstMat dout, Mat dx, Workspace& ws);
  // The workspace bytes backward takes for max_tokens tokens.
  static std::int64_t workspace_bytes(const ModelCfg& m, const EngramCfg& g,
                                      std::int64_t max_tokens);

  // Steps 1-6 alone (the first part of forward): hashes the N tokens, counts the lookups and
  // gathers the rows -> (N, d_mem) (bf16 values in bf16 runs), valid until the next call.
  // Gathers N * d_mem values.
  Operand lookup(const TensorTable& table, ConstIVec tokens, bool count = true,
                 DocStarts docs = DocStarts());
  int memory_width() const { return d_mem_; }
  // How many earlier positions one position's output reads (generation): the convolution's
  // reach, (kernel - 1) * max_ngram, and the n-gram context of its earliest tap, max_ngram - 1.
  int context() const { return (kernel_ - 1) * Nn_ + Nn_ - 1; }

  // Mean gate value of the last forward (reads the device; tests and tools: under recompute the
  // gate buffer is the pool's, the last Engram block's to run).
  double mean_gate() const;

 private:
  RunContext ctx_;  // the precision of its products
  int D_, T_, Nn_, kernel_, heads_total_, dh_, d_mem_;
  std::int64_t R_;
  bool signed_sqrt_;
  float eps_;
  int table_, wk_, wv_, bk_, bv_, q_norm_, k_norm_, c_norm_, conv_;
  EngramHasher hasher_;
  KeyBuckets buckets_;
  Kokkos::View<int**, Layout, MemSpace> rows_;  // (N, heads_total)
  KeptOperand mem_;                             // (N, d_mem) looked-up rows (bf16 in bf16 runs)
  View1F key_, val_, kn_, qn_;                  // (N, D)
  View1F rstd_k_, rstd_q_, rstd_c_;             // (N)
  View1F score_, gate_;                         // (N)
  View1F v_, u_, c_;                            // (N, D)
  StepStats* stats_ = nullptr;
  EngramStatColumns cols_;
  Kokkos::View<double, MemSpace> gate_now_;  // this forward's gate sum
  View1F touched_;                           // (R) with stats: rows touched, then summed
  Kokkos::View<double, MemSpace> touched_rows_;  // their count
  int N_ = 0;
  DocStarts docs_;  // the last forward's
  std::unique_ptr<EngramShard> shard_;  // a row-sharded table (more than one member)

  // engram.offload = host: the rows of the last staged forward on the host, computed from host
  // ids (prefetch) or read back; the unsharded table's row cache.
  void host_rows_from_device(ConstIVec tokens, DocStarts docs, int N);
  Operand lookup_cached(int N);  // the lookup from the staged rows (unsharded)
  void stage_rows(const TensorTable& table, int N);
  bool offload_ = false;
  std::unique_ptr<EngramRowCache> cache_;
  std::vector<int> host_rows_;  // (N * heads_total)
  int staged_n_ = -1;           // tokens of the staged rows (-1: none)
  bool pending_ = false;        // staged by prefetch, not yet read by a counted forward
  bool settled_ = true;         // the device has read the cache (a backward took its gradients)
};

}  // namespace kmoe
