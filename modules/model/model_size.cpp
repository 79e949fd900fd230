#include "modules/model/model_size.hpp"

#include <algorithm>

#include "core/checked_size.hpp"
#include "modules/engram/engram_hash.hpp"
#include "modules/engram/row_cache.hpp"
#include "modules/model/stage.hpp"

namespace kmoe {

const char* size_keys() {
  return "model.vocab_size, model.d_model, model.n_layers, model.n_heads, model.ffn_hidden, "
         "moe.experts, moe.expert_hidden, moe.shared_experts x moe.shared_hidden, "
         "engram.table_size, engram.embed_per_ngram, train.micro_batch, train.seq_len";
}

namespace {

// The sizes of one model: every count and byte figure goes through checked Size arithmetic.
// Activations are counted in bytes: 4 per fp32 value, `kb` per value a bf16 run keeps as bf16
// (MODEL.md section 8; 4 in other runs).
struct Shapes {
  Size V, D, F, L, qd, kd, attn, E, Fe, k, shared, Fs, N, H, W, attn_core, kb;
  bool tied, pre;
  Shapes(const ModelCfg& m, const MoeCfg& e, int b, int T, Precision precision,
         AttentionKernel attention = AttentionKernel::Auto)
      : V(m.vocab_size),
        D(m.d_model),
        F(m.ffn_hidden),
        L(m.n_layers),
        qd(Size(m.n_heads) * m.head_dim()),
        kd(Size(m.n_kv_heads) * m.head_dim()),
        attn(Size(2) * D + (qd + Size(2) * kd) * D + D * qd + (m.qk_norm ? qd + kd : Size(0))),
        E(e.experts),
        Fe(e.expert_hidden),
        k(e.top_k),
        shared(Size(3) * e.shared_experts * e.shared_hidden * D),
        Fs(Size(e.shared_experts) * e.shared_hidden),
        N(Size(b) * T),
        H(m.n_heads),
        W(qd + Size(2) * kd),
        // The attention core's saved state (the tiled core: the probabilities) in bytes; a window
        // keeps at most this.
        attn_core(attention_core_sizes(choose_attention_path(attention, m).path,
                                       Attention::core_dims(m, b, T, 0),
                                       precision == Precision::Bf16)
                      .saved),
        kb(precision == Precision::Bf16 ? 2 : 4),
        tied(m.tie_embeddings),
        pre(m.block_norm == BlockNorm::Pre) {}

