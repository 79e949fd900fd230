// Combinations the key table cannot express one key at a time. They are checked when the deck is
// read, before any rank allocates, so a bad deck fails in a second with the line to fix.
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/error.hpp"
#include "io/deck_schema.hpp"

// `key` is the key the user most likely has to change; the message still names the others.
#define KMOE_DECK_REQUIRE(cond, key, msg) KMOE_REQUIRE(cond, locate(key) << ": " << msg)

namespace kmoe::deck {
namespace {

using Locate = std::function<std::string(const std::string& key)>;

void require_one_of(const Locate& locate, const char* key, const std::string& value,
                    std::initializer_list<const char*> allowed) {
  std::string choices;
  for (const char* option : allowed) {
    if (value == option) return;
    choices += (choices.empty() ? "" : " | ") + std::string(option);
  }
  KMOE_FAIL(locate(key) << ": " << key << " must be one of " << choices << ", got '" << value
                        << "'");
}

void check_distinct(const std::vector<int>& blocks, const char* key, const Locate& locate);

void check_model(const ModelCfg& m, const Locate& locate) {
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
  KMOE_DECK_REQUIRE(m.sliding_window >= 0, "model.sliding_window",
                    "model.sliding_window = " << m.sliding_window
                                              << ": must be a positive window or 0 (off)");
  for (int l : m.window_layers)
    KMOE_DECK_REQUIRE(
        l >= 0 && l < m.n_layers, "model.window_layers",
        "model.window_layers entry " << l << " is not a block in [0, " << m.n_layers << ")");
  check_distinct(m.window_layers, "model.window_layers", locate);
}

void check_train(const TrainCfg& t, const Locate& locate) {
  KMOE_DECK_REQUIRE(t.seq_len >= 2, "train.seq_len",
                    "train.seq_len must be at least 2 (T tokens give T-1 targets)");
  KMOE_DECK_REQUIRE(t.global_batch >= 1, "train.global_batch",
                    "train.global_batch must be at least 1");
  KMOE_DECK_REQUIRE(t.micro_batch >= 1, "train.micro_batch",
                    "train.micro_batch must be at least 1");
  KMOE_DECK_REQUIRE(t.max_steps >= 1, "train.max_steps", "train.max_steps must be at least 1");
  KMOE_DECK_REQUIRE(t.eval_every >= 0, "train.eval_every", "train.eval_every must be >= 0");
  KMOE_DECK_REQUIRE(t.eval_instances >= 0, "train.eval_instances",
                    "train.eval_instances must be >= 0");
}

void check_optimizer(const OptimizerCfg& o, int max_steps, const Locate& locate) {
  KMOE_DECK_REQUIRE(o.lr > 0, "optimizer.lr", "optimizer.lr must be positive");
  KMOE_DECK_REQUIRE(o.beta1 >= 0 && o.beta1 < 1, "optimizer.beta1",
                    "optimizer.beta1 must be in [0, 1)");
  KMOE_DECK_REQUIRE(o.beta2 >= 0 && o.beta2 < 1, "optimizer.beta2",
                    "optimizer.beta2 must be in [0, 1)");
  KMOE_DECK_REQUIRE(o.eps > 0, "optimizer.eps", "optimizer.eps must be positive");
  KMOE_DECK_REQUIRE(o.weight_decay >= 0, "optimizer.weight_decay",
                    "optimizer.weight_decay must be non-negative");
  KMOE_DECK_REQUIRE(o.clip >= 0, "optimizer.clip", "optimizer.clip must be non-negative (0 = off)");
  // A warmup longer than the run is allowed (a shortened run never reaches the peak lr).
  KMOE_DECK_REQUIRE(o.warmup_steps >= 0, "optimizer.warmup_steps",
                    "optimizer.warmup_steps must be >= 0");
  KMOE_DECK_REQUIRE(o.final_lr_ratio >= 0 && o.final_lr_ratio <= 1, "optimizer.final_lr_ratio",
                    "optimizer.final_lr_ratio must be in [0, 1]");
  KMOE_DECK_REQUIRE(o.decay_steps >= 0, "optimizer.decay_steps",
                    "optimizer.decay_steps must be >= 0");
  if (o.schedule == LrSchedule::Wsd) {
    KMOE_DECK_REQUIRE(o.decay_steps >= 1 && o.decay_steps <= max_steps, "optimizer.decay_steps",
                      "optimizer.schedule = wsd needs optimizer.decay_steps in [1, "
                      "train.max_steps = "
                          << max_steps << "]");
  }
}

void check_data(const DataCfg& d, int vocab_size, const Locate& locate) {
  require_one_of(locate, "data.dtype", d.dtype, {"uint16", "uint32"});
  KMOE_DECK_REQUIRE(!d.paths.empty(), "data.paths", "data.paths must name at least one file");
  KMOE_DECK_REQUIRE(d.tokenizer != Tokenizer::SentencePiece || !d.tokenizer_model.empty(),
                    "data.tokenizer_model",
                    "data.tokenizer = sentencepiece needs data.tokenizer_model (the .model file)");
  KMOE_DECK_REQUIRE(d.tokenizer != Tokenizer::SentencePiece || d.eod_id >= 0, "data.eod_id",
                    "data.tokenizer = sentencepiece needs data.eod_id (the model's end-of-"
                    "document id, which kmoe-prep prints)");
  KMOE_DECK_REQUIRE(d.tokenizer == Tokenizer::SentencePiece || d.tokenizer_model.empty(),
                    "data.tokenizer_model",
                    "data.tokenizer_model is given but data.tokenizer = "
                        << choice_name(d.tokenizer) << " (set data.tokenizer = sentencepiece)");
  KMOE_DECK_REQUIRE(d.dtype != "uint16" || vocab_size <= 65536, "model.vocab_size",
                    "model.vocab_size (" << vocab_size
                                         << ") exceeds 65536, the most data.dtype = uint16 can "
                                            "hold; use data.dtype = uint32");
  KMOE_DECK_REQUIRE(d.eod_id >= -1 && d.eod_id < vocab_size, "data.eod_id",
                    "data.eod_id = " << d.eod_id << " is outside the vocabulary [0, "
                                     << vocab_size << ")");
}

void check_parallel(const Config& c, const Locate& locate) {
  const ParallelCfg& p = c.parallel;
  KMOE_DECK_REQUIRE(p.pp >= 1, "parallel.pp", "parallel.pp must be at least 1");
  KMOE_DECK_REQUIRE(p.dp >= 1, "parallel.dp", "parallel.dp must be at least 1");
  KMOE_DECK_REQUIRE(p.ep >= 1, "parallel.ep", "parallel.ep must be at least 1");
  KMOE_DECK_REQUIRE(std::int64_t(p.pp) * p.dp * p.ep <= (std::int64_t(1) << 30), "parallel.dp",
                    "parallel.pp * parallel.dp * parallel.ep = " << std::int64_t(p.pp) * p.dp * p.ep
                                                                 << " ranks is beyond any MPI job");
  KMOE_DECK_REQUIRE(p.pp <= c.model.n_layers, "parallel.pp",
                    "parallel.pp (" << p.pp << ") exceeds model.n_layers (" << c.model.n_layers
                                    << "): every stage needs a block");
  if (!p.pp_layers.empty()) {
    KMOE_DECK_REQUIRE(static_cast<int>(p.pp_layers.size()) == p.pp, "parallel.pp_layers",
                      "parallel.pp_layers has " << p.pp_layers.size() << " entries; parallel.pp = "
                                                << p.pp << " needs one per stage");
    std::int64_t sum = 0;
    for (std::size_t s = 0; s < p.pp_layers.size(); ++s) {
      KMOE_DECK_REQUIRE(p.pp_layers[s] >= 1, "parallel.pp_layers",
                        "parallel.pp_layers gives stage " << s << " " << p.pp_layers[s]
                                                          << " blocks; every stage needs one");
      sum += p.pp_layers[s];
    }
    KMOE_DECK_REQUIRE(
        sum == c.model.n_layers, "parallel.pp_layers",
        "parallel.pp_layers sums to " << sum << ", model.n_layers is " << c.model.n_layers);
  }
  KMOE_DECK_REQUIRE(p.watchdog_seconds >= 1, "parallel.watchdog_seconds",
                    "parallel.watchdog_seconds must be at least 1");
  KMOE_DECK_REQUIRE(p.bucket_mb > 0, "parallel.bucket_mb", "parallel.bucket_mb must be positive");
#ifndef KMOE_HAVE_NCCL
  KMOE_DECK_REQUIRE(p.backend != CommBackend::Nccl, "parallel.backend",
                    "parallel.backend = nccl, but this build of kmoe lacks NCCL: configure it "
                    "with -DKMOE_ENABLE_NCCL=ON (and a CUDA Kokkos), or use "
                    "parallel.backend = mpi");
#endif
  // Every one of the dp*ep ranks of a stage takes whole micro-batches (RUNTIME.md section 2).
  const std::int64_t b = c.train.micro_batch;
  const std::int64_t unit = b * p.dp * p.ep;
  KMOE_DECK_REQUIRE(c.train.global_batch % unit == 0, "train.global_batch",
                    "train.global_batch (" << c.train.global_batch
                                           << ") must be divisible by train.micro_batch * "
                                              "parallel.dp * parallel.ep = "
                                           << b << " * " << p.dp << " * " << p.ep << " = " << unit);
}

void check_outputs(const CheckpointCfg& k, const OutputCfg& o, const Locate& locate) {
  KMOE_DECK_REQUIRE(!k.dir.empty(), "checkpoint.dir", "checkpoint.dir must not be empty");
  KMOE_DECK_REQUIRE(k.every >= 0, "checkpoint.every", "checkpoint.every must be >= 0");
  KMOE_DECK_REQUIRE(k.keep >= 1, "checkpoint.keep", "checkpoint.keep must be at least 1");
  KMOE_DECK_REQUIRE(k.lock_stale_seconds >= 1, "checkpoint.lock_stale_seconds",
                    "checkpoint.lock_stale_seconds must be at least 1");
  KMOE_DECK_REQUIRE(!k.resume.empty(), "checkpoint.resume",
                    "checkpoint.resume must be auto, none or a file");
  KMOE_DECK_REQUIRE(!o.dir.empty(), "output.dir", "output.dir must not be empty");
  KMOE_DECK_REQUIRE(o.log_every >= 1, "output.log_every", "output.log_every must be at least 1");
  KMOE_DECK_REQUIRE(o.peak_flops >= 0, "output.peak_flops",
                    "output.peak_flops must be non-negative (0 = no MFU)");
  for (const int step : o.dump_step) {
    KMOE_DECK_REQUIRE(step >= 1, "output.dump_step",
                      "output.dump_step entries are steps, at least 1; got " << step);
  }
}

// A block list names each block once: `1, 1` would silently build a different model.
void check_distinct(const std::vector<int>& blocks, const char* key, const Locate& locate) {
  for (std::size_t i = 0; i < blocks.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      KMOE_DECK_REQUIRE(blocks[i] != blocks[j], key,
                        key << " lists block " << blocks[i] << " twice");
}

}  // namespace

void check_moe(const MoeCfg& e, const ModelCfg& m, int ep, const Locate& locate) {
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
    check_distinct(blocks, key, locate);
  }
}

void check_engram(const EngramCfg& g, const ModelCfg& m, const Locate& locate) {
  for (int l : g.layers)
    KMOE_DECK_REQUIRE(
        l >= 0 && l < m.n_layers, "engram.layers",
        "engram.layers entry " << l << " is not a block in [0, " << m.n_layers << ")");
  check_distinct(g.layers, "engram.layers", locate);
  KMOE_DECK_REQUIRE(g.max_ngram >= 2, "engram.max_ngram", "engram.max_ngram must be at least 2");
  KMOE_DECK_REQUIRE(g.heads >= 1, "engram.heads", "engram.heads must be positive");
  KMOE_DECK_REQUIRE(
      g.embed_per_ngram >= 1 && g.embed_per_ngram % g.heads == 0, "engram.embed_per_ngram",
      "engram.embed_per_ngram must be a positive multiple of engram.heads (" << g.heads << ")");
  KMOE_DECK_REQUIRE(g.table_size.empty() || int(g.table_size.size()) == g.max_ngram - 1,
                    "engram.table_size",
                    "engram.table_size needs one entry per order 2.."
                        << g.max_ngram << " (" << g.max_ngram - 1 << " entries)");
  for (int t : g.table_size)
    KMOE_DECK_REQUIRE(t >= 2, "engram.table_size", "engram.table_size entries must be >= 2");
  KMOE_DECK_REQUIRE(g.kernel >= 1, "engram.kernel", "engram.kernel must be positive");
  KMOE_DECK_REQUIRE(!g.enabled() || (g.pad_id >= 0 && g.pad_id < m.vocab_size), "engram.pad_id",
                    "engram.pad_id must be a token id in [0, " << m.vocab_size << ")");
  KMOE_DECK_REQUIRE(g.lr_mult > 0, "engram.lr_mult", "engram.lr_mult must be positive");
  KMOE_DECK_REQUIRE(g.init_std > 0, "engram.init_std",
                    "engram.init_std = " << g.init_std << ": must be positive");
}

void check_consistency(const Config& cfg, const Locate& locate) {
  check_model(cfg.model, locate);  // first: the other sections are checked against its sizes
  check_engram(cfg.engram, cfg.model, locate);
  check_moe(cfg.moe, cfg.model, cfg.parallel.ep, locate);
  check_train(cfg.train, locate);
  check_optimizer(cfg.optimizer, cfg.train.max_steps, locate);
  check_data(cfg.data, cfg.model.vocab_size, locate);
  KMOE_DECK_REQUIRE(!cfg.train.document_mask || cfg.data.end_of_document(cfg.model.vocab_size) >= 0,
                    "train.document_mask",
                    "train.document_mask = true needs an end-of-document id: set data.eod_id (the "
                    "tokenizer '" << choice_name(cfg.data.tokenizer) << "' of a "
                                  << cfg.model.vocab_size << "-id vocabulary has none)");
  check_parallel(cfg, locate);
  check_outputs(cfg.checkpoint, cfg.output, locate);
}

}  // namespace kmoe::deck
