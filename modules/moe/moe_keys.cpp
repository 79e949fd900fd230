#include "modules/moe/moe_keys.hpp"

#include <string>
#include <vector>

#include "core/error.hpp"

namespace kmoe {

namespace {

void check_moe(const MoeCfg& e, const ModelCfg& m, int ep, const deck::Locate& locate) {
  KMOE_DECK_REQUIRE(e.experts >= 0, "moe.experts", "moe.experts must be >= 0 (0 = dense)");
  if (e.experts == 0) return;
  KMOE_DECK_REQUIRE(e.top_k >= 1 && e.top_k <= e.experts, "moe.top_k",
                    "moe.top_k must be in [1, moe.experts = " << e.experts << "]");
  KMOE_DECK_REQUIRE(e.expert_hidden >= 1, "moe.expert_hidden",
                    "moe.expert_hidden must be positive when moe.experts > 0");
  KMOE_DECK_REQUIRE(
      e.experts % ep == 0, "moe.experts",
      "moe.experts (" << e.experts << ") must be divisible by parallel.ep (" << ep << ")");
  KMOE_DECK_REQUIRE(e.lb_coef >= 0, "moe.lb_coef", "moe.lb_coef must be >= 0");
  KMOE_DECK_REQUIRE(e.z_coef >= 0, "moe.z_coef", "moe.z_coef must be >= 0");
  KMOE_DECK_REQUIRE(e.capacity_factor >= 0, "moe.capacity_factor",
                    "moe.capacity_factor must be >= 0 (0 = dropless)");
  KMOE_DECK_REQUIRE(e.bias_update_rate >= 0, "moe.bias_update_rate",
                    "moe.bias_update_rate must be >= 0 (0 = off)");
  KMOE_DECK_REQUIRE(e.shared_experts >= 0, "moe.shared_experts", "moe.shared_experts must be >= 0");
  KMOE_DECK_REQUIRE(e.shared_experts == 0 || e.shared_hidden >= 1, "moe.shared_hidden",
                    "moe.shared_hidden must be positive when moe.shared_experts > 0");
  KMOE_DECK_REQUIRE(e.layers.empty() || e.dense_layers.empty(), "moe.dense_layers",
                    "give moe.layers or moe.dense_layers, not both");
  for (const char* key : {"moe.layers", "moe.dense_layers"}) {
    const std::vector<int>& blocks = std::string(key) == "moe.layers" ? e.layers : e.dense_layers;
    for (int l : blocks)
      KMOE_DECK_REQUIRE(l >= 0 && l < m.n_layers, key,
                        key << " entry " << l << " is not a block in [0, " << m.n_layers << ")");
    deck::check_distinct(blocks, key, locate);
  }
}

void declare_moe(deck::Schema& s, Config& c) {
  s.key(c.moe.experts, "experts", 0, "routed experts E; 0 = dense");
  s.key(c.moe.top_k, "top_k", 2, "experts per token k");
  s.key(c.moe.expert_hidden, "expert_hidden", 0,
        "hidden width Fe of each expert (needed with experts)");
  s.key(c.moe.layers, "layers", std::vector<int>{},
        "MoE blocks, comma-separated; empty = every block not in dense_layers");
  s.key(c.moe.dense_layers, "dense_layers", std::vector<int>{},
        "blocks kept dense when layers is empty");
  s.key(c.moe.score, "score", RouterScore::Softmax, "router scores: softmax | sigmoid");
  s.key(c.moe.normalize_topk, "normalize_topk", false, "divide the k weights by their sum");
  s.key(c.moe.lb_coef, "lb_coef", 0.01, "weight of the load-balancing loss");
  s.key(c.moe.z_coef, "z_coef", 0.001, "weight of the router z-loss");
  s.key(c.moe.capacity_factor, "capacity_factor", 0.0,
        "expert capacity ceil(cf * N * k / E) per micro-batch; 0 = dropless");
  s.key(c.moe.shared_experts, "shared_experts", 0, "shared experts S (weight 1, every token)");
  s.key(c.moe.shared_hidden, "shared_hidden", 0, "hidden width Fs of each shared expert");
  s.key(c.moe.bias_update_rate, "bias_update_rate", 0.0,
        "aux-loss-free balancing rate gamma (DeepSeek-V3); 0 = off");
  s.key(c.moe.expert_gemm, "expert_gemm", ExpertGemm::Auto,
        "expert GEMMs: grouped (one launch per product, row counts read on the device) | "
        "per_expert (vendor BLAS per expert, row counts read on the host) | auto (per_expert: "
        "the faster on CPUs and, measured on an H200, on GPUs)");
}

}  // namespace

deck::DeckSection moe_deck_section() {
  return {
      "moe", "mixture of experts (MODEL.md section 3); experts = 0 is a dense model", declare_moe,
      [](const Config& c, const deck::Locate& l) { check_moe(c.moe, c.model, c.parallel.ep, l); },
      2};
}

}  // namespace kmoe
