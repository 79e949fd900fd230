// The key table (RUNTIME.md section 5). A new section ([moe], [engram]) is one more block in
// Schema::Schema; types, defaults and help all live in that one declaration.
#include "io/deck_schema.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "core/error.hpp"

namespace kmoe::deck {
namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t\r\n") + 1 - begin);
}

// Boost's bool and number readers take "" as true or fail obscurely; say what is wrong instead.
void require_nonempty(const std::string& text) { KMOE_REQUIRE(!text.empty(), "empty value"); }

// An empty string is the empty list, so an optional list can be written out and read back.
std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  if (trim(text).empty()) return items;
  std::string::size_type start = 0;
  while (true) {
    const auto comma = text.find(',', start);
    items.push_back(trim(text.substr(start, comma - start)));
    KMOE_REQUIRE(!items.back().empty(), "empty entry in list '" << text << "'");
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

template <class T>
std::string join_list(const std::vector<T>& items) {
  std::string out;
  for (const T& item : items) {
    if (!out.empty()) out += ", ";
    if constexpr (std::is_same_v<T, std::string>) {
      out += item;
    } else {
      out += std::to_string(item);
    }
  }
  return out;
}

// How each member type travels through Boost: the type Boost stores and converts (lists go as
// their text), the check on the raw text, and the conversions to and from deck text.
template <class T, class = void>
struct Traits;

// A choice (an enum of core/config.hpp): stored as its spelling; anything else is a
// ChoiceError that the parser reports with the key and the allowed spellings.
template <class E>
struct Traits<E, std::enable_if_t<std::is_enum_v<E>>> {
  using Stored = std::string;
  static constexpr const char* type = "choice";
  static void check(const std::string& text) {
    E value;
    if (!parse_choice(text, &value)) throw ChoiceError(choice_list<E>());
  }
  static E from(const std::string& text) {
    E value{};
    if (!parse_choice(text, &value)) throw ChoiceError(choice_list<E>());
    return value;
  }
  static std::string to_stored(E v) { return choice_name(v); }
  static std::string text(E v) { return choice_name(v); }
};

template <>
struct Traits<int> {
  using Stored = int;
  static constexpr const char* type = "int";
  static void check(const std::string& text) { require_nonempty(text); }
  static int from(int v) { return v; }
  static int to_stored(int v) { return v; }
  static std::string text(int v) { return std::to_string(v); }
};

template <>
struct Traits<std::uint64_t> {
  using Stored = std::uint64_t;
  static constexpr const char* type = "uint64";
  static void check(const std::string& text) {
    require_nonempty(text);
    KMOE_REQUIRE(text.find('-') == std::string::npos, "expected a non-negative integer");
  }
  static std::uint64_t from(std::uint64_t v) { return v; }
  static std::uint64_t to_stored(std::uint64_t v) { return v; }
  static std::string text(std::uint64_t v) { return std::to_string(v); }
};

template <>
struct Traits<double> {
  using Stored = double;
  static constexpr const char* type = "double";
  static void check(const std::string& text) { require_nonempty(text); }
  static double from(double v) {
    KMOE_REQUIRE(std::isfinite(v), "expected a finite number");
    return v;
  }
  static double to_stored(double v) { return v; }
  static std::string text(double v) { return format_double(v); }
};

template <>
struct Traits<bool> {
  using Stored = bool;
  static constexpr const char* type = "bool";
  static void check(const std::string& text) { require_nonempty(text); }
  static bool from(bool v) { return v; }
  static bool to_stored(bool v) { return v; }
  static std::string text(bool v) { return v ? "true" : "false"; }
};

template <>
struct Traits<std::string> {
  using Stored = std::string;
  static constexpr const char* type = "string";
  static void check(const std::string&) {}
  static std::string from(const std::string& v) { return v; }
  static std::string to_stored(const std::string& v) { return v; }
  static std::string text(const std::string& v) { return v; }
};

template <>
struct Traits<std::vector<std::string>> {
  using Stored = std::string;
  static constexpr const char* type = "list of strings";
  static void check(const std::string&) {}
  static std::vector<std::string> from(const std::string& v) { return split_list(v); }
  static std::string to_stored(const std::vector<std::string>& v) { return join_list(v); }
  static std::string text(const std::vector<std::string>& v) { return join_list(v); }
};

template <>
struct Traits<std::vector<int>> {
  using Stored = std::string;
  static constexpr const char* type = "list of ints";
  static void check(const std::string&) {}
  static std::vector<int> from(const std::string& v) {
    std::vector<int> out;
    for (const std::string& item : split_list(v)) {
      int x = 0;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), x);
      KMOE_REQUIRE(ec == std::errc() && end == item.data() + item.size(),
                   "list entry '" << item << "' is not an int");
      out.push_back(x);
    }
    return out;
  }
  static std::string to_stored(const std::vector<int>& v) { return join_list(v); }
  static std::string text(const std::vector<int>& v) { return join_list(v); }
};

}  // namespace

