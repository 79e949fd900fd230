#include "modules/model/stage.hpp"

#include <algorithm>

#include "core/device_sync.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {
// Every block's columns in metrics.csv order: the MoE layers' in block order, then the Engram
// layers'.
void declare_model_stats(StepStats& stats, const ModelCfg& m, const MoeCfg& e, const EngramCfg& g) {
  for (int l = 0; l < m.n_layers; ++l)
    if (e.is_moe_layer(l)) MoeLayer::declare_stats(stats, l, e);
  for (int l = 0; l < m.n_layers; ++l)
    if (std::find(g.layers.begin(), g.layers.end(), l) != g.layers.end())
      EngramLayer::declare_stats(stats, l);
}
}  // namespace

std::vector<TensorSpec> model_tensors(const Config& cfg) {
  TensorTable table;
  const Stage stage(RunContext(), cfg.model, cfg.moe, /*max_seqs=*/1, /*seq_len=*/2, table,
                    cfg.engram);
  std::vector<TensorSpec> out;
  for (const TensorEntry& e : table.entries()) out.push_back(e.spec);
  return out;
}

std::int64_t Stage::workspace_bytes(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e,
                                    const EngramCfg& g, const StagePlan& plan, int max_seqs,
                                    int T, int ep) {
  const int last = plan.last_block < 0 ? m.n_layers : plan.last_block;
  std::int64_t bytes = plan.head ? LmHead::workspace_bytes(ctx, m, std::int64_t(max_seqs) * T) : 0;
  bool dy16 = false;
  for (int l = plan.first_block; l < last; ++l) {
    const bool engram = std::find(g.layers.begin(), g.layers.end(), l) != g.layers.end();
    bytes = std::max(bytes, Block::workspace_bytes(ctx, m, e, g, l, engram, max_seqs, T, ep));
    dy16 = dy16 || (ctx.bf16() && m.block_norm == BlockNorm::Pre && !e.is_moe_layer(l));
  }
  // backward(): the gradients between the blocks as bf16 (Block::wants_dx_out16).
  return bytes + (dy16 ? 2 * Workspace::rounded(2 * std::int64_t(max_seqs) * T * m.d_model) : 0);
}

