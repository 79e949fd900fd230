#include "modules/model/block.hpp"

#include <algorithm>

#include "core/elementwise.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe {

namespace {
std::string block_prefix(int layer) { return "blocks." + std::to_string(layer) + "."; }
}  // namespace

std::int64_t Block::workspace_bytes(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e,
                                    const EngramCfg& g, int layer, bool engram, int max_seqs,
                                    int T, int ep) {
  const std::int64_t N = std::int64_t(max_seqs) * T;
  const bool bf16 = ctx.bf16();
  const std::int64_t ffn = e.is_moe_layer(layer)
                               ? MoeLayer::workspace_bytes(ctx, m, e, N, ep)
                               : SwigluMlp::workspace_bytes(N, m.ffn_hidden, bf16);
  const std::int64_t layers =
      std::max({Attention::workspace_bytes(m, max_seqs, T, bf16, m.window(layer), ctx.attention), ffn,
                engram ? EngramLayer::workspace_bytes(m, g, N) : 0});
  // d_h, d_a, d_b (and d_engram) in fp32; in bf16 runs the bf16 copy of the one the norm
  // backward hands to the layers' products.
  // With pre-norm, a dense MLP's dy (the block's output gradient) as bf16, when its producer
  // wrote none.
  const bool dy16 = bf16 && m.block_norm == BlockNorm::Pre && !e.is_moe_layer(layer);
  return (engram ? 4 : 3) * Workspace::rounded(4 * N * m.d_model) +
         (bf16 ? Workspace::rounded(2 * N * m.d_model) : 0) +
         (dy16 ? Workspace::rounded(2 * N * m.d_model) : 0) + layers;
}

Block::Block(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e, const EngramCfg& g,
             const EngramHashPlan* plan, int layer, int max_seqs, int T, TensorTable& table,
             const LayerComms& comms, StepStats* stats)
    : D_(m.d_model),
      reordered_(m.block_norm == BlockNorm::Reordered),
      bf16_(ctx.bf16()),
      eps_(static_cast<float>(m.norm_eps)),
      attn_norm_(table.add(TensorSpec::gain(block_prefix(layer) + "attn_norm.weight", D_))),
      ffn_norm_(table.add(TensorSpec::gain(block_prefix(layer) + "ffn_norm.weight", D_))),
      attn_(ctx, m, block_prefix(layer) + "attn.", max_seqs, T, table, m.window(layer)) {
  const std::int64_t N = std::int64_t(max_seqs) * T;
  if (plan) {
    EngramLayer::Sharding sh;
    sh.kind = comms.engram_shard;
    sh.comm = comms.engram;
    sh.data = comms.engram_data ? comms.engram_data : comms.engram;
    engram_ = std::make_unique<EngramLayer>(ctx, m, g, *plan, block_prefix(layer) + "engram.", N, T,
                                            table, sh, stats);
    x_engram_ = saved_floats(ctx, "block::x_engram", N * D_);
  }
  if (e.is_moe_layer(layer))
    moe_ = std::make_unique<MoeLayer>(ctx, m, e, block_prefix(layer) + "moe.", N, table, comms.ep,
                                      comms.ep_data, stats, layer);
  else
    mlp_ = std::make_unique<SwigluMlp>(ctx, block_prefix(layer) + "mlp.", m, m.ffn_hidden, N,
                                       table);
  if (!reordered_) {
    attn_in_ = saved_floats(ctx, "block::attn_in", N * D_);
    ffn_in_ = saved_floats(ctx, "block::ffn_in", N * D_);
  }
  attn_out_ = saved_floats(ctx, "block::attn_out", N * D_);
  h_ = saved_floats(ctx, "block::h", N * D_);
  ffn_out_ = saved_floats(ctx, "block::ffn_out", N * D_);
  rstd_attn_ = saved_floats(ctx, "block::rstd_attn", N);
  rstd_ffn_ = saved_floats(ctx, "block::rstd_ffn", N);
  if (bf16_ && !moe_) mlp_in16_ = KeptOperand(ctx, "block::mlp_in", N * D_);
  if (bf16_) attn_in16_ = KeptOperand(ctx, "block::attn_in", N * D_);
}

Operand Block::mlp_input(ConstMat in, bool kept) const {
  if (kept && mlp_in16_.is_bf16()) return mlp_in16_.matrix(in.extent(0), D_);
  return operand(in);
}

