// The resolved input deck as typed structs, one per deck section (RUNTIME.md section 5).
// Each section's keys (type, default, help) and checks are declared by the code that reads
// them (a DeckSection: modules/moe/moe_keys.cpp for [moe], ...; train/deck_sections.cpp lists
// them) and filled by io/deck.cpp; nothing else parses.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace kmoe {

// Every choice a deck spells as a word is an enum here; Choices<E>::all gives the deck
// spellings, in the order --help and error messages list them.
enum class BlockNorm { Reordered, Pre };             // model.block_norm
enum class RouterScore { Softmax, Sigmoid };         // moe.score
enum class EngramGate { Sigmoid, SignedSqrt };       // engram.gate
enum class EngramOffload { None, Host };             // engram.offload
enum class LrSchedule { Cosine, Constant, Wsd };     // optimizer.schedule
enum class PipeSchedule { OneFOneB, GPipe };         // parallel.schedule
enum class EngramShardGroup { None, Ep, Stage };     // parallel.engram_shard
enum class CommBackend { Mpi, Nccl };                // parallel.backend
enum class CudaAwareMpi { Auto, Yes, No };           // parallel.cuda_aware_mpi
enum class ExpertGemm { Auto, Grouped, PerExpert };  // moe.expert_gemm
enum class Precision { Fp32, Tf32, Bf16 };           // train.precision
enum class Recompute { None, Block };                // train.recompute
enum class AttentionKernel { Auto, Tiled, Fused };   // train.attention
enum class OptimizerShard { None, Replicas };        // optimizer.shard
enum class Tokenizer { Bytes, SentencePiece, External };            // data.tokenizer
enum class InitScheme { Normal, FanIn };             // model.init

template <class E>
struct Choice {
  E value;
  const char* name;
};
template <class E>
struct Choices;
template <>
struct Choices<BlockNorm> {
  static constexpr Choice<BlockNorm> all[] = {{BlockNorm::Reordered, "reordered"},
                                              {BlockNorm::Pre, "pre"}};
};
template <>
struct Choices<RouterScore> {
  static constexpr Choice<RouterScore> all[] = {{RouterScore::Softmax, "softmax"},
                                                {RouterScore::Sigmoid, "sigmoid"}};
};
template <>
struct Choices<EngramOffload> {
  static constexpr Choice<EngramOffload> all[] = {{EngramOffload::None, "none"},
                                                  {EngramOffload::Host, "host"}};
};
template <>
struct Choices<EngramGate> {
  static constexpr Choice<EngramGate> all[] = {{EngramGate::Sigmoid, "sigmoid"},
                                               {EngramGate::SignedSqrt, "signed_sqrt"}};
};
template <>
struct Choices<LrSchedule> {
  static constexpr Choice<LrSchedule> all[] = {
      {LrSchedule::Cosine, "cosine"}, {LrSchedule::Constant, "constant"}, {LrSchedule::Wsd, "wsd"}};
};
template <>
struct Choices<PipeSchedule> {
  static constexpr Choice<PipeSchedule> all[] = {{PipeSchedule::OneFOneB, "1f1b"},
                                                 {PipeSchedule::GPipe, "gpipe"}};
};
template <>
struct Choices<EngramShardGroup> {
  static constexpr Choice<EngramShardGroup> all[] = {{EngramShardGroup::None, "none"},
                                                     {EngramShardGroup::Ep, "ep"},
                                                     {EngramShardGroup::Stage, "stage"}};
};
template <>
struct Choices<CommBackend> {
  static constexpr Choice<CommBackend> all[] = {{CommBackend::Mpi, "mpi"},
                                                {CommBackend::Nccl, "nccl"}};
};
template <>
struct Choices<ExpertGemm> {
  static constexpr Choice<ExpertGemm> all[] = {{ExpertGemm::Auto, "auto"},
                                               {ExpertGemm::Grouped, "grouped"},
                                               {ExpertGemm::PerExpert, "per_expert"}};
};
template <>
struct Choices<Precision> {
  static constexpr Choice<Precision> all[] = {
      {Precision::Fp32, "fp32"}, {Precision::Tf32, "tf32"}, {Precision::Bf16, "bf16"}};
};
template <>
struct Choices<Recompute> {
  static constexpr Choice<Recompute> all[] = {{Recompute::None, "none"},
                                              {Recompute::Block, "block"}};
};
template <>
struct Choices<AttentionKernel> {
  static constexpr Choice<AttentionKernel> all[] = {{AttentionKernel::Auto, "auto"},
                                                    {AttentionKernel::Tiled, "tiled"},
                                                    {AttentionKernel::Fused, "fused"}};
};
template <>
struct Choices<OptimizerShard> {
  static constexpr Choice<OptimizerShard> all[] = {{OptimizerShard::None, "none"},
                                                   {OptimizerShard::Replicas, "replicas"}};
};
template <>
struct Choices<InitScheme> {
  static constexpr Choice<InitScheme> all[] = {{InitScheme::Normal, "normal"},
                                               {InitScheme::FanIn, "fan_in"}};
};
template <>
struct Choices<Tokenizer> {
  static constexpr Choice<Tokenizer> all[] = {{Tokenizer::Bytes, "bytes"},
                                              {Tokenizer::SentencePiece, "sentencepiece"},
                                              {Tokenizer::External, "external"}};
};
template <>
struct Choices<CudaAwareMpi> {
  static constexpr Choice<CudaAwareMpi> all[] = {
      {CudaAwareMpi::Auto, "auto"}, {CudaAwareMpi::Yes, "true"}, {CudaAwareMpi::No, "false"}};
};

