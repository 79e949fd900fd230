// SwiGLU MLP (MODEL.md section 1): y = (silu(x W1^T) * (x W3^T)) W2^T. W1|W3 are adjacent in the
// tensor table, so the up-projection is one (N, 2F) GEMM. The element-wise kernels are free
// functions so the MoE experts reuse them on their row blocks.
#pragma once

#include <string>

#include "core/config.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"
#include "core/workspace.hpp"

namespace kmoe {

// act: (N, F) = silu(a) * b, where a and b are (N, F) row-strided windows (row r starts at
// a + r * ld) as the up-projection products wrote them: the fused [a | b] of the dense MLP, or
// the separate blocks of an expert. keep_a, keep_b: where a and b are kept for backward, with
// the same row stride. In fp32 runs that is a and b themselves (pass them, or nothing: no copy
// is made); when they are bf16 (keep_*.b16 set) a and b are rounded into them and the
// activation is computed from the rounded values, the ones backward reads.
void swiglu_activate(const float* a, const float* b, int ld, int N, int F, KeptOut act,
                     KeptOut keep_a = {}, KeptOut keep_b = {});
// d_act: (N, F) -> da, db (row stride ld_out), from the kept a and b (row stride ld); da and db
// fp32, or both bf16 (rounded as written, for gradients only bf16 products read).
void swiglu_activate_backward(KeptIn a, KeptIn b, int ld, ConstMat d_act, KeptOut da, KeptOut db,
                              int ld_out);
inline void swiglu_activate_backward(KeptIn a, KeptIn b, int ld, ConstMat d_act, float* da,
                                     float* db, int ld_out) {
  swiglu_activate_backward(a, b, ld, d_act, KeptOut{da, nullptr}, KeptOut{db, nullptr}, ld_out);
}

// The same two on the calling host thread, fp32 in host memory: for row blocks a caller
// already runs side by side on the host threads (the MoE experts' per-expert path). The same
// element-wise math as the kernels, so the same numbers. act, d_act: (N, F) contiguous.
void swiglu_activate_here(const float* a, const float* b, int ld, int N, int F, float* act);
void swiglu_activate_backward_here(const float* a, const float* b, int ld, const float* d_act,
                                   int N, int F, float* da, float* db, int ld_out);

// fp32 forms: up: (N, 2F) = [x W1^T | x W3^T] -> act: (N, F); d_act -> d_up: (N, 2F).
inline void swiglu_activate(ConstMat up, Mat act) {
  const int F = act.extent(1);
  swiglu_activate(up.data(), up.data() + F, 2 * F, act.extent(0), F, KeptOut{act.data(), nullptr});
}
inline void swiglu_activate_backward(ConstMat up, ConstMat d_act, Mat d_up) {
  const int F = d_act.extent(1);
  swiglu_activate_backward(KeptIn{up.data(), nullptr}, KeptIn{up.data() + F, nullptr}, 2 * F,
                           d_act, d_up.data(), d_up.data() + F, 2 * F);
}

class SwigluMlp {
 public:
  // Declares <prefix>w1, w3 ([F, D]) and w2 ([D, F]), initialized as m says (ModelCfg::
  // matrix_std: w2 an output projection).
  SwigluMlp(const RunContext& ctx, const std::string& prefix, const ModelCfg& m, int hidden,
            std::int64_t max_rows, TensorTable& table);

  // x, y: (N, D). In bf16 runs the fp32 up-projection passes through `ws`.
  // x: fp32, or bf16 in bf16 runs (it is read only by products).
  void forward(const TensorTable& table, const Operand& x, Mat y, Workspace& ws);
  void forward(const TensorTable& table, ConstMat x, Mat y, Workspace& ws) {
    forward(table, operand(x), y, ws);
  }
  // dy: (N, D) -> dx: (N, D) (assigned); parameter gradients accumulate. Temporaries from `ws`:
  // d act (N, F), d up (N, 2F).
  // x, dy: fp32, or bf16 in bf16 runs (they are read only by products).
  void backward(TensorTable& table, const Operand& x, const Operand& dy, Mat dx, Workspace& ws);
  void backward(TensorTable& table, ConstMat x, ConstMat dy, Mat dx, Workspace& ws) {
    backward(table, operand(x), operand(dy), dx, ws);
  }

  // The workspace bytes the deeper of the two calls takes for `rows` rows.
  static std::int64_t workspace_bytes(std::int64_t rows, int hidden, bool bf16);

 private:
  RunContext ctx_;
  int D_, F_;
  int w1_, w2_;
  KeptOperand up_;   // (N, 2F) saved, [x W1^T | x W3^T] (bf16 in bf16 runs)
  KeptOperand act_;  // (N, F) saved (bf16 in bf16 runs)
};

}  // namespace kmoe