std::string format_double(double v) {
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  // "500000" reads better than "5e+05" in a deck.
  if (std::string(buf).find('e') != std::string::npos && v == std::floor(v) && std::fabs(v) < 1e9) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  }
  return buf;
}

void Schema::section(const char* name, const char* help) { sections_.push_back({name, help}); }

template <class T>
KeySpec& Schema::declare(T& member, const char* key, const T* def, bool required,
                         const char* help) {
  using Tr = Traits<T>;
  using Stored = typename Tr::Stored;
  KeySpec spec;
  spec.section = sections_.back().name;
  spec.key = key;
  spec.type = Tr::type;
  spec.required = required;
  spec.help = help;
  auto* semantic = po::value<Stored>();
  if (def) {
    spec.default_text = Tr::text(*def);
    semantic->default_value(Tr::to_stored(*def), spec.default_text);
  } else if (required) {
    semantic->required();
  }
  spec.check_text = &Tr::check;
  spec.assign = [&member](const po::variable_value& v) { member = Tr::from(v.as<Stored>()); };
  spec.show = [&member] { return Tr::text(member); };
  options_.add_options()(spec.name().c_str(), semantic, help);
  keys_.push_back(std::move(spec));
  return keys_.back();
}

template <class T, class D>
void Schema::key(T& member, const char* key, const D& def, const char* help) {
  const T value(def);
  declare(member, key, &value, false, help);
}

template <class T>
void Schema::required(T& member, const char* key, const char* help) {
  declare<T>(member, key, nullptr, true, help);
}

template <class T>
void Schema::derived(T& member, const char* key, const char* from, std::function<T()> value,
                     const char* help) {
  KeySpec& spec = declare<T>(member, key, nullptr, false, help);
  spec.default_text = from;
  spec.derive_default = [&member, value] { member = value(); };
}

