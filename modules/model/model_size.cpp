#include "modules/model/model_size.hpp"

#include "modules/engram/engram_hash.hpp"

namespace kmoe {

ModelSize model_size(const ModelCfg& m, const MoeCfg& e, int b, int T, const EngramCfg& g) {
  const std::int64_t V = m.vocab_size, D = m.d_model, F = m.ffn_hidden, L = m.n_layers;
  const std::int64_t qd = std::int64_t(m.n_heads) * m.head_dim();
  const std::int64_t kd = std::int64_t(m.n_kv_heads) * m.head_dim();
  const std::int64_t attn = 2 * D + (qd + 2 * kd) * D + D * qd + (m.qk_norm ? qd + kd : 0);
  const std::int64_t E = e.experts, Fe = e.expert_hidden, k = e.top_k;
  const std::int64_t shared = 3 * std::int64_t(e.shared_experts) * e.shared_hidden * D;
  std::int64_t moe_layers = 0;
  for (int l = 0; l < L; ++l) moe_layers += e.is_moe_layer(l) ? 1 : 0;
  ModelSize s;
  s.embedding_params = V * D;
  const std::int64_t outside = V * D + D + (m.tie_embeddings ? 0 : V * D);
  s.total_params = L * attn + (L - moe_layers) * 3 * F * D +
                   moe_layers * (E * D + 3 * E * Fe * D + shared) + outside;
  s.active_params = L * attn + (L - moe_layers) * 3 * F * D +
                    moe_layers * (E * D + 3 * k * Fe * D + shared) + outside;
  // The LM head matmul counts (tied or not); the embedding lookup does not.
  const std::int64_t d_mem = std::int64_t(g.max_ngram - 1) * g.embed_per_ngram;
  for (const auto& plan : engram_hash_plans(g, load_engram_compression(g, V).vocab_c)) {
    s.total_params +=
        plan.rows * (g.embed_per_ngram / g.heads) + 2 * D * d_mem + 5 * D + D * g.kernel;
    s.active_params += d_mem + 2 * D * d_mem + 5 * D + D * g.kernel;
  }
  const std::int64_t matmul_params =
      s.active_params - (m.tie_embeddings ? 0 : V * D) -
      std::int64_t(g.layers.size()) * d_mem;  // lookups are not matmuls
  s.flops_per_token = 6.0 * matmul_params + 6.0 * L * D * T;
  s.state_bytes = 4 * 4 * s.total_params;

  const std::int64_t N = std::int64_t(b) * T, H = m.n_heads, W = qd + 2 * kd;
  const std::int64_t probs = std::int64_t(b) * H * T * T;
  const std::int64_t attn_saved = N * W + 2 * N + N * qd + 2 * N * kd + probs + N * qd;
  const std::int64_t block_saved =
      attn_saved + N * 3 * F + N * D * (m.block_norm == BlockNorm::Pre ? 5 : 3) + 2 * N;
  const std::int64_t scratch = 2 * N * qd + probs + 2 * N * kd + N * W + N * 3 * F + 3 * N * D;
  const std::int64_t stage = (L + 1) * N * D + 2 * N * D + 2 * N * D + N * V + 3 * N;
  // An MoE layer saves logits/probs (N, E) and up to N*k rows of inputs, outputs and hiddens.
  const std::int64_t moe_saved = 2 * N * E + N + 3 * N * k + N * k * (2 * D + 3 * Fe);
  s.activation_bytes = 4 * (L * block_saved + moe_layers * moe_saved + scratch + stage);
  return s;
}

}  // namespace kmoe