// The deck spelling of a choice.
template <class E>
const char* choice_name(E value) {
  for (const auto& c : Choices<E>::all)
    if (c.value == value) return c.name;
  return "?";
}
// "a | b | c": the spellings, as messages list them.
template <class E>
std::string choice_list() {
  std::string out;
  for (const auto& c : Choices<E>::all) out += (out.empty() ? "" : " | ") + std::string(c.name);
  return out;
}
// False when `text` spells none of the choices.
template <class E>
bool parse_choice(const std::string& text, E* value) {
  for (const auto& c : Choices<E>::all)
    if (text == c.name) {
      *value = c.value;
      return true;
    }
  return false;
}
// The choice `text` spells; an Error listing the spellings otherwise.
template <class E>
E choice_from(const std::string& text) {
  E value{};
  KMOE_REQUIRE(parse_choice(text, &value), "'" << text << "' is none of " << choice_list<E>());
  return value;
}

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
  BlockNorm block_norm = BlockNorm::Reordered;
  bool tie_embeddings = false;
  double init_std = 0.02;
  double output_z_coef = 0.0;
  // Initialization (MODEL.md section 7): the matrices' std, model.init_std (normal) or
  // 1/sqrt(fan_in) (fan_in); the output projections (wo, every w2) divided by sqrt(2 * n_layers)
  // with init_depth_scale; the embedding's own std (-1: model.init_std).
  InitScheme init = InitScheme::Normal;
  double init_gain = 1.0;  // fan_in: every matrix's std is init_gain / sqrt(fan_in)
  bool init_depth_scale = false;
  double embed_init_std = -1.0;
  // Sliding-window attention (MODEL.md section 1): in the blocks of window_layers a position
  // reads the sliding_window most recent positions (itself included); 0: no window.
  int sliding_window = 0;
  std::vector<int> window_layers;  // resolved: every block but each 4th (l % 4 == 3) when empty
  // Document masking (train.document_mask): the id that ends a document, where attention,
  // Engram's n-grams and its convolution stop; -1: none. Resolved from train.document_mask and
  // data.eod_id when the deck is read.
  int document_eod = -1;

  int head_dim() const { return d_model / n_heads; }
  // The std of a matrix whose rows are `fan_in` wide (its input features); `output`: an
  // output projection of its block (attention wo, a SwiGLU's w2).
  double matrix_std(std::int64_t fan_in, bool output = false) const {
    double s = init == InitScheme::FanIn ? init_gain / std::sqrt(double(fan_in)) : init_std;
    if (output && init_depth_scale) s /= std::sqrt(2.0 * n_layers);
    return s;
  }
  double embedding_std() const { return embed_init_std > 0 ? embed_init_std : init_std; }
  // The attention window of block `layer` (0: the whole causal prefix).
  int window(int layer) const {
    if (sliding_window <= 0) return 0;
    for (int l : window_layers)
      if (l == layer) return sliding_window;
    return 0;
  }
  // OLMo 3's pattern: every block but each 4th (3, 7, ...) has a window.
  static std::vector<int> default_window_layers(int n_layers) {
    std::vector<int> v;
    for (int l = 0; l < n_layers; ++l)
      if (l % 4 != 3) v.push_back(l);
    return v;
  }
};