void Block::forward(const TensorTable& table, const RopeTables& rope, ConstMat x_block,
                    ConstIVec tokens, Mat x_out, BlockScratch& s, bool count, DocStarts docs,
                    bool x16_written, std::uint16_t* x_out16) {
  const int N = x_block.extent(0);
  ConstMat x_in = x_block;
  if (engram_) {  // x_in = x + Engram(x, tokens)
    Mat xe = buf(x_engram_, N);
    engram_->forward(table, x_block, tokens, xe, count, docs);
    add(x_block, as_cmat(xe), xe, reordered_ ? attn_in16_out() : nullptr);
    x_in = as_cmat(xe);
  } else if (input16() && !x16_written) {  // a stage's first block, or a recompute
    round_to_bf16(x_in, input16());
  }
  ConstVec g_attn(table.param(attn_norm_), D_), g_ffn(table.param(ffn_norm_), D_);
  Vec rstd_attn(rstd_attn_.data(), N), rstd_ffn(rstd_ffn_.data(), N);
  Mat attn_out = buf(attn_out_, N), h = buf(h_, N), ffn_out = buf(ffn_out_, N);
  if (reordered_) {
    attn_.forward(table, rope, attn_input(x_in), attn_out, s.work, docs);
    rmsnorm_forward(as_cmat(attn_out), g_attn, eps_, x_in, h, rstd_attn, mlp_in16_out());
    ffn_forward(table, as_cmat(h), ffn_out, s, count, /*kept=*/true);
    rmsnorm_forward(as_cmat(ffn_out), g_ffn, eps_, as_cmat(h), x_out, rstd_ffn, x_out16);
  } else {
    Mat attn_in = buf(attn_in_, N), ffn_in = buf(ffn_in_, N);
    rmsnorm_forward(x_in, g_attn, eps_, ConstMat(), attn_in, rstd_attn, attn_in16_out());
    attn_.forward(table, rope, attn_input(as_cmat(attn_in)), attn_out, s.work, docs);
    // h = x + attn_out and the FFN norm of it, in one pass.
    rmsnorm_forward_of_sum(x_in, as_cmat(attn_out), g_ffn, eps_, h, ffn_in, rstd_ffn,
                           mlp_in16_out());
    ffn_forward(table, as_cmat(ffn_in), ffn_out, s, count, /*kept=*/true);
    add(as_cmat(h), as_cmat(ffn_out), x_out, x_out16);
  }
}

BlockCache Block::new_cache(const ModelCfg& m, int capacity) const {
  BlockCache c;
  c.kv = KvCache(m, capacity);
  if (engram_) c.inputs = View1F("block::decode_inputs", std::int64_t(capacity) * D_);
  return c;
}

void Block::decode(const TensorTable& table, const RopeTables& rope, ConstMat x_block,
                   ConstIVec tokens, int pos, BlockCache& cache, Mat x_out, BlockScratch& s,
                   DocStarts docs) {
  const int n = x_block.extent(0), D = D_;
  ConstMat x_in = x_block;
  if (engram_) {
    // The new inputs join the history; Engram runs on the window its new outputs read, a
    // sequence from position w0 (its first positions' outputs are not needed).
    Kokkos::deep_copy(ExecSpace(), Mat(cache.inputs.data() + std::int64_t(pos) * D, n, D),
                      x_block);
    const int w0 = std::max(0, pos - engram_->context()), W = pos + n - w0;
    Mat ew = buf(x_engram_, W);
    engram_->forget_staged_rows();
    engram_->forward(table, ConstMat(cache.inputs.data() + std::int64_t(w0) * D, W, D),
                     ConstIVec(tokens.data() + w0, W), ew, /*count=*/false, docs.window(w0, W));
    Mat xe(ew.data() + std::int64_t(W - n) * D, n, D);  // x + Engram(x) of the new rows
    add(x_block, as_cmat(xe), xe);
    x_in = as_cmat(xe);
  }
  ConstVec g_attn(table.param(attn_norm_), D_), g_ffn(table.param(ffn_norm_), D_);
  Vec rstd_attn(rstd_attn_.data(), n), rstd_ffn(rstd_ffn_.data(), n);
  Mat attn_out = buf(attn_out_, n), h = buf(h_, n), ffn_out = buf(ffn_out_, n);
  if (reordered_) {
    attn_.decode(table, rope, x_in, pos, cache.kv, attn_out, s.work, docs);
    rmsnorm_forward(as_cmat(attn_out), g_attn, eps_, x_in, h, rstd_attn);
    ffn_forward(table, as_cmat(h), ffn_out, s, /*count=*/false);
    rmsnorm_forward(as_cmat(ffn_out), g_ffn, eps_, as_cmat(h), x_out, rstd_ffn);
  } else {
    Mat attn_in = buf(attn_in_, n), ffn_in = buf(ffn_in_, n);
    rmsnorm_forward(x_in, g_attn, eps_, ConstMat(), attn_in, rstd_attn);
    attn_.decode(table, rope, as_cmat(attn_in), pos, cache.kv, attn_out, s.work, docs);
    add(x_in, as_cmat(attn_out), h);
    rmsnorm_forward(as_cmat(h), g_ffn, eps_, ConstMat(), ffn_in, rstd_ffn);
    ffn_forward(table, as_cmat(ffn_in), ffn_out, s, /*count=*/false);
    add(as_cmat(h), as_cmat(ffn_out), x_out);
  }
}

