// Mixture-of-experts FFN (MODEL.md section 3): router (softmax or sigmoid scores), top-k with
// lower-index tie-break, raw or normalized weights, load-balancing and router z-losses, dropless
// dispatch (token-slots grouped per expert with KeyBuckets, one contiguous row block and
// GEMMs per expert), optional capacity with a deterministic tail drop, weighted combine, shared
// experts. Forward and backward; every sum has a fixed order.
//
// Expert parallelism (RUNTIME.md section 1): with an ep group of P ranks, rank r holds experts
// [r*E/P, (r+1)*E/P). Routing, capacity and the auxiliary losses stay with the micro-batch's
// rank; the kept rows go to their experts' rank and back (ExpertDispatch, moe_dispatch.hpp);
// backward sends the rows' output gradients and returns their input gradients. Dropless: an
// expert takes every row it receives.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/bucket_sort.hpp"
#include "core/config.hpp"
#include "core/grouped_gemm.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/step_stats.hpp"
#include "core/tensor_table.hpp"
#include "core/workspace.hpp"
#include "modules/mlp/swiglu.hpp"
#include "modules/moe/moe_dispatch.hpp"
#include "parallel/communicator.hpp"

namespace kmoe {

// What one MoE layer reports for one micro-batch (MoeLayer::report).
struct MoeStats {
  double lb = 0.0;                 // load-balancing loss LB
  double rz = 0.0;                 // router z-loss RZ
  double aux = 0.0;                // lb_coef * LB + z_coef * RZ: the layer's term of the loss
  std::vector<std::int64_t> load;  // (E) assignments per expert, before any capacity drop
  std::int64_t dropped = 0;        // assignments beyond capacity
};

// The expert GEMMs a layer runs: moe.expert_gemm resolved for this build (auto: grouped where
// the device's memory is not the host's).
bool use_grouped_expert_gemm(ExpertGemm choice);

// Host threads that run a layer's per-expert GEMMs side by side, one expert's whole chain (its
// products and SwiGLU) per thread at a time: ctx.batch_threads (a host BLAS running one
// thread per call) in fp32 runs with per-expert GEMMs, at most one per local expert; else 1,
// the experts one after the other with the BLAS's own threads. Each product is the BLAS call
// gemm() makes, on one thread: the numbers of a one-thread BLAS (a BLAS whose multi-threaded
// products differ in the last bits, as an OpenMP OpenBLAS, gives other last bits when this
// path turns on). `bf16`: the layer keeps bf16 activations.
int expert_threads(const RunContext& ctx, const MoeCfg& e, int d_model, int local_experts,
                   bool bf16);

// Aux-loss-free balancing (DeepSeek-V3), after each optimizer step: with C_e the expert's
// assignments over the whole global batch, bias_e += gamma * sign(mean(C) - C_e).
void update_router_bias(TensorTable& table, int bias_index, const std::vector<double>& counts,
                        double gamma);

// An MoE layer's metrics.csv columns (MODEL.md section 3 metrics): moe<l>_lb and moe<l>_rz (mean
// over the step's micro-batches), moe<l>_load_max_mean (the busiest expert's assignments over
// the mean; its E accumulators are the step's global counts) and, with a capacity, moe<l>_drop
// (dropped assignments over all).
struct MoeStatColumns {
  int lb = -1, rz = -1, load = -1, drop = -1;
};

class MoeLayer {
 public:
  // Declares <prefix>router [E, D], experts.w1/w3 [E, Fe, D], experts.w2 [E, D, Fe] and, with
  // shared experts, shared.w1/w3 [S*Fs, D], shared.w2 [D, S*Fs].
  // `ep`: the expert-parallel group (null or one rank: all experts here). Expert tensors are
  // declared as this rank's row block [E/P experts] of the global [E, ...] shape.
  // Counts go over `ep` (MPI, host), rows over `ep_data` (its data plane; ep when null).
  // With `stats`, every forward adds its report to the columns of block `block`.
  MoeLayer(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e, const std::string& prefix,
           std::int64_t max_tokens, TensorTable& table, const Communicator* ep = nullptr,
           const DataComm* ep_data = nullptr, StepStats* stats = nullptr, int block = 0);

  // Declares (or finds) the columns of the MoE layer at `block`.
  static MoeStatColumns declare_stats(StepStats& stats, int block, const MoeCfg& e);

