// The full-matrix attention (every sequence's whole (T, T) score matrix per head, masked) as
// kmoe computed it before the blocked kernel: the test oracle the blocked Attention is checked
// against (tests/unit/test_ops_attention.cpp). Not part of the library.
//
// What it shares with the library, deliberately: the GEMM entry points and the QK-norm backward
// (attention.hpp qk_norm_backward), which the oracle is not there to check (they are checked on
// their own: finite differences in test_ops, the PyTorch reference in tests/reference). What it
// writes again: the projections' split into heads, QK-norm and RoPE forward and RoPE's
// backward (the rotation's transpose, written out here), the full masked score matrices, the
// softmax and its backward: everything the blocked kernel's tiling could get wrong.
#pragma once

#include <string>

#include "core/config.hpp"
#include "core/doc_starts.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"
#include "core/workspace.hpp"
#include "modules/attention/rope.hpp"

namespace kmoe::oracle {

class FullMatrixAttention {
 public:
  FullMatrixAttention(const RunContext& ctx, const ModelCfg& m, const std::string& prefix,
                      int max_seqs, int seq_len, TensorTable& table, int window = 0);
  void forward(const TensorTable& table, const RopeTables& rope, ConstMat a, Mat out,
               Workspace& ws, DocStarts docs = DocStarts());
  void backward(TensorTable& table, const RopeTables& rope, ConstMat a, ConstMat dout, Mat da,
                Workspace& ws);
  static std::int64_t workspace_bytes(const ModelCfg& m, int max_seqs, int seq_len, bool bf16);

 private:
  RunContext ctx_;
  int D_, H_, Hkv_, dh_, T_, window_;
  bool qk_norm_;
  DocStarts docs_;
  float eps_;
  int wq_, wo_, q_norm_ = -1, k_norm_ = -1;
  View1F qkv_;
  View1F rstd_q_, rstd_k_;
  KeptOperand q_, k_, v_;   // (nseq, H|Hkv, T, dh)
  KeptOperand probs_;       // (nseq, H, T, T)
  KeptOperand merged_;      // (N, H*dh)
};

}  // namespace kmoe::oracle