void Block::ffn_forward(const TensorTable& table, ConstMat in, Mat out, BlockScratch& s,
                        bool count, bool kept) {
  if (moe_)
    moe_->forward(table, in, out, s.work, s.moe_aux, count);
  else
    mlp_->forward(table, mlp_input(in, kept), out, s.work);
}

void Block::ffn_backward(TensorTable& table, ConstMat in, ConstMat dy, const std::uint16_t* dy16,
                         Mat dx, BlockScratch& s, float aux_scale) {
  if (moe_)
    moe_->backward(table, in, dy, dx, s.work, aux_scale);
  else
    mlp_->backward(table, mlp_input(in, true),
                   dy16 ? Operand{nullptr, dy16, int(dy.extent(0)), int(dy.extent(1))} : operand(dy),
                   dx, s.work);
}

void Block::backward(TensorTable& table, const RopeTables& rope, ConstMat x_block, ConstMat dx_out,
                     Mat dx_block, BlockScratch& s, float aux_scale, const std::uint16_t* dx_out16,
                     std::uint16_t* dx_in16) {
  const int N = x_block.extent(0);
  const ConstMat x_in = engram_ ? as_cmat(buf(x_engram_, N)) : x_block;
  Workspace::Frame frame(s.work);
  // With Engram the body's input gradient goes to a temporary, then through Engram.
  Mat dx_in = engram_ ? frame.mat(N, D_) : dx_block;
  ConstVec g_attn(table.param(attn_norm_), D_), g_ffn(table.param(ffn_norm_), D_);
  Vec dg_attn(table.grad(attn_norm_), D_), dg_ffn(table.grad(ffn_norm_), D_);
  ConstVec rstd_attn(rstd_attn_.data(), N), rstd_ffn(rstd_ffn_.data(), N);
  Mat d_h = frame.mat(N, D_), d_a = frame.mat(N, D_), d_b = frame.mat(N, D_);
  // In bf16 runs the norm backward whose output goes to the attention's output projection (and
  // the dense MLP) also writes it rounded: the copy those products read.
  std::uint16_t* d16 =
      bf16_ ? reinterpret_cast<std::uint16_t*>(frame.floats((std::int64_t(N) * D_ + 1) / 2))
            : nullptr;
  const auto as_operand = [&](Mat d) {
    return d16 ? Operand{nullptr, d16, N, D_} : operand(as_cmat(d));
  };
  if (reordered_) {
    rmsnorm_backward(as_cmat(buf(ffn_out_, N)), g_ffn, rstd_ffn, dx_out, ConstMat(), d_a, dg_ffn,
                     moe_ ? nullptr : d16);
    ffn_backward(table, as_cmat(buf(h_, N)), as_cmat(d_a), moe_ ? nullptr : d16, d_b, s, aux_scale);
    // d_h = dx_out + d_b, and the attention norm's backward on it, in one pass.
    rmsnorm_backward_of_sum(as_cmat(buf(attn_out_, N)), g_attn, rstd_attn, dx_out, as_cmat(d_b),
                            d_h, d_a, dg_attn, d16);
    attn_.backward(table, rope, attn_input(x_in), as_operand(d_a), d_b, s.work);
    add(as_cmat(d_h), as_cmat(d_b), dx_in, engram_ ? nullptr : dx_in16);
  } else {
    if (wants_dx_out16() && !dx_out16) {  // a stage's last block without the head
      std::uint16_t* r = frame.words(std::int64_t(N) * D_);
      round_to_bf16(dx_out, r);
      dx_out16 = r;
    }
    ffn_backward(table, as_cmat(buf(ffn_in_, N)), dx_out, moe_ ? nullptr : dx_out16, d_a, s,
                 aux_scale);
    rmsnorm_backward(as_cmat(buf(h_, N)), g_ffn, rstd_ffn, as_cmat(d_a), dx_out, d_h, dg_ffn, d16);
    attn_.backward(table, rope, attn_input(as_cmat(buf(attn_in_, N))), as_operand(d_h), d_a,
                   s.work);
    rmsnorm_backward(x_in, g_attn, rstd_attn, as_cmat(d_a), as_cmat(d_h), dx_in, dg_attn,
                     engram_ ? nullptr : dx_in16);
  }
  if (engram_) {  // dx = dx_e + Engram backward (through RMSNorm_q(x))
    Mat dq = d_a;
    engram_->backward(table, x_block, as_cmat(dx_in), dq, s.work);
    add(as_cmat(dx_in), as_cmat(dq), dx_block, dx_in16);
  }
}

void Block::finish_step(StepStats& stats, const DataComm& stage_replicas,
                        const Communicator& stage_replicas_mpi, bool write) const {
  if (engram_) engram_->finish_step(stats, stage_replicas, stage_replicas_mpi, write);
}

void Block::after_optimizer_step(TensorTable& table, const StepStats& stats) const {
  if (moe_) moe_->after_optimizer_step(table, stats);
}

}  // namespace kmoe