  // x: (N, D) -> y: (N, D); saves what backward needs. The layer's statistics go to the step
  // statistics' device accumulators, its term of the loss (lb_coef * LB + z_coef * RZ) is added
  // to aux(0) when given: nothing is read back to the host (with moe.expert_gemm = per_expert
  // or expert parallelism, the expert row counts are). Temporaries come from `ws`: in bf16
  // runs the up-projections before they are kept as bf16; under expert parallelism the
  // transfer buffer and the expert side's outputs.
  // count = false: a recompute of a forward already counted (train.recompute), which adds to
  // neither the statistics nor aux.
  void forward(const TensorTable& table, ConstMat x, Mat y, Workspace& ws, View1D aux = View1D(),
               bool count = true);
  // The last forward's report, read from the device (a host wait: for tests and tools).
  MoeStats report() const;
  // dy: (N, D) -> dx: (N, D) (assigned). aux_scale weights this micro-batch's LB and RZ terms in
  // the step loss (1 / micro-batches per step). Temporaries from `ws`: the slots' weight and
  // row gradients, the expert side's received gradients, the hidden gradients, the transfer
  // buffer, the logit gradients.
  void backward(TensorTable& table, ConstMat x, ConstMat dy, Mat dx, Workspace& ws,
                float aux_scale);

  // The workspace bytes the deepest of the two calls takes for max_tokens tokens with an ep
  // group of `ep` ranks, the expert side's rows at twice a balanced share (2 * max_tokens *
  // top_k, as its kept buffers are sized) and, with per-expert GEMMs, its largest expert at
  // twice a balanced share of them; a step that routes more takes more.
  static std::int64_t workspace_bytes(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e,
                                      std::int64_t max_tokens, int ep);
  // Of that, the expert side's (ep > 1; 0 otherwise): outputs, received gradients, transfer
  // buffers or hidden gradients.
  static std::int64_t expert_side_workspace_bytes(const RunContext& ctx, const ModelCfg& m,
                                                  const MoeCfg& e, std::int64_t max_tokens,
                                                  int ep);

  // The router_bias buffer's table index, or -1 without aux-loss-free balancing.
  int bias_index() const { return bias_; }
  // After the step's optimizer update: the router bias from the step's global expert counts
  // (`stats` summed over the world).
  void after_optimizer_step(TensorTable& table, const StepStats& stats) const;

  // Routing of the last forward: (N*k) expert ids, token-major (the buffer's first N*k).
  ConstIVec selected() const { return ConstIVec(sel_.data(), sel_.extent(0)); }

  // The phases of forward() and backward(), public only because a function that launches a
  // device lambda may not be private under nvcc; forward() and backward() are the interface.
  // Forward, in order (their kernels carry the same names):
  // Router logits (fp32 in every precision), per token the logsumexp, scores, top-k picks and
  // weights.
  void route(const TensorTable& table, ConstMat x);
  // Assignments each expert keeps (all, or its first `cap` in token order): INT_MAX dropless.
  int capacity(int N) const;
  // The slots grouped per expert in token order: each kept slot's row in the expert blocks and
  // back, the blocks' offsets (read to the host where per-expert GEMMs or ep need them).
  void assign_rows(int cap);
  // The kept slots' input rows, expert-major (bf16 in bf16 runs).
  void gather_rows(ConstMat x);
  // The experts' SwiGLUs on their row blocks, here or on their ep ranks (dispatch, combine).
  void run_experts(const TensorTable& table, Workspace& ws);
  // y = shared(x) + sum_j w_j expert_j(x), slots in order (dropped ones give 0).
  void combine(const TensorTable& table, ConstMat x, Mat y, Workspace& ws);
  // LB and RZ, the report, the statistics and the loss term, on the device.
  void add_aux_losses(View1D aux, bool count, int cap);

