#include "modules/model/model_keys.hpp"

#include <utility>

#include "core/error.hpp"

namespace kmoe {

namespace {

void check_model(const ModelCfg& m, const deck::Locate& locate) {
  const std::pair<const char*, int> dims[] = {
      {"model.vocab_size", m.vocab_size}, {"model.d_model", m.d_model},
      {"model.n_layers", m.n_layers},     {"model.n_heads", m.n_heads},
      {"model.n_kv_heads", m.n_kv_heads}, {"model.ffn_hidden", m.ffn_hidden}};
  for (const auto& [key, value] : dims) {
    KMOE_DECK_REQUIRE(value >= 1, key, key << " must be positive");
  }
  KMOE_DECK_REQUIRE(m.d_model % m.n_heads == 0, "model.n_heads",
                    "model.n_heads must divide model.d_model (" << m.d_model << ")");
  KMOE_DECK_REQUIRE(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
                    "model.n_kv_heads must divide model.n_heads (" << m.n_heads << ")");
  KMOE_DECK_REQUIRE(m.head_dim() % 2 == 0, "model.n_heads",
                    "head dim model.d_model / model.n_heads = " << m.d_model << " / " << m.n_heads
                                                                << " = " << m.head_dim()
                                                                << " must be even (RoPE rotates "
                                                                   "the two halves of a head)");
  KMOE_DECK_REQUIRE(m.norm_eps > 0, "model.norm_eps", "model.norm_eps must be positive");
  KMOE_DECK_REQUIRE(m.rope_theta > 0, "model.rope_theta", "model.rope_theta must be positive");
  KMOE_DECK_REQUIRE(m.init_std > 0, "model.init_std",
                    "model.init_std = " << m.init_std << ": must be positive");
  KMOE_DECK_REQUIRE(m.init_gain > 0, "model.init_gain",
                    "model.init_gain = " << m.init_gain << ": must be positive");
  KMOE_DECK_REQUIRE(m.embed_init_std > 0, "model.embed_init_std",
                    "model.embed_init_std = " << m.embed_init_std << ": must be positive");
  KMOE_DECK_REQUIRE(m.output_z_coef >= 0, "model.output_z_coef",
                    "model.output_z_coef must be non-negative");
  KMOE_DECK_REQUIRE(
      m.sliding_window >= 0, "model.sliding_window",
      "model.sliding_window = " << m.sliding_window << ": must be a positive window or 0 (off)");
  for (int l : m.window_layers)
    KMOE_DECK_REQUIRE(
        l >= 0 && l < m.n_layers, "model.window_layers",
        "model.window_layers entry " << l << " is not a block in [0, " << m.n_layers << ")");
  deck::check_distinct(m.window_layers, "model.window_layers", locate);
}

void declare_model(deck::Schema& s, Config& c) {
  s.required(c.model.vocab_size, "vocab_size", "token vocabulary size V");
  s.required(c.model.d_model, "d_model", "hidden width D");
  s.required(c.model.n_layers, "n_layers", "number of transformer blocks L");
  s.required(c.model.n_heads, "n_heads", "query heads H; D/H must be even (RoPE half split)");
  s.derived<int>(
      c.model.n_kv_heads, "n_kv_heads", "n_heads", [&c] { return c.model.n_heads; },
      "key/value heads Hkv (grouped-query attention); must divide n_heads");
  s.required(c.model.ffn_hidden, "ffn_hidden", "hidden width F of the dense SwiGLU MLP");
  s.key(c.model.norm_eps, "norm_eps", 1e-6, "RMSNorm epsilon");
  s.key(c.model.rope_theta, "rope_theta", 500000.0, "RoPE base theta");
  s.key(c.model.qk_norm, "qk_norm", true, "RMSNorm over projected queries and keys");
  s.key(c.model.block_norm, "block_norm", BlockNorm::Reordered,
        "reordered (norm on the branch output, OLMo2) | pre (norm on the branch input, Llama)");
  s.key(c.model.tie_embeddings, "tie_embeddings", false, "LM head reuses the embedding matrix");
  s.key(c.model.init_std, "init_std", 0.02,
        "std of the truncated-normal matrices under model.init = normal");
  s.key(c.model.init, "init", InitScheme::Normal,
        "matrix initialization (MODEL.md section 7): normal (N(0, model.init_std)) | fan_in "
        "(N(0, model.init_gain / sqrt(input width)))");
  s.key(c.model.init_gain, "init_gain", 1.0,
        "model.init = fan_in: the gain of every matrix's std (1/sqrt(3) = 0.577 gives "
        "PyTorch's nn.Linear default variance)");
  s.key(c.model.init_depth_scale, "init_depth_scale", false,
        "divide the output projections' std (attention wo, every w2) by sqrt(2 * n_layers)");
  s.derived<double>(
      c.model.embed_init_std, "embed_init_std", "model.init_std", [&c] { return c.model.init_std; },
      "std of the embedding matrix");
  s.key(c.model.output_z_coef, "output_z_coef", 0.0, "weight of the output z-loss");
  s.key(c.model.sliding_window, "sliding_window", 0,
        "sliding-window attention: a position reads its W most recent positions (itself "
        "included) in the blocks of window_layers; 0 = off");
  s.derived<std::vector<int>>(
      c.model.window_layers, "window_layers", "every block but each 4th",
      [&c] {
        return c.model.sliding_window > 0 ? ModelCfg::default_window_layers(c.model.n_layers)
                                          : std::vector<int>{};
      },
      "blocks with the sliding window, comma-separated; default OLMo 3's pattern: every block "
      "but 3, 7, 11, ... (those keep full causal attention)");
}

}  // namespace

deck::DeckSection model_deck_section() {
  return {"model", "transformer shape and initialisation (MODEL.md)", declare_model,
          [](const Config& c, const deck::Locate& l) { check_model(c.model, l); }, 0};
}

}  // namespace kmoe
