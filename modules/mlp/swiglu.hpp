// SwiGLU MLP (MODEL.md section 1): y = (silu(x W1^T) * (x W3^T)) W2^T. W1|W3 are adjacent in the
// tensor table, so the up-projection is one (N, 2F) GEMM. The element-wise kernels are free
// functions so the MoE experts reuse them on their row blocks.
#pragma once

#include <string>

#include "core/kokkos_types.hpp"
#include "io/config.hpp"
#include "train/tensor_table.hpp"

namespace kmoe {

// up: (N, 2F) = [x W1^T | x W3^T] -> act: (N, F) = silu(up1) * up3.
void swiglu_activate(ConstMat up, Mat act);
// d_act: (N, F) -> d_up: (N, 2F).
void swiglu_activate_backward(ConstMat up, ConstMat d_act, Mat d_up);

struct MlpScratch {
  View1F d_act;  // (N, F)
  View1F d_up;   // (N, 2F)
  MlpScratch(std::int64_t max_rows, int hidden);
};

class SwigluMlp {
 public:
  // Declares <prefix>w1, w3 ([F, D]) and w2 ([D, F]).
  SwigluMlp(const std::string& prefix, int d_model, int hidden, double init_std,
            std::int64_t max_rows, TensorTable& table);

  void forward(const TensorTable& table, ConstMat x, Mat y);  // x, y: (N, D)
  // dy: (N, D) -> dx: (N, D) (assigned); parameter gradients accumulate.
  void backward(TensorTable& table, ConstMat x, ConstMat dy, Mat dx, MlpScratch& s);

 private:
  int D_, F_;
  int w1_, w2_;
  View1F up_;   // (N, 2F) saved
  View1F act_;  // (N, F) saved
};

}  // namespace kmoe