  // Saved activations of one block (bytes): attention and norms (q, k, v and the merged heads
  // kept, the core's state; in bf16 the attention input's bf16 copy), then a dense MLP's
  // (pre-activations and activation, kept; in bf16 its input's bf16 copy too).
  Size attn_saved() const {
    return Size(4) * (N * W + Size(2) * N + N * D * (pre ? 5 : 3) + Size(2) * N) +
           kb * (N * qd + Size(2) * N * kd + N * qd) + attn_core +
           (kb.get() == 2 ? kb * N * D : Size(0));
  }
  Size mlp_saved() const { return kb * N * 3 * F + (kb.get() == 2 ? kb * N * D : Size(0)); }
  Size block_saved() const { return attn_saved() + mlp_saved(); }
  // An MoE layer saves logits/probs (N, E), up to N*k rows of inputs (kept unless ep > 1 with
  // d_model odd), outputs, the hiddens (kept; without expert parallelism only: with it the
  // expert side keeps them), and its shared experts' pre-activations and activation (kept).
  // With expert parallelism the expert side keeps its received rows and hiddens, sized for
  // twice a balanced share of the rows.
  Size moe_saved(int ep) const {
    const Size slots = N * k, rows_kb = ep == 1 || D.get() % 2 == 0 ? kb : Size(4);
    Size bytes = Size(4) * (Size(2) * N * E + N + Size(3) * slots + slots * D) +
                 rows_kb * slots * D + kb * N * Size(3) * Fs;
    if (ep <= 1) bytes += kb * slots * Size(3) * Fe;
    return bytes + expert_side_saved(ep);
  }
  // With expert parallelism: what the expert side keeps for backward (the received rows and
  // the hidden activations), sized for twice a balanced share of the rows.
  Size expert_side_saved(int ep) const {
    if (ep <= 1) return 0;
    const Size slots = N * k, rows_kb = D.get() % 2 == 0 ? kb : Size(4);
    return Size(2) * slots * (rows_kb * D + kb * Size(3) * Fe);
  }
};

// Engram layer parameters of one table row block of `rows` rows.
Size engram_params(const EngramCfg& g, Size D, Size rows) {
  const Size d_mem = Size(g.max_ngram - 1) * g.embed_per_ngram;
  return rows * (g.embed_per_ngram / g.heads) + Size(2) * D * d_mem + Size(5) * D + D * g.kernel;
}

// Everything an Engram layer keeps for one micro-batch of N tokens (bytes): the looked-up
// rows kept (`kb`) unless the table is sharded.
Size engram_saved(const EngramCfg& g, Size D, Size N, Size kb, bool sharded) {
  const Size d_mem = Size(g.max_ngram - 1) * g.embed_per_ngram;
  return (sharded ? Size(4) : kb) * N * d_mem +
         Size(4) * (Size(7) * N * D + Size(5) * N + N * ((g.max_ngram - 1) * g.heads));
}

template <class F>
auto checked(F&& f) {
  try {
    return f();
  } catch (const SizeOverflow&) {
    KMOE_FAIL("the model's sizes overflow 64-bit integers: reduce the keys they follow ("
              << size_keys() << ")");
  }
}

}  // namespace

ModelSize model_size(const ModelCfg& m, const MoeCfg& e, int b, int T, const EngramCfg& g) {
  return checked([&] {
    const Shapes s(m, e, b, T, Precision::Fp32);
    const Size V = s.V, D = s.D, F = s.F, L = s.L;
    Size moe_layers = 0;
    for (int l = 0; l < m.n_layers; ++l) moe_layers += e.is_moe_layer(l) ? 1 : 0;
    ModelSize out;
    const Size outside = V * D + D + (s.tied ? Size(0) : V * D);
    Size total = L * s.attn + (L - moe_layers) * 3 * F * D +
                 moe_layers * (s.E * D + Size(3) * s.E * s.Fe * D + s.shared) + outside;
    Size active = L * s.attn + (L - moe_layers) * 3 * F * D +
                  moe_layers * (s.E * D + Size(3) * s.k * s.Fe * D + s.shared) + outside;
    // The LM head matmul counts (tied or not); the embedding lookup does not.
    const Size d_mem = Size(g.max_ngram - 1) * g.embed_per_ngram;
    for (const auto& plan :
         engram_hash_plans(g, load_engram_compression(g, m.vocab_size).vocab_c)) {
      total += engram_params(g, D, plan.rows);
      active += d_mem + engram_params(g, D, 0);
    }
    const Size matmul = active - (s.tied ? Size(0) : V * D) -
                        Size(static_cast<std::int64_t>(g.layers.size())) * d_mem;  // lookups
    out.total_params = total.get();
    out.active_params = active.get();
    out.embedding_params = (V * D).get();
    out.flops_per_token = 6.0 * double(matmul.get()) + 6.0 * double(L.get()) * double(D.get()) * T;
    out.state_bytes = (Size(16) * total).get();
    const Size stage = (L + 1) * s.N * D + Size(2) * s.N * D + s.N * D + s.N * V + Size(3) * s.N;
    const Size workspace =
        Stage::workspace_bytes(RunContext(), m, e, g, StagePlan::whole(), b, T, /*ep=*/1);
    out.activation_bytes =
        (L * s.block_saved() + moe_layers * s.moe_saved(1) + workspace + Size(4) * stage).get();
    return out;
  });
}

RankMemory rank_memory(const ModelCfg& m, const MoeCfg& e, const EngramCfg& g, int b, int T,
                       const RankShare& r) {
  return checked([&] {
    const Shapes s(m, e, b, T, r.precision, r.attention);
    const Size V = s.V, D = s.D, N = s.N;
    const auto plans = engram_hash_plans(g, load_engram_compression(g, m.vocab_size).vocab_c);
    Size elements = 0, saved = 0;   // parameters and buffers; one instance's activations (bytes)
    Size experts = 0, sharded = 0;  // of the elements: routed experts, sharded Engram rows
    Size gemm = 0;                  // of the elements: dense tensors only products read
    Size expert_side = 0;           // every instance's expert-side saved buffers (ep > 1)
    const Size d_mem = Size(g.max_ngram - 1) * g.embed_per_ngram;
    Size blocks = 0;
    // Under recompute the blocks share one pool: each kind of saved buffer once (the largest).
    Size pool_attn = 0, pool_mlp = 0, pool_moe = 0, pool_engram = 0;
    Size host_rows = 0, host_extra = 0, caches = 0, to_dev = 0, from_dev = 0;  // engram.offload
    for (int l = r.first_block; l < r.last_block; ++l) {
      blocks += 1;
      elements += s.attn;
      gemm += (s.qd + Size(2) * s.kd) * D + D * s.qd;
      saved += s.attn_saved();
      pool_attn = s.attn_saved();
      if (e.is_moe_layer(l)) {
        const Size local_experts = s.E.get() / std::max(1, r.ep);
        const Size mine = Size(3) * local_experts * s.Fe * D;
        experts += mine;
        elements += s.E * D + mine + s.shared + (e.bias_update_rate > 0 ? s.E : Size(0));
        gemm += s.shared;
        saved += s.moe_saved(r.ep);
        pool_moe = s.moe_saved(r.ep);
        expert_side = r.recompute ? s.expert_side_saved(r.ep)
                                  : expert_side + Size(r.in_flight) * s.expert_side_saved(r.ep);
      } else {
        elements += Size(3) * s.F * D;
        gemm += Size(3) * s.F * D;
        saved += s.mlp_saved();
        pool_mlp = s.mlp_saved();
      }
      for (const auto& plan : plans) {
        if (plan.layer != l) continue;
        const int members = std::max(1, r.engram_members);
        const Size rows = (plan.rows + members - 1) / members;
        const int dh = g.embed_per_ngram / g.heads;
        if (r.engram_offload) {  // the table's rows on the host, a row cache per instance
          elements += engram_params(g, D, 0);
          host_rows += rows * dh;
          const Size lookups = N * Size((g.max_ngram - 1) * g.heads);
          // a holder of a sharded table: room for twice a balanced share of the requests
          const Size requests = lookups * std::min(members, 2);
          caches += Size(EngramRowCache::device_bytes(dh, requests.get()));
          host_extra += Size(r.in_flight) * Size(EngramRowCache::host_bytes(dh, requests.get())) +
                        Size(4) * plan.rows;  // + the rows-touched flags
          // rows and slots in; each request's row gradient out (and its id, sharded)
          // (a balanced share: as many requests served as made; a sharded table's holders
          // serve a recomputed forward again)
          const Size fetches = r.recompute && members > 1 ? 2 : 1;
          to_dev += fetches * lookups * Size(4 * dh + 4);
          from_dev += lookups * Size(4 * dh) + fetches * lookups * Size(members > 1 ? 4 : 0);
        } else {
          elements += engram_params(g, D, rows);
          if (members > 1) sharded += rows * dh;
        }
        gemm += Size(2) * D * d_mem;
        const Size mine = engram_saved(g, D, N, s.kb, members > 1);
        saved += mine;
        if (mine.get() > pool_engram.get()) pool_engram = mine;
      }
    }
    if (r.embed) elements += V * D;
    if (r.head) elements += D + V * D;  // final norm; lm_head, or the last stage's tied copy
    if (r.head && !s.tied) gemm += V * D;
    if (r.head && s.tied && r.embed) elements = elements - V * D;  // one matrix for both
    Size stage = (blocks + 1) * N * D + Size(4) * N * D + Size(3) * N;
    if (r.head) stage += N * D;  // d normed (the chunks' logits are workspace)
    RankMemory out;
    out.elements = elements.get();
    out.expert_elements = experts.get();
    out.sharded_elements = sharded.get();
    // Sharded moments: each replicated tensor's over its replicas (rounded up); the embedding
    // tied across stages (pp > 1) stays whole.
    const Size tied_whole = s.tied && r.embed != r.head ? V * D : Size(0);
    const Size dense = elements - experts - sharded - tied_whole;
    const Size dr = std::max(1, r.dense_replicas), er = std::max(1, r.expert_replicas);
    const Size moments = (dense + dr - Size(1)).get() / dr.get() +
                         Size((experts + er - Size(1)).get() / er.get()) + sharded + tied_whole;
    out.moment_elements = moments.get();
    // bf16: the tensors only products read as bf16 copies, their fp32 master rows split like
    // the moments (all of them without sharded state).
    const bool bf16 = r.precision == Precision::Bf16;
    const Size dense_copies = bf16 ? gemm : Size(0);
    const Size expert_copies = bf16 ? experts : Size(0);
    const Size copies = dense_copies + expert_copies;
    const Size masters = (dense_copies + dr - Size(1)).get() / dr.get() +
                         Size((expert_copies + er - Size(1)).get() / er.get());
    out.gemm_elements = gemm.get();
    out.copy_elements = copies.get();
    out.param_bytes = (Size(4) * (elements - copies) + Size(2) * copies + Size(4) * masters).get();
    out.state_bytes = (Size(out.param_bytes) + Size(4) * elements + Size(8) * moments).get();
    // Recompute: every instance keeps its residual streams; the pool, and the buffer a block's
    // second forward writes its output to, once.
    const Size kept = r.recompute ? Size(r.in_flight) * Size(4) * stage + pool_attn + pool_mlp +
                                        pool_moe + pool_engram + Size(4) * N * D
                                  : Size(r.in_flight) * (saved + Size(4) * stage);
    // The instances share one workspace for their layers' temporaries.
    StagePlan plan;
    plan.first_block = r.first_block;
    plan.last_block = r.last_block;
    plan.embed = r.embed;
    plan.head = r.head;
    RunContext ctx;
    ctx.precision = r.precision;
    ctx.batch_threads = r.batch_threads;
    ctx.attention = r.attention;
    const Size workspace = Stage::workspace_bytes(ctx, m, e, g, plan, b, T, std::max(1, r.ep));
    out.activation_bytes = (kept + workspace + Size(r.in_flight) * caches).get();
    out.row_cache_bytes = (Size(r.in_flight) * caches).get();
    out.host_elements = host_rows.get();
    out.host_bytes = (Size(16) * host_rows + host_extra).get();
    out.offload_to_device = to_dev.get();
    out.offload_from_device = from_dev.get();
    if (expert_side.get() > 0)
      out.expert_side_bytes =
          (expert_side + Size(MoeLayer::expert_side_workspace_bytes(ctx, m, e, N.get(), r.ep)))
              .get();
    return out;
  });
}

}  // namespace kmoe