// Mixture of experts (MODEL.md section 3). experts = 0: a dense model.
struct MoeCfg {
  int experts = 0;
  int top_k = 2;
  int expert_hidden = 0;
  std::vector<int> layers;        // MoE blocks; empty: every block not in dense_layers
  std::vector<int> dense_layers;  // blocks kept dense when `layers` is empty
  RouterScore score = RouterScore::Softmax;
  bool normalize_topk = false;
  double lb_coef = 0.01;
  double z_coef = 0.001;
  double capacity_factor = 0.0;  // 0: dropless
  int shared_experts = 0;
  int shared_hidden = 0;
  double bias_update_rate = 0.0;  // aux-loss-free balancing (DeepSeek-V3); 0: off
  ExpertGemm expert_gemm = ExpertGemm::Auto;

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
  EngramGate gate = EngramGate::Sigmoid;
  double lr_mult = 5.0;
  std::string compression_map;  // empty: identity
  double init_std = 0.02;       // resolved: model.init_std when not given
  // host: the tables and their AdamW moments in host memory, rows staged per lookup (MODEL.md
  // section 4, RUNTIME.md section 6). Not part of the trained function.
  EngramOffload offload = EngramOffload::None;

  bool enabled() const { return !layers.empty(); }
  bool host_tables() const { return enabled() && offload == EngramOffload::Host; }
};

struct TrainCfg {
  int seq_len = 0;
  int global_batch = 0;
  int micro_batch = 0;
  int max_steps = 0;
  std::uint64_t seed = 0;
  int eval_every = 0;                     // 0: evaluate at the end only
  int eval_instances = 0;                 // 0: all validation instances
  bool check_memory = true;               // refuse a run its node or device cannot hold
  Precision precision = Precision::Fp32;  // GEMM inputs: fp32, TF32 (GPUs) or bf16 (MODEL.md 8)
  Recompute recompute = Recompute::None;  // block: keep block inputs, run forward again
  bool document_mask = false;             // attention and Engram stop at data.eod_id
  AttentionKernel attention = AttentionKernel::Auto;  // the attention core (attention_core.hpp)
};

struct OptimizerCfg {
  double lr = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double clip = 1.0;  // 0: off
  LrSchedule schedule = LrSchedule::Cosine;
  int warmup_steps = 0;
  double final_lr_ratio = 0.1;
  int decay_steps = 0;
  OptimizerShard shard = OptimizerShard::None;  // replicas: moments split over a tensor's replicas
};

struct DataCfg {
  std::vector<std::string> paths;      // as written in the deck (globs allowed)
  std::vector<std::string> val_paths;  // may be empty
  std::string dtype = "uint16";        // uint16 | uint32
  // What the ids mean: kmoe-prep's byte-level ids (0..255 bytes, 256 end of document), or
  // another tool's (a model imported from Hugging Face, pre-tokenized files).
  Tokenizer tokenizer = Tokenizer::Bytes;
  std::string tokenizer_model;  // data.tokenizer = sentencepiece: the model file
  int eod_id = -1;  // the id that ends a document; -1: the tokenizer's (bytes: 256; none)

  // The end-of-document id of a model of `vocab` ids, or -1 when it has none.
  int end_of_document(int vocab) const {
    if (eod_id >= 0) return eod_id;
    return tokenizer == Tokenizer::Bytes && vocab > 256 ? 256 : -1;
  }
};

struct ParallelCfg {
  int pp = 1;
  int dp = 1;  // 0 while `dp = auto` waits for the launch's rank count (resolve_auto_dp)
  int ep = 1;
  bool dp_auto = false;  // the deck says `dp = auto`: dp = ranks / (pp * ep)
  PipeSchedule schedule = PipeSchedule::OneFOneB;
  std::vector<int> pp_layers;  // empty: even split
  EngramShardGroup engram_shard = EngramShardGroup::None;
  int watchdog_seconds = 300;
  int spin_microseconds = 200;  // a wait polls this long, then sleeps between polls
  double bucket_mb = 25.0;                           // gradient all-reduce bucket size
  CommBackend backend = CommBackend::Mpi;            // data plane of the axes
  CudaAwareMpi cuda_aware_mpi = CudaAwareMpi::Auto;  // MPI takes device pointers

  int world() const { return pp * dp * ep; }
};

struct CheckpointCfg {
  std::string dir = "checkpoints";
  int every = 0;
  int keep = 3;
  std::string resume = "auto";  // auto | none | <file>
  bool save_initial = false;
  bool at_end = true;            // save after the last step (benchmarks turn it off)
  bool overwrite = false;        // a fresh run may replace another run's files
  int lock_stale_seconds = 600;  // a run lock without a heartbeat this long is stale
};

struct OutputCfg {
  std::string dir = "run";
  int log_every = 1;
  double peak_flops = 0.0;    // per rank, FLOP/s; 0: MFU not reported
  bool phase_timing = false;  // time the step's phases (a fence at each phase boundary)
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