Stage::Stage(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e, int max_seqs, int T,
             TensorTable& table, const EngramCfg& g, const StagePlan& plan,
             const LayerComms& comms, StepStats* stats)
    : model_(m),
      D_(m.d_model),
      T_(T),
      max_seqs_(max_seqs),
      first_(plan.first_block),
      has_embed_(plan.embed),
      has_head_(plan.head),
      rope_(T, m.head_dim(), m.rope_theta),
      compression_(load_engram_compression(g, m.vocab_size)),
      tokens_("stage::tokens", max_seqs * T),
      d_x_("stage::d_x", std::int64_t(max_seqs) * T * m.d_model),
      d_y_("stage::d_y", std::int64_t(max_seqs) * T * m.d_model),
      recompute_(ctx.pool != nullptr && ctx.pool->blocks_share()),
      top_k_(e.top_k) {
  if (stats) declare_model_stats(*stats, m, e, g);
  const int last = plan.last_block < 0 ? m.n_layers : plan.last_block;
  KMOE_REQUIRE(first_ >= 0 && first_ < last && last <= m.n_layers,
               "Stage: blocks [" << first_ << ", " << last << ") of " << m.n_layers);
  // Declaration order is the model's (embedding, blocks, head): checkpoints list it so.
  if (has_embed_) {
    embed_ =
        std::make_unique<Embedding>(m.vocab_size, m.d_model, m.embedding_std(), max_seqs * T, table);
    embed_weight_ = embed_->weight_index();
  }
  // Engram's primes are drawn over all Engram layers of the model, in block order.
  auto plans = engram_hash_plans(g, compression_.vocab_c);
  for (auto& p : plans) p.pad_c = compression_.map[g.pad_id];
  for (int l = first_; l < last; ++l) {
    const EngramHashPlan* ep = nullptr;
    for (const auto& p : plans)
      if (p.layer == l) ep = &p;
    if (ctx.pool) ctx.pool->begin_block();  // a pool whose blocks share: the next block's buffers
    blocks_.push_back(
        std::make_unique<Block>(ctx, m, e, g, ep, l, max_seqs, T, table, comms, stats));
  }
  if (has_head_) {
    if (m.tie_embeddings && !has_embed_) {  // the last stage's replica of the tied matrix
      embed_weight_ =
          table.add(Embedding::weight_spec(m.vocab_size, m.d_model, m.embedding_std()).as_tied_copy());
    }
    head_ = std::make_unique<LmHead>(ctx, m, max_seqs * T, embed_weight_, table);
  }
  if (g.enabled()) {
    compress_ = View1I("stage::compress", m.vocab_size);
    auto h = Kokkos::create_mirror_view(compress_);
    for (int v = 0; v < m.vocab_size; ++v) h(v) = compression_.map[v];
    mark_host_sync("stage setup");
    Kokkos::deep_copy(compress_, h);
    compressed_ = View1I("stage::compressed_tokens", max_seqs * T);
  }
  if (m.document_eod >= 0) doc_start_ = View1I("stage::doc_start", max_seqs * T);
  for (std::size_t l = 0; l <= blocks_.size(); ++l)
    resid_.emplace_back("stage::resid", std::int64_t(max_seqs) * T * m.d_model);
  scratch_ = ctx.pool ? ctx.pool->shared<BlockScratch>("stage::scratch")
                      : std::make_shared<BlockScratch>();
  const int ep = comms.ep ? comms.ep->size() : 1;
  scratch_->work.reserve(workspace_bytes(ctx, m, e, g, plan, max_seqs, T, ep));
  if (recompute_)
    recomputed_ = *ctx.pool->shared<View1F>("stage::recomputed", "stage::recomputed",
                                        std::int64_t(max_seqs) * T * m.d_model);
}

LossSums Stage::forward(const TensorTable& table, const std::int32_t* tokens, int nseq,
                        float grad_scale, View1D loss_sums) {
  KMOE_REQUIRE(nseq >= 1 && nseq <= max_seqs_,
               "Stage: " << nseq << " sequences, buffers hold " << max_seqs_);
  nseq_ = nseq;
  const int N = nseq * T_;
  prefetch_engram_rows(table, tokens, nseq);
  Kokkos::View<const std::int32_t*, HostSpace, Unmanaged> host_ids(tokens, N);
  auto ids = Kokkos::subview(tokens_, Kokkos::make_pair(0, N));
  Kokkos::deep_copy(ExecSpace(), ids, host_ids);  // ordered before the kernels that read it
  ConstIVec tok(tokens_.data(), N);

  // bf16 runs: each kernel that makes a block's input also writes the block's bf16 copy.
  if (has_embed_) embed_->forward(table, tok, resid(0, N), blocks_.front()->input16());
  if (compress_.extent(0) > 0) {  // Engram reads compressed ids
    auto map = compress_;
    auto out = compressed_;
    Kokkos::parallel_for(
        "stage::compress_tokens", Range(0, N), KOKKOS_LAMBDA(int i) { out(i) = map(tok(i)); });
  }
  const ConstIVec engram_tok = engram_tokens(N);
  if (model_.document_eod >= 0) {
    document_starts(tok, nseq, T_, model_.document_eod, doc_start_);
    document_tile_starts(tokens, nseq, T_, model_.document_eod, kAttentionPlanRows, tile_start_);
  }
  const bool moe = has_moe();
  if (moe) Kokkos::deep_copy(ExecSpace(), scratch_->moe_aux, 0.0);
  for (std::size_t l = 0; l < blocks_.size(); ++l)
    blocks_[l]->forward(table, rope_, as_cmat(resid(l, N)), engram_tok, resid(l + 1, N), *scratch_,
                        /*count=*/true, planned_docs(nseq), /*x16_written=*/l > 0 || has_embed_,
                        l + 1 < blocks_.size() ? blocks_[l + 1]->input16() : nullptr);
  LossSums sums;
  if (has_head_)
    sums = head_->forward(table, as_cmat(resid(blocks_.size(), N)), tok, T_, grad_scale,
                          scratch_->work, loss_sums);
  aux_scale_ = static_cast<float>(double(grad_scale) * nseq * (T_ - 1));
  if (moe && loss_sums.extent(0) > 0) {  // stays on the device with the CE and z sums
    auto aux = scratch_->moe_aux;
    Kokkos::parallel_for(
        "stage::moe_aux", Range(0, 1), KOKKOS_LAMBDA(int) { loss_sums(2) += aux(0); });
  } else if (moe) {
    sums.moe_aux = read_to_host("moe aux loss", scratch_->moe_aux)(0);
  }
  return sums;
}

