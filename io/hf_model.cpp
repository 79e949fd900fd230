#include "io/hf_model.hpp"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"

namespace kmoe {

using Json = nlohmann::json;  // keys sorted, as Hugging Face writes its files

const char* hf_model_type(HfArch arch) {
  switch (arch) {
    case HfArch::Olmo2:
      return "olmo2";
    case HfArch::Llama:
      return "llama";
    case HfArch::Olmoe:
      return "olmoe";
    case HfArch::FlexOlmo:
      return "flex_olmo";
  }
  return "?";
}

namespace {

const char* architecture_class(HfArch arch) {
  switch (arch) {
    case HfArch::Olmo2:
      return "Olmo2ForCausalLM";
    case HfArch::Llama:
      return "LlamaForCausalLM";
    case HfArch::Olmoe:
      return "OlmoeForCausalLM";
    case HfArch::FlexOlmo:
      return "FlexOlmoForCausalLM";
  }
  return "?";
}

bool is_moe(HfArch a) { return a == HfArch::Olmoe || a == HfArch::FlexOlmo; }

// The GPT-2 byte-level alphabet (the ByteLevel pre-tokenizer of Hugging Face tokenizers):
// printable bytes stand for themselves, the other 68 for code points 256, 257, ... in order.
std::vector<int> byte_code_points() {
  std::vector<int> cp(256, -1);
  auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  int next = 256;
  for (int b = 0; b < 256; ++b) cp[b] = printable(b) ? b : next++;
  return cp;
}

std::string utf8(int cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

constexpr const char* kEndOfDocument = "<|endoftext|>";

}  // namespace

HfArch hf_arch_for(const Config& cfg) {
  const ModelCfg& m = cfg.model;
  const MoeCfg& e = cfg.moe;
  const bool reordered = m.block_norm == BlockNorm::Reordered;
  KMOE_REQUIRE(!cfg.engram.enabled(),
               "engram.layers = " << cfg.engram.layers.size()
                                  << " layer(s): no Hugging Face model type has Engram memory");
  KMOE_REQUIRE(m.sliding_window == 0 || m.window_layers.empty(),
               "model.sliding_window = " << m.sliding_window
                                         << ": olmo2, llama, olmoe and flex_olmo have no "
                                            "sliding-window attention");
  if (!e.enabled()) {
    KMOE_REQUIRE(!reordered || m.qk_norm,
                 "model.qk_norm = false: olmo2 (model.block_norm = reordered) always applies "
                 "QK-norm");
    KMOE_REQUIRE(reordered || !m.qk_norm,
                 "model.qk_norm = true: llama (model.block_norm = pre) has no QK-norm; train "
                 "pre-norm models for llama with model.qk_norm = false");
    return reordered ? HfArch::Olmo2 : HfArch::Llama;
  }
  const char* target = reordered ? "flex_olmo" : "olmoe";
  KMOE_REQUIRE(e.shared_experts == 0, "moe.shared_experts = " << e.shared_experts << ": " << target
                                                              << " has no shared experts");
  KMOE_REQUIRE(e.score == RouterScore::Softmax,
               "moe.score = sigmoid: " << target << " routes with softmax scores");
  KMOE_REQUIRE(e.bias_update_rate == 0.0, "moe.bias_update_rate = "
                                              << e.bias_update_rate << ": " << target
                                              << " has no router bias (aux-loss-free balancing)");
  for (int l = 0; l < m.n_layers; ++l)
    KMOE_REQUIRE(e.is_moe_layer(l), "block " << l << " is dense (moe.layers / moe.dense_layers): "
                                             << target << " has experts in every block");
  KMOE_REQUIRE(m.qk_norm, "model.qk_norm = false: " << target << " always applies QK-norm");
  return reordered ? HfArch::FlexOlmo : HfArch::Olmoe;
}

std::map<std::string, std::string> hf_model_files(const Config& cfg, HfArch arch,
                                                  const std::string& torch_dtype) {
  const ModelCfg& m = cfg.model;
  const int eod = cfg.data.end_of_document(m.vocab_size);
  const Json eos = eod >= 0 ? Json(eod) : Json(nullptr);
  Json c = {{"architectures", {architecture_class(arch)}},
            {"model_type", hf_model_type(arch)},
            {"vocab_size", m.vocab_size},
            {"hidden_size", m.d_model},
            {"num_hidden_layers", m.n_layers},
            {"num_attention_heads", m.n_heads},
            {"num_key_value_heads", m.n_kv_heads},
            {"head_dim", m.head_dim()},
            {"hidden_act", "silu"},
            {"max_position_embeddings", cfg.train.seq_len},
            {"initializer_range", m.init_std},
            {"rms_norm_eps", m.norm_eps},
            {"rope_theta", m.rope_theta},
            {"rope_scaling", nullptr},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", m.rope_theta}}},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"tie_word_embeddings", m.tie_embeddings},
            {"use_cache", true},
            {"bos_token_id", nullptr},
            {"eos_token_id", eos},
            {"pad_token_id", eos},
            {"torch_dtype", torch_dtype},
            {"transformers_version", "4.57.0"}};
  if (arch == HfArch::Llama) {
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  }
  if (is_moe(arch)) {
    c["intermediate_size"] = cfg.moe.expert_hidden;
    c["num_experts"] = cfg.moe.experts;
    c["num_experts_per_tok"] = cfg.moe.top_k;
    c["norm_topk_prob"] = cfg.moe.normalize_topk;
    c["output_router_logits"] = false;
    c["router_aux_loss_coef"] = cfg.moe.lb_coef;
    c["clip_qkv"] = nullptr;
  } else {
    c["intermediate_size"] = m.ffn_hidden;
  }
  std::map<std::string, std::string> files;
  files["config.json"] = c.dump(2) + "\n";
  Json g = {{"_from_model_config", true},
            {"bos_token_id", nullptr},
            {"eos_token_id", eos},
            {"pad_token_id", eos},
            {"do_sample", false},
            {"transformers_version", "4.57.0"}};
  files["generation_config.json"] = g.dump(2) + "\n";
  if (cfg.data.tokenizer != Tokenizer::Bytes) return files;

  // kmoe-prep's ids: byte b is id b, 256 ends a document. As a Hugging Face fast tokenizer:
  // the ByteLevel pre-tokenizer (no regex split, no prefix space) maps each byte to its
  // alphabet character, a BPE model without merges maps each character to its byte's id.
  Json vocab = Json::object();
  const std::vector<int> cp = byte_code_points();
  for (int b = 0; b < 256; ++b) vocab[utf8(cp[b])] = b;
  const Json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", false},
                           {"use_regex", false}};
  Json added = Json::array();
  if (eod >= 0)
    added.push_back({{"id", eod},
                     {"content", kEndOfDocument},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  Json tok = {{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", byte_level},
              {"post_processor", nullptr},
              {"decoder", byte_level},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", Json::array()}}}};
  files["tokenizer.json"] = tok.dump(2) + "\n";
  const Json special = eod >= 0 ? Json(kEndOfDocument) : Json(nullptr);
  Json tc = {{"tokenizer_class", "PreTrainedTokenizerFast"},
             {"model_max_length", cfg.train.seq_len},
             {"clean_up_tokenization_spaces", false},
             {"bos_token", nullptr},
             {"eos_token", special},
             {"pad_token", special},
             {"unk_token", nullptr}};
  files["tokenizer_config.json"] = tc.dump(2) + "\n";
  Json sm = Json::object();
  if (eod >= 0) sm = {{"eos_token", kEndOfDocument}, {"pad_token", kEndOfDocument}};
  files["special_tokens_map.json"] = sm.dump(2) + "\n";
  return files;
}

std::vector<HfTensor> hf_tensors_of(const Config& cfg, HfArch arch, const TensorSpec& spec) {
  const std::string& n = spec.name;
  const bool reordered = arch == HfArch::Olmo2 || arch == HfArch::FlexOlmo;
  auto one = [&](const std::string& hf) { return std::vector<HfTensor>{{hf, -1, spec.shape}}; };
  if (n == "embed.weight") return one("model.embed_tokens.weight");
  if (n == "final_norm.weight") return one("model.norm.weight");
  if (n == "lm_head.weight") return one("lm_head.weight");
  // blocks.<l>.<rest>
  KMOE_REQUIRE(n.rfind("blocks.", 0) == 0, n << ": no Hugging Face name in "
                                               << hf_model_type(arch));
  const std::size_t dot = n.find('.', 7);
  const std::string layer = n.substr(7, dot - 7), rest = n.substr(dot + 1);
  const std::string p = "model.layers." + layer + ".";
  static const std::map<std::string, std::string> attn = {
      {"attn.wq", "self_attn.q_proj.weight"},         {"attn.wk", "self_attn.k_proj.weight"},
      {"attn.wv", "self_attn.v_proj.weight"},         {"attn.wo", "self_attn.o_proj.weight"},
      {"attn.q_norm.weight", "self_attn.q_norm.weight"},
      {"attn.k_norm.weight", "self_attn.k_norm.weight"},
      {"mlp.w1", "mlp.gate_proj.weight"},             {"mlp.w3", "mlp.up_proj.weight"},
      {"mlp.w2", "mlp.down_proj.weight"},             {"moe.router", "mlp.gate.weight"}};
  if (auto it = attn.find(rest); it != attn.end()) return one(p + it->second);
  // The norms: reordered (after each sublayer) and pre (before) under Hugging Face's names.
  if (rest == "attn_norm.weight")
    return one(p + (reordered ? "post_attention_layernorm.weight" : "input_layernorm.weight"));
  if (rest == "ffn_norm.weight")
    return one(p + (reordered ? "post_feedforward_layernorm.weight"
                              : "post_attention_layernorm.weight"));
  static const std::map<std::string, std::string> experts = {{"moe.experts.w1", "gate_proj"},
                                                             {"moe.experts.w3", "up_proj"},
                                                             {"moe.experts.w2", "down_proj"}};
  if (auto it = experts.find(rest); it != experts.end()) {
    std::vector<HfTensor> out;
    const std::vector<std::int64_t> shape(spec.shape.begin() + 1, spec.shape.end());
    for (int e = 0; e < cfg.moe.experts; ++e)
      out.push_back({p + "mlp.experts." + std::to_string(e) + "." + it->second + ".weight", e,
                     shape});
    return out;
  }
  KMOE_FAIL(n << ": no Hugging Face name in " << hf_model_type(arch));
  return {};
}

namespace {

// A config.json value: a number, or absent/null (the default).
bool has(const Json& c, const char* key) { return c.contains(key) && !c[key].is_null(); }

}  // namespace

HfImport hf_import_config(const std::string& path) {
  std::ifstream in(path);
  KMOE_REQUIRE(in, path << ": cannot open");
  Json c;
  try {
    c = Json::parse(in);
  } catch (const std::exception& e) {
    KMOE_FAIL(path << ": not valid JSON (" << e.what() << ")");
  }
  KMOE_REQUIRE(c.is_object() && c.contains("model_type") && c["model_type"].is_string(),
               path << ": no model_type");
  const std::string type = c["model_type"].get<std::string>();
  HfImport out;
  if (type == "olmo2")
    out.arch = HfArch::Olmo2;
  else if (type == "llama")
    out.arch = HfArch::Llama;
  else if (type == "olmoe")
    out.arch = HfArch::Olmoe;
  else if (type == "flex_olmo")
    out.arch = HfArch::FlexOlmo;
  else
    KMOE_FAIL(path << ": model_type = " << type
                   << " is not one kmoe reads (olmo2, llama, olmoe, flex_olmo)");
  auto integer = [&](const char* key) -> int {
    KMOE_REQUIRE(has(c, key) && c[key].is_number_integer(),
                 path << ": " << key << " missing or not an integer");
    return c[key].get<int>();
  };
  auto number = [&](const char* key, double fallback) -> double {
    if (!has(c, key)) return fallback;
    KMOE_REQUIRE(c[key].is_number(), path << ": " << key << " is not a number");
    return c[key].get<double>();
  };
  // Settings kmoe's model has no counterpart for, each an error naming the key.
  auto refuse = [&](const char* key, bool set, const std::string& why) {
    KMOE_REQUIRE(!set, path << ": " << key << " = " << c[key].dump() << ": " << why);
  };
  if (c.contains("rope_scaling"))
    refuse("rope_scaling", !c["rope_scaling"].is_null(), "kmoe's RoPE has no scaling");
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    const Json& rp = c["rope_parameters"];
    const bool plain = !rp.contains("rope_type") || rp["rope_type"] == "default";
    refuse("rope_parameters", !plain, "kmoe's RoPE has no scaling (rope_type default only)");
  }
  for (const char* key : {"sliding_window", "clip_qkv", "layer_types"})
    if (c.contains(key)) refuse(key, !c[key].is_null(), "kmoe has no such attention setting");
  if (c.contains("use_sliding_window"))
    refuse("use_sliding_window", c["use_sliding_window"] == true, "kmoe has no sliding windows");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (c.contains(key)) refuse(key, c[key] == true, "kmoe's linear maps have no biases");
  if (c.contains("hidden_act"))
    refuse("hidden_act", c["hidden_act"] != "silu", "kmoe's MLPs are SwiGLU (silu)");
  if (c.contains("partial_rotary_factor"))
    refuse("partial_rotary_factor", number("partial_rotary_factor", 1.0) != 1.0,
           "kmoe rotates whole heads");

  ModelCfg m;
  m.vocab_size = integer("vocab_size");
  m.d_model = integer("hidden_size");
  m.n_layers = integer("num_hidden_layers");
  m.n_heads = integer("num_attention_heads");
  m.n_kv_heads = has(c, "num_key_value_heads") ? integer("num_key_value_heads") : m.n_heads;
  KMOE_REQUIRE(m.n_heads > 0 && m.d_model % m.n_heads == 0,
               path << ": hidden_size " << m.d_model << " is not a multiple of "
                    << "num_attention_heads " << m.n_heads);
  if (has(c, "head_dim"))
    refuse("head_dim", integer("head_dim") != m.d_model / m.n_heads,
           "kmoe's head dimension is hidden_size / num_attention_heads");
  m.norm_eps = number("rms_norm_eps", 1e-6);
  double theta = number("rope_theta", 10000.0);
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object() &&
      has(c["rope_parameters"], "rope_theta"))
    theta = c["rope_parameters"]["rope_theta"].get<double>();
  m.rope_theta = theta;
  m.tie_embeddings = c.value("tie_word_embeddings", false);
  m.init_std = number("initializer_range", 0.02);
  const bool moe = is_moe(out.arch);
  m.block_norm = out.arch == HfArch::Olmo2 || out.arch == HfArch::FlexOlmo ? BlockNorm::Reordered
                                                                            : BlockNorm::Pre;
  m.qk_norm = out.arch != HfArch::Llama;
  out.vocab_size = m.vocab_size;
  if (has(c, "max_position_embeddings")) {
    out.max_position_embeddings = integer("max_position_embeddings");
    KMOE_REQUIRE(out.max_position_embeddings > 0,
                 path << ": max_position_embeddings = " << out.max_position_embeddings
                      << ": must be positive (it gives train.seq_len)");
  }
  if (has(c, "eos_token_id")) {
    // One id, or a list whose first is the end of a document.
    const Json& e = c["eos_token_id"];
    const Json& id = e.is_array() && !e.empty() ? e[0] : e;
    KMOE_REQUIRE(id.is_number_integer(), path << ": eos_token_id = " << e.dump()
                                              << ": expected an id or a list of ids");
    out.has_eos = true;
    out.eos_token_id = id.get<std::int64_t>();
  }
  // The deck's model sections, each key with the config.json key it comes from.
  std::ostringstream d;
  d.precision(17);
  std::string section;
  auto put = [&](const char* sec, const char* key, const auto& value, const char* json_key) {
    if (section != sec) d << (section.empty() ? "" : "\n") << "[" << sec << "]\n";
    section = sec;
    d << key << " = " << value << "\n";
    if (json_key) out.source_keys[std::string(sec) + "." + key] = json_key;
  };
  const bool kv_given = has(c, "num_key_value_heads");
  put("model", "vocab_size", m.vocab_size, "vocab_size");
  put("model", "d_model", m.d_model, "hidden_size");
  put("model", "n_layers", m.n_layers, "num_hidden_layers");
  put("model", "n_heads", m.n_heads, "num_attention_heads");
  put("model", "n_kv_heads", m.n_kv_heads,
      kv_given ? "num_key_value_heads" : "num_attention_heads");
  put("model", "ffn_hidden", integer("intermediate_size"), "intermediate_size");  // (unused by MoE)
  put("model", "norm_eps", m.norm_eps, "rms_norm_eps");
  put("model", "rope_theta", m.rope_theta, "rope_theta");
  put("model", "qk_norm", m.qk_norm ? "true" : "false", nullptr);
  put("model", "block_norm", choice_name(m.block_norm), nullptr);
  put("model", "tie_embeddings", m.tie_embeddings ? "true" : "false", "tie_word_embeddings");
  put("model", "init_std", m.init_std, "initializer_range");
  if (moe) {
    put("moe", "experts", integer("num_experts"), "num_experts");
    put("moe", "top_k", integer("num_experts_per_tok"), "num_experts_per_tok");
    put("moe", "expert_hidden", integer("intermediate_size"), "intermediate_size");
    put("moe", "score", "softmax", nullptr);
    put("moe", "normalize_topk", c.value("norm_topk_prob", false) ? "true" : "false",
        "norm_topk_prob");
    put("moe", "lb_coef", number("router_aux_loss_coef", 0.01), "router_aux_loss_coef");
  }
  // Keys the importer's deck derives from config.json outside these sections.
  if (out.max_position_embeddings > 0) out.source_keys["train.seq_len"] = "max_position_embeddings";
  if (out.has_eos) out.source_keys["data.eod_id"] = "eos_token_id";
  out.model_sections = d.str();
  return out;
}

bool hf_byte_level_tokenizer(const std::string& path) {
  std::ifstream in(path);
  if (!in) return false;
  Json t;
  try {
    t = Json::parse(in);
  } catch (const std::exception&) {
    return false;
  }
  if (!t.is_object() || !t.contains("model") || !t["model"].is_object()) return false;
  const Json& m = t["model"];
  if (m.value("type", "") != "BPE" || !m.contains("vocab") || !m["vocab"].is_object() ||
      !m.contains("merges") || !m["merges"].is_array() || !m["merges"].empty())
    return false;
  if (!t.contains("pre_tokenizer") || !t["pre_tokenizer"].is_object() ||
      t["pre_tokenizer"].value("type", "") != "ByteLevel")
    return false;
  const std::vector<int> cp = byte_code_points();
  const Json& vocab = m["vocab"];
  if (vocab.size() != 256) return false;
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab.find(utf8(cp[b]));
    if (it == vocab.end() || *it != b) return false;
  }
  return true;
}

}  // namespace kmoe