Schema::Schema(Config& c) : options_("kmoe input deck") {
  section("model", "transformer shape and initialisation (MODEL.md)");
  required(c.model.vocab_size, "vocab_size", "token vocabulary size V");
  required(c.model.d_model, "d_model", "hidden width D");
  required(c.model.n_layers, "n_layers", "number of transformer blocks L");
  required(c.model.n_heads, "n_heads", "query heads H; D/H must be even (RoPE half split)");
  derived<int>(
      c.model.n_kv_heads, "n_kv_heads", "n_heads", [&c] { return c.model.n_heads; },
      "key/value heads Hkv (grouped-query attention); must divide n_heads");
  required(c.model.ffn_hidden, "ffn_hidden", "hidden width F of the dense SwiGLU MLP");
  key(c.model.norm_eps, "norm_eps", 1e-6, "RMSNorm epsilon");
  key(c.model.rope_theta, "rope_theta", 500000.0, "RoPE base theta");
  key(c.model.qk_norm, "qk_norm", true, "RMSNorm over projected queries and keys");
  key(c.model.block_norm, "block_norm", BlockNorm::Reordered,
      "reordered (norm on the branch output, OLMo2) | pre (norm on the branch input, Llama)");
  key(c.model.tie_embeddings, "tie_embeddings", false, "LM head reuses the embedding matrix");
  key(c.model.init_std, "init_std", 0.02,
      "std of the truncated-normal matrices under model.init = normal");
  key(c.model.init, "init", InitScheme::Normal,
      "matrix initialization (MODEL.md section 7): normal (N(0, model.init_std)) | fan_in "
      "(N(0, model.init_gain / sqrt(input width)))");
  key(c.model.init_gain, "init_gain", 1.0,
      "model.init = fan_in: the gain of every matrix's std (1/sqrt(3) = 0.577 gives "
      "PyTorch's nn.Linear default variance)");
  key(c.model.init_depth_scale, "init_depth_scale", false,
      "divide the output projections' std (attention wo, every w2) by sqrt(2 * n_layers)");
  derived<double>(
      c.model.embed_init_std, "embed_init_std", "model.init_std",
      [&c] { return c.model.init_std; }, "std of the embedding matrix");
  key(c.model.output_z_coef, "output_z_coef", 0.0, "weight of the output z-loss");
  key(c.model.sliding_window, "sliding_window", 0,
      "sliding-window attention: a position reads its W most recent positions (itself "
      "included) in the blocks of window_layers; 0 = off");
  derived<std::vector<int>>(
      c.model.window_layers, "window_layers", "every block but each 4th",
      [&c] {
        return c.model.sliding_window > 0 ? ModelCfg::default_window_layers(c.model.n_layers)
                                          : std::vector<int>{};
      },
      "blocks with the sliding window, comma-separated; default OLMo 3's pattern: every block "
      "but 3, 7, 11, ... (those keep full causal attention)");

  section("moe", "mixture of experts (MODEL.md section 3); experts = 0 is a dense model");
  key(c.moe.experts, "experts", 0, "routed experts E; 0 = dense");
  key(c.moe.top_k, "top_k", 2, "experts per token k");
  key(c.moe.expert_hidden, "expert_hidden", 0,
      "hidden width Fe of each expert (needed with experts)");
  key(c.moe.layers, "layers", std::vector<int>{},
      "MoE blocks, comma-separated; empty = every block not in dense_layers");
  key(c.moe.dense_layers, "dense_layers", std::vector<int>{},
      "blocks kept dense when layers is empty");
  key(c.moe.score, "score", RouterScore::Softmax, "router scores: softmax | sigmoid");
  key(c.moe.normalize_topk, "normalize_topk", false, "divide the k weights by their sum");
  key(c.moe.lb_coef, "lb_coef", 0.01, "weight of the load-balancing loss");
  key(c.moe.z_coef, "z_coef", 0.001, "weight of the router z-loss");
  key(c.moe.capacity_factor, "capacity_factor", 0.0,
      "expert capacity ceil(cf * N * k / E) per micro-batch; 0 = dropless");
  key(c.moe.shared_experts, "shared_experts", 0, "shared experts S (weight 1, every token)");
  key(c.moe.shared_hidden, "shared_hidden", 0, "hidden width Fs of each shared expert");
  key(c.moe.bias_update_rate, "bias_update_rate", 0.0,
      "aux-loss-free balancing rate gamma (DeepSeek-V3); 0 = off");
  key(c.moe.expert_gemm, "expert_gemm", ExpertGemm::Auto,
      "expert GEMMs: grouped (one launch per product, row counts read on the device) | "
      "per_expert (vendor BLAS per expert, row counts read on the host) | auto (per_expert: "
      "the faster on CPUs and, measured on an H200, on GPUs)");

  section("engram", "Engram conditional memory (MODEL.md section 4); no layers = none");
  key(c.engram.layers, "layers", std::vector<int>{},
      "Engram blocks, comma-separated; empty = none");
  key(c.engram.max_ngram, "max_ngram", 3, "largest n-gram order N (orders 2..N)");
  key(c.engram.heads, "heads", 8, "hash heads K per order");
  key(c.engram.embed_per_ngram, "embed_per_ngram", 512,
      "memory width De per order (multiple of heads)");
  key(c.engram.table_size, "table_size", std::vector<int>{},
      "base rows per order n = 2..N, comma-separated; empty = 5 * V' each");
  key(c.engram.seed, "seed", std::uint64_t{0}, "seed of the hash multipliers");
  key(c.engram.kernel, "kernel", 4, "taps of the causal dilated depthwise convolution");
  key(c.engram.pad_id, "pad_id", 0, "token id that pads n-grams before the sequence start");
  key(c.engram.gate, "gate", EngramGate::Sigmoid, "gate: sigmoid | signed_sqrt");
  key(c.engram.lr_mult, "lr_mult", 5.0, "learning-rate multiplier of the tables");
  key(c.engram.compression_map, "compression_map", "",
      "file of V canonical token ids (uint32 or .npy); empty = identity");
  derived<double>(
      c.engram.init_std, "init_std", "model.init_std", [&c] { return c.model.init_std; },
      "std of the table and projection init");

  section("train", "sequence length, batch and steps");
  required(c.train.seq_len, "seq_len", "tokens per sequence T (T-1 targets)");
  required(c.train.global_batch, "global_batch",
           "sequences per step G; divisible by micro_batch * dp * ep");
  required(c.train.micro_batch, "micro_batch", "sequences per micro-batch b");
  required(c.train.max_steps, "max_steps", "optimizer steps of the run");
  key(c.train.seed, "seed", std::uint64_t{0}, "seed of the weight init and data order");
  key(c.train.eval_every, "eval_every", 0, "steps between validation passes; 0 = at the end only");
  key(c.train.eval_instances, "eval_instances", 0, "validation sequences per pass; 0 = all");
  key(c.train.check_memory, "check_memory", true,
      "before allocating, check that the node's memory (or the device's) holds its ranks");
  key(c.train.precision, "precision", Precision::Fp32,
      "GEMM inputs (MODEL.md section 8): fp32 | tf32 (TF32 tensor cores through cuBLAS; GPUs "
      "only) | bf16 (inputs rounded to bf16, fp32 sums, fp32 weights and optimizer; on CPUs "
      "emulated with the same numbers); the router stays fp32");
  key(c.train.recompute, "recompute", Recompute::None,
      "activation recompute: none | block (a block keeps only its input and runs its forward "
      "again just before its backward; bit-identical results, the blocks share one set of "
      "activation buffers)");
  key(c.train.document_mask, "document_mask", false,
      "a position reads only earlier positions of its own document (documents end at "
      "data.eod_id, which belongs to the document it ends): attention, Engram's n-grams and its "
      "convolution stop at the boundary; RoPE positions keep counting from the sequence start");

  section("optimizer", "AdamW and the learning-rate schedule");
  required(c.optimizer.lr, "lr", "peak learning rate");
  key(c.optimizer.beta1, "beta1", 0.9, "AdamW first-moment decay");
  key(c.optimizer.beta2, "beta2", 0.95, "AdamW second-moment decay");
  key(c.optimizer.eps, "eps", 1e-8, "AdamW epsilon");
  key(c.optimizer.weight_decay, "weight_decay", 0.1, "decoupled weight decay");
  key(c.optimizer.clip, "clip", 1.0, "global gradient-norm clip; 0 = off");
  key(c.optimizer.schedule, "schedule", LrSchedule::Cosine,
      "cosine | constant | wsd (warmup-stable-decay)");
  key(c.optimizer.warmup_steps, "warmup_steps", 0, "linear warmup steps");
  key(c.optimizer.final_lr_ratio, "final_lr_ratio", 0.1, "final lr as a fraction of lr");
  key(c.optimizer.decay_steps, "decay_steps", 0, "wsd: length of the final linear decay");
  key(c.optimizer.shard, "shard", OptimizerShard::None,
      "AdamW moments: none (every replica keeps all) | replicas (ZeRO-1: split over the ranks "
      "that hold the tensor; gradients reduce-scattered, parameters all-gathered; in bf16 runs "
      "the fp32 master weights of the product weights split too, bf16 copies gathered)");

  section("data", "token files (headerless arrays or .npy)");
  required(c.data.paths, "paths", "training token files, comma-separated; globs allowed");
  key(c.data.val_paths, "val_paths", std::vector<std::string>{},
      "validation token files, comma-separated; empty = no validation");
  key(c.data.dtype, "dtype", "uint16", "token type of the files: uint16 | uint32");
  key(c.data.tokenizer, "tokenizer", Tokenizer::Bytes,
      "what the token ids mean: bytes (kmoe-prep's byte-level ids: 0..255 the bytes, 256 the "
      "end of a document) | sentencepiece (kmoe-prep --sentencepiece or --train-sentencepiece "
      "with data.tokenizer_model) | external (another tool's, e.g. a model imported from "
      "Hugging Face); kmoe-export and kmoe-generate read it from the checkpoint's deck");
  key(c.data.tokenizer_model, "tokenizer_model", "",
      "data.tokenizer = sentencepiece: the model file (kmoe-prep prints the deck lines)");
  key(c.data.eod_id, "eod_id", -1,
      "the id that ends a document, where generation stops; -1: the tokenizer's (bytes: 256, "
      "external: none; sentencepiece: give it, kmoe-prep prints it); an imported model's "
      "eos_token_id");

  section("parallel", "process grid: world = pp * dp * ep ranks");
  key(c.parallel.pp, "pp", 1, "pipeline stages");
  key(c.parallel.dp, "dp", 1, "data-parallel replicas");
  key(c.parallel.ep, "ep", 1, "expert-parallel ranks");
  key(c.parallel.schedule, "schedule", PipeSchedule::OneFOneB, "pipeline schedule: 1f1b | gpipe");
  key(c.parallel.pp_layers, "pp_layers", std::vector<int>{},
      "blocks per stage, comma-separated (pp entries); empty = even split");
  key(c.parallel.engram_shard, "engram_shard", EngramShardGroup::None,
      "Engram tables: none (replicated) | ep | stage (row-block sharded)");
  key(c.parallel.watchdog_seconds, "watchdog_seconds", 300,
      "abort a rank stuck this long in a collective");
  key(c.parallel.bucket_mb, "bucket_mb", 25.0,
      "gradient all-reduce bucket size (MiB); buckets start during the last backward");
  key(c.parallel.backend, "backend", CommBackend::Mpi, "data plane of the axes: mpi | nccl");
  key(c.parallel.cuda_aware_mpi, "cuda_aware_mpi", CudaAwareMpi::Auto,
      "MPI takes device pointers in every operation, nonblocking collectives included: "
      "true | false or auto (stage through pinned host memory)");

  section("checkpoint", "HDF5 checkpoints");
  key(c.checkpoint.dir, "dir", "checkpoints", "checkpoint directory");
  key(c.checkpoint.every, "every", 0, "steps between checkpoints; 0 = at the end only");
  key(c.checkpoint.keep, "keep", 3, "newest checkpoint files kept");
  key(c.checkpoint.resume, "resume", "auto", "auto (newest in dir) | none | <file>");
  key(c.checkpoint.save_initial, "save_initial", false, "also save the step-0 state");
  key(c.checkpoint.at_end, "at_end", true,
      "save after train.max_steps (false: benchmarks; a stop by signal or error still saves)");
  key(c.checkpoint.overwrite, "overwrite", false,
      "a fresh run may replace another run's checkpoints (dir) and metrics.csv (output.dir)");
  key(c.checkpoint.lock_stale_seconds, "lock_stale_seconds", 600,
      "a run lock (dir/kmoe.lock) whose heartbeat is older than this is stale and taken over");

  section("output", "logging, metrics and dumps");
  key(c.output.dir, "dir", "run", "directory of metrics.csv, the resolved deck and dumps");
  key(c.output.log_every, "log_every", 1, "steps between log lines");
  key(c.output.peak_flops, "peak_flops", 0.0,
      "peak FLOP/s per rank for MFU, the device's dense peak for train.precision "
      "(H100/H200 SXM: fp32 67e12, tf32 494e12, bf16 989e12); 0 = no MFU");
  key(c.output.phase_timing, "phase_timing", false,
      "time the step's phases (data, forward, backward, ...): the host waits for the device "
      "at every phase boundary");
  key(c.output.dump_step, "dump_step", std::vector<int>{},
      "steps to dump (tokens, loss, gradients, routes) to <dir>/dump_step<s>.h5");
}

const KeySpec* Schema::find(const std::string& name) const {
  for (const KeySpec& spec : keys_) {
    if (spec.name() == name) return &spec;
  }
  return nullptr;
}

bool Schema::has_section(const std::string& section) const {
  for (const SectionSpec& s : sections_) {
    if (s.name == section) return true;
  }
  return false;
}

}  // namespace kmoe::deck
