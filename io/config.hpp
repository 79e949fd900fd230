// The resolved input deck as typed structs, one per deck section (RUNTIME.md section 5).
// io/deck.cpp declares every key (type, default, help) and fills these; nothing else parses.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kmoe {

struct ModelCfg {
  int vocab_size = 0;
  int d_model = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;  // resolved: n_heads when not given
  int ffn_hidden = 0;
  double norm_eps = 1e-6;
  double rope_theta = 500000.0;
  bool qk_norm = true;
  std::string block_norm = "reordered";  // reordered | pre
  bool tie_embeddings = false;
  double init_std = 0.02;
  double output_z_coef = 0.0;

  int head_dim() const { return d_model / n_heads; }
};

// Mixture of experts (MODEL.md section 3). experts = 0: a dense model.
struct MoeCfg {
  int experts = 0;
  int top_k = 2;
  int expert_hidden = 0;
  std::vector<int> layers;        // MoE blocks; empty: every block not in dense_layers
  std::vector<int> dense_layers;  // blocks kept dense when `layers` is empty
  std::string score = "softmax";  // softmax | sigmoid
  bool normalize_topk = false;
  double lb_coef = 0.01;
  double z_coef = 0.001;
  double capacity_factor = 0.0;  // 0: dropless
  int shared_experts = 0;
  int shared_hidden = 0;
  double bias_update_rate = 0.0;  // aux-loss-free balancing (DeepSeek-V3); 0: off

  bool enabled() const { return experts > 0; }
  bool is_moe_layer(int block) const {
    if (!enabled()) return false;
    auto has = [block](const std::vector<int>& v) {
      for (int x : v)
        if (x == block) return true;
      return false;
    };
    return layers.empty() ? !has(dense_layers) : has(layers);
  }
};

// Engram conditional memory (MODEL.md section 4). No layers: no Engram.
struct EngramCfg {
  std::vector<int> layers;
  int max_ngram = 3;
  int heads = 8;
  int embed_per_ngram = 512;
  std::vector<int> table_size;  // per order n = 2..max_ngram; empty: 5 * V' each
  std::uint64_t seed = 0;
  int kernel = 4;
  int pad_id = 0;
  std::string gate = "sigmoid";  // sigmoid | signed_sqrt
  double lr_mult = 5.0;
  std::string compression_map;   // empty: identity
  double init_std = 0.02;        // resolved: model.init_std when not given

  bool enabled() const { return !layers.empty(); }
};

struct TrainCfg {
  int seq_len = 0;
  int global_batch = 0;
  int micro_batch = 0;
  int max_steps = 0;
  std::uint64_t seed = 0;
  int eval_every = 0;      // 0: evaluate at the end only
  int eval_instances = 0;  // 0: all validation instances
};

struct OptimizerCfg {
  double lr = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double clip = 1.0;  // 0: off
  std::string schedule = "cosine";  // cosine | constant | wsd
  int warmup_steps = 0;
  double final_lr_ratio = 0.1;
  int decay_steps = 0;
};

struct DataCfg {
  std::vector<std::string> paths;      // as written in the deck (globs allowed)
  std::vector<std::string> val_paths;  // may be empty
  std::string dtype = "uint16";        // uint16 | uint32
};

struct ParallelCfg {
  int pp = 1;
  int dp = 1;
  int ep = 1;
  std::string schedule = "1f1b";  // 1f1b | gpipe
  std::vector<int> pp_layers;     // empty: even split
  std::string engram_shard = "none";
  int watchdog_seconds = 300;
  double bucket_mb = 25.0;         // gradient all-reduce bucket size
  std::string backend = "mpi";         // data plane of the axes: mpi | nccl
  std::string cuda_aware_mpi = "auto";  // MPI on device memory: auto | true | false

  int world() const { return pp * dp * ep; }
};

struct CheckpointCfg {
  std::string dir = "checkpoints";
  int every = 0;
  int keep = 3;
  std::string resume = "auto";  // auto | none | <file>
  bool save_initial = false;
};

struct OutputCfg {
  std::string dir = "run";
  int log_every = 1;
  double peak_flops = 0.0;  // per rank, FLOP/s; 0: MFU not reported
  std::vector<int> dump_step;
};

struct Config {
  ModelCfg model;
  MoeCfg moe;
  EngramCfg engram;
  TrainCfg train;
  OptimizerCfg optimizer;
  DataCfg data;
  ParallelCfg parallel;
  CheckpointCfg checkpoint;
  OutputCfg output;

  std::string deck_path;      // the file it was read from ("" for a deck given as text)
  std::string resolved_text;  // every key with its final value, as an INI deck
};

}  // namespace kmoe
