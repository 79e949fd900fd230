// kmoe models as Hugging Face model directories (docs/INTEROP.md): which architecture a model
// is there, its config.json, generation_config.json and (byte-level ids) tokenizer files, the
// names of its tensors, and the reverse: a config.json read into a kmoe deck's model.
//
//   dense, model.block_norm = reordered  ->  olmo2      (QK-norm, norms after each sublayer)
//   dense, pre                           ->  llama      (no QK-norm)
//   MoE,   reordered                     ->  flex_olmo  (OLMoE's router and experts, olmo2 norms)
//   MoE,   pre                           ->  olmoe
//
// What a target cannot express is an error naming the kmoe feature: Engram memory, shared
// experts, sigmoid router scores, an aux-loss-free router bias, dense blocks inside an MoE
// model, QK-norm off where the target always has it and on where it has none. Training-only
// settings (z-losses, the load-balancing coefficient, capacity) do not change the model.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/tensor_table.hpp"

namespace kmoe {

enum class HfArch { Olmo2, Llama, Olmoe, FlexOlmo };
const char* hf_model_type(HfArch arch);  // "olmo2", "llama", "olmoe", "flex_olmo"

// The architecture cfg's model is exported as; throws naming what no target expresses.
HfArch hf_arch_for(const Config& cfg);

// config.json (torch_dtype "float32" or "bfloat16"), generation_config.json, and the byte-level
// tokenizer's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json): file name
// -> text. No tokenizer files for data.tokenizer = external.
std::map<std::string, std::string> hf_model_files(const Config& cfg, HfArch arch,
                                                  const std::string& torch_dtype);

// The Hugging Face tensors of one kmoe tensor (global shape): one, or one per expert (row e of
// an expert tensor's dimension 0), each with its shape.
struct HfTensor {
  std::string name;
  int expert = -1;
  std::vector<std::int64_t> shape;
};
std::vector<HfTensor> hf_tensors_of(const Config& cfg, HfArch arch, const TensorSpec& spec);

// A config.json read back: the deck lines of its [model] and [moe] sections, what the rest of
// a deck should follow (the end-of-document id, the trained context, the ids' width), and the
// architecture. Throws naming the file and the key for a model type or a setting kmoe cannot
// express (rope scaling, sliding windows, biases, another activation, clipped q/k/v, ...).
struct HfImport {
  HfArch arch = HfArch::Olmo2;
  std::string model_sections;       // "[model]\n...\n[moe]\n..." as deck text
  int vocab_size = 0;
  int max_position_embeddings = 0;  // 0 when not given
  bool has_eos = false;             // eos_token_id given (one id, or a list's first)
  std::int64_t eos_token_id = -1;
  // The config.json key each deck key of model_sections comes from ("moe.top_k" ->
  // "num_experts_per_tok"), so deck errors name the file the user has.
  std::map<std::string, std::string> source_keys;
};
HfImport hf_import_config(const std::string& config_json_path);

// Whether `tokenizer_json_path` is kmoe's byte-level tokenizer as hf_model_files writes it (byte
// b is id b); false when the file is absent or any other tokenizer.
bool hf_byte_level_tokenizer(const std::string& tokenizer_json_path);

}  // namespace kmoe