void Stage::prefetch_engram_rows(const TensorTable& table, const std::int32_t* tokens, int nseq) {
  // engram.offload = host: every Engram block's rows from the host ids, before this
  // micro-batch's first kernel (the device may still run the previous one's).
  bool any = false;
  for (const auto& block : blocks_) any = any || (block->engram() && block->engram()->host_table());
  if (!any) return;
  const int N = nseq * T_;
  host_compressed_.resize(N);
  for (int i = 0; i < N; ++i) host_compressed_[i] = compression_.map[tokens[i]];
  const int* starts = nullptr;
  if (model_.document_eod >= 0) {
    host_starts_.resize(N);
    document_starts_host(tokens, nseq, T_, model_.document_eod, host_starts_.data());
    starts = host_starts_.data();
  }
  for (const auto& block : blocks_)
    if (block->engram() && block->engram()->host_table())
      block->engram()->prefetch(table, host_compressed_.data(), starts, N);
}

void Stage::finish_step(StepStats& stats, const ProcessGrid& grid) const {
  const DataComm& replicas = grid.data_plane(grid.stage);
  for (const auto& block : blocks_)
    block->finish_step(stats, replicas, grid.stage, grid.replica() == 0);
}

void Stage::after_optimizer_step(TensorTable& table, const StepStats& stats) const {
  for (const auto& block : blocks_) block->after_optimizer_step(table, stats);
}

DecodeCache Stage::new_decode_cache() const {
  DecodeCache c;
  for (const auto& block : blocks_) c.blocks.push_back(block->new_cache(model_, max_seqs_ * T_));
  return c;
}

ConstMat Stage::decode(const TensorTable& table, const std::int32_t* ids, int pos, int n,
                       DecodeCache& cache) {
  const int L = pos + n;
  KMOE_REQUIRE(n >= 1 && pos >= 0 && L <= max_seqs_ * T_,
               "Stage::decode: positions [" << pos << ", " << L << ") beyond its "
                                            << max_seqs_ * T_ << " positions");
  nseq_ = 1;
  // The sequence's ids so far stay on the device (Engram reads a window of them).
  Kokkos::View<const std::int32_t*, HostSpace, Unmanaged> host_ids(ids, n);
  Kokkos::deep_copy(ExecSpace(), Kokkos::subview(tokens_, Kokkos::make_pair(pos, L)), host_ids);
  if (compress_.extent(0) > 0) {
    auto map = compress_;
    auto out = compressed_;
    auto tok = tokens_;
    Kokkos::parallel_for(
        "stage::compress_tokens", Range(pos, L), KOKKOS_LAMBDA(int i) { out(i) = map(tok(i)); });
  }
  if (has_embed_) embed_->forward(table, ConstIVec(tokens_.data() + pos, n), resid(0, n));
  const ConstIVec history = engram_tokens(L);
  // The document starts of positions [0, L), the whole history as one sequence.
  if (model_.document_eod >= 0)
    document_starts(ConstIVec(tokens_.data(), L), 1, L, model_.document_eod, doc_start_);
  for (std::size_t l = 0; l < blocks_.size(); ++l)
    blocks_[l]->decode(table, rope_, as_cmat(resid(l, n)), history, pos, cache.blocks[l],
                       resid(l + 1, n), *scratch_, docs(L));
  if (!has_head_) return ConstMat();
  return head_->logits(table, as_cmat(resid(blocks_.size(), n)));
}