  // Backward, in order:
  // The rows' output gradients (w * dy of their token) into g_rows, the slots' weight
  // gradients (<dy, output>; 0 for dropped slots) into dwt.
  void row_grads(ConstMat dy, Vec dwt, KeptOut g_rows) const;
  // The experts' backward, here or on their ep ranks: d_rows then holds the rows' input
  // gradients (the output gradients arrive in d_rows, or as bf16 in wire_out).
  void run_experts_backward(TensorTable& table, Mat d_rows, const std::uint16_t* wire_out,
                            Workspace& ws) const;
  // dx += each kept slot's input gradient, slots in order.
  void scatter_inputs(ConstMat d_rows, Mat dx) const;
  // d scores from the weights and the LB term, through softmax/sigmoid, plus the z-loss; the
  // logit gradients -> router weight and input gradients.
  void router_backward(TensorTable& table, ConstMat x, ConstVec dwt, Mat dx, float aux_scale,
                       Workspace& ws) const;

 private:
  // The local experts' SwiGLUs on `rows` rows grouped per local expert: El+1 row bounds in
  // `off` (host; per-expert GEMMs) or planned into grouped_ (device; grouped GEMMs).
  // `in`: the (rows, D) expert inputs; up1, up3, act: the up-projections and SwiGLU
  // activations it keeps (sized for `rows`).
  void experts_forward(const TensorTable& table, const Operand& in, const std::vector<int>& off,
                       std::int64_t rows, const KeptOperand& up1, const KeptOperand& up3,
                       const KeptOperand& act, float* out, Workspace& ws) const;
  // g: (rows, D) output gradients in; g_out: (rows, D) input gradients out (may be g's fp32
  // storage); weight gradients accumulate.
  void experts_backward(TensorTable& table, const Operand& g, float* g_out, const Operand& in,
                        const KeptOperand& up1, const KeptOperand& up3, const KeptOperand& act,
                        const std::vector<int>& off, std::int64_t rows, Workspace& ws) const;
  // The most rows of one local expert in `off` (El+1 bounds).
  int largest_block(const std::vector<int>& off) const {
    int most = 0;
    for (int le = 0; le < El_; ++le) most = std::max(most, off[le + 1] - off[le]);
    return most;
  }
  RunContext ctx_;  // the precision and host threads of its products
  int D_, E_, k_, Fe_;
  int P_ = 1, El_, e0_ = 0;  // ep group size, experts per rank, first local expert
  MoeCfg cfg_;
  int router_, w1_, w3_, w2_, bias_ = -1;
  StepStats* stats_ = nullptr;
  MoeStatColumns cols_;
  std::unique_ptr<SwigluMlp> shared_;
  KeyBuckets buckets_;
  // Saved for backward, sized for max_tokens.
  View1F logits_, probs_;          // (N, E)
  View1F lse_;                     // (N) logsumexp of the logits
  View1I sel_;                     // (N*k) selected expert per slot (slot = t*k + j)
  View1F weights_;                 // (N*k)
  View1I slot_row_;                // (N*k) row of the slot in the expert blocks, -1 if dropped
  View1I row_slot_;                // (N*k) slot of each expert row
  View1I row_offsets_;             // (E+1) first row of each expert's block
  std::vector<int> host_offsets_;  // the same on the host (per-expert GEMMs, ep > 1), else empty
  std::int64_t rows_ = 0;          // rows the expert buffers hold: kept rows, or N*k unread
  std::unique_ptr<GroupedGemm> grouped_;  // null: per-expert GEMMs
  View1I local_offsets_;                  // (El+1) ep > 1 with grouped GEMMs: the expert side's
  View1D report_;                         // (E+3): load per expert, dropped, LB, RZ
  // (N*k, D|Fe): gathered inputs ... outputs; the inputs (ep = 1), up-projections and
  // activations as bf16 in bf16 runs.
  KeptOperand rows_in_, up1_, up3_, act_;
  View1F rows_out_;
  View1D aux_sums_;                      // (E+1): sum_t p_te, then sum_t lse_t^2
  static constexpr int kAuxChunk = 256;  // tokens per first-stage partial sum
  View1D aux_partial_;                   // (chunks, E+1): the first stage
  int N_ = 0;
  // Expert parallelism (P > 1): the row traffic, and what the expert side keeps of the local
  // experts' rows from every rank, grown on demand. In bf16 runs (d_model even) the rows and
  // the output gradients travel as bf16, the products' inputs (rows_in_ and ex_in_ bf16).
  std::unique_ptr<ExpertDispatch> dispatch_;
  KeptOperand ex_in_, ex_up1_, ex_up3_, ex_act_;
};

}  // namespace kmoe
