// One transformer block (MODEL.md section 1), in either norm order:
//   reordered (OLMo2): h = x + norm_attn(attn(x));  out = h + norm_ffn(ffn(h))
//   pre (Llama):       h = x + attn(norm_attn(x));  out = h + ffn(norm_ffn(h))
#pragma once

#include <string>

#include "modules/attention/attention.hpp"
#include "modules/mlp/swiglu.hpp"

namespace kmoe {

// Backward temporaries shared by all blocks of a stage.
struct BlockScratch {
  AttentionScratch attn;
  MlpScratch mlp;
  View1F d_h, d_a, d_b;  // (N, D)
  BlockScratch(const ModelCfg& m, int max_seqs, int seq_len);
};

class Block {
 public:
  Block(const ModelCfg& m, int layer, int max_seqs, int seq_len, TensorTable& table);

  // x_in, x_out: (N, D). Saves what backward needs (x_in itself is kept by the caller).
  void forward(const TensorTable& table, const RopeTables& rope, ConstMat x_in, Mat x_out,
               BlockScratch& s);
  // dx_out -> dx_in (assigned; may not alias dx_out); parameter gradients accumulate.
  void backward(TensorTable& table, const RopeTables& rope, ConstMat x_in, ConstMat dx_out,
                Mat dx_in, BlockScratch& s);

 private:
  Mat buf(const View1F& v, int rows) const { return as_mat(v.data(), rows, D_); }

  int D_;
  bool reordered_;
  float eps_;
  int attn_norm_, ffn_norm_;
  Attention attn_;
  SwigluMlp mlp_;
  // Saved (N, D): attn_in/ffn_in (pre only: the normed inputs), attn_out, h, ffn_out; rstds (N).
  View1F attn_in_, attn_out_, h_, ffn_in_, ffn_out_;
  View1F rstd_attn_, rstd_ffn_;
};

}  // namespace kmoe