void Stage::keep_logits() {
  if (has_head_) head_->keep_logits();
}

ConstMat Stage::last_logits() const {
  KMOE_REQUIRE(has_head_, "Stage::last_logits: the stage has no head");
  return head_->last_logits(nseq_ * T_);
}

bool Stage::has_moe() const {
  return std::any_of(blocks_.begin(), blocks_.end(),
                     [](const auto& block) { return block->is_moe(); });
}

std::vector<std::pair<int, ConstIVec>> Stage::moe_routes() const {
  std::vector<std::pair<int, ConstIVec>> routes;
  const int slots = nseq_ * T_ * top_k_;
  for (std::size_t l = 0; l < blocks_.size(); ++l)
    if (blocks_[l]->is_moe())
      routes.emplace_back(first_ + static_cast<int>(l),
                          ConstIVec(blocks_[l]->moe_routes().data(), slots));
  return routes;
}

const float* Stage::backward(TensorTable& table, const std::function<void(int)>& ready) {
  const int N = nseq_ * T_;
  Mat dy = as_mat(d_y_.data(), N, D_), dx = as_mat(d_x_.data(), N, D_);
  // bf16 runs, pre-norm dense blocks: the gradient between two blocks also as bf16, written by
  // the kernel that makes it (the head's or a block's last), read by the MLP's products.
  const bool dy16 = std::any_of(blocks_.begin(), blocks_.end(),
                                [](const auto& b) { return b->wants_dx_out16(); });
  Workspace::Frame frame(scratch_->work);
  std::uint16_t* g16[2] = {dy16 ? frame.words(std::int64_t(N) * D_) : nullptr,
                           dy16 ? frame.words(std::int64_t(N) * D_) : nullptr};
  const auto wants16 = [&](int l) {
    return l >= 0 && l < static_cast<int>(blocks_.size()) && blocks_[l]->wants_dx_out16();
  };
  const int last = static_cast<int>(blocks_.size()) - 1;
  bool written = false;  // g16[0] holds dy's bf16 copy
  if (has_head_) {
    written = wants16(last);
    head_->backward(table, as_cmat(resid(blocks_.size(), N)), dy, written ? g16[0] : nullptr);
    if (ready) ready(head_->first_tensor());
  }
  for (int l = last; l >= 0; --l) {
    if (recompute_)  // the block's saved buffers again, from its kept input
      blocks_[l]->forward(table, rope_, as_cmat(resid(l, N)), engram_tokens(N),
                          as_mat(recomputed_.data(), N, D_), *scratch_, /*count=*/false,
                          planned_docs(nseq_));
    blocks_[l]->backward(table, rope_, as_cmat(resid(l, N)), as_cmat(dy), dx, *scratch_, aux_scale_,
                         written ? g16[0] : nullptr, wants16(l - 1) ? g16[1] : nullptr);
    std::swap(dx, dy);
    std::swap(g16[0], g16[1]);
    written = wants16(l - 1);
    if (ready) ready(l > 0 || has_embed_ ? blocks_[l]->first_tensor() : 0);
  }
  if (!has_embed_) return dy.data();
  embed_->backward(table, ConstIVec(tokens_.data(), N), as_cmat(dy));
  if (ready) ready(0);
  return nullptr;
}

}  // namespace kmoe
