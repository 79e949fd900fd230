// kmoe-import HF_DIR --deck OUT_DECK --checkpoint OUT_FILE [--section.key=value ...]
// A Hugging Face model directory (olmo2, llama, olmoe or flex_olmo; safetensors, sharded or
// not) as a kmoe step-0 checkpoint and the deck that describes it (docs/INTEROP.md): the deck's
// model from config.json, training settings from defaults and the overrides, and
// checkpoint.resume naming the new file, so `kmoe-train -i OUT_DECK` continues from the
// imported weights on any layout. Unsupported config keys, missing, misshapen or extra tensors
// and broken safetensors files are errors naming the file and the key or tensor.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "drivers/driver_main.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"
#include "io/hf_model.hpp"
#include "io/safetensors.hpp"
#include "modules/model/stage.hpp"

namespace {

namespace fs = std::filesystem;

const char* kUsage =
    "usage: kmoe-import HF_DIR --deck OUT_DECK --checkpoint OUT_FILE [--section.key=value ...]\n"
    "  reads a Hugging Face model directory (olmo2, llama, olmoe, flex_olmo; config.json and\n"
    "  safetensors) and writes a kmoe checkpoint after step 0 and a deck that resumes from it;\n"
    "  --section.key=value sets the deck's training keys (e.g. --data.paths=data/train.bin\n"
    "  --train.seq_len=2048; train.seq_len is part of the model once trained on).\n";

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  return kmoe::run_driver(argc, argv, "kmoe-import", kUsage, [](int argc, char** argv, const kmoe::ExecutionPlan&) {
    std::string dir, deck_out, ckpt_out;
    std::vector<std::string> overrides;
    for (int i = 1; i < argc; ++i) {
      const std::string s = argv[i];
      if ((s == "--deck" || s == "--checkpoint") && i + 1 < argc) {
        (s == "--deck" ? deck_out : ckpt_out) = argv[++i];
      } else if (s.rfind("--", 0) == 0 && s.find('.') != std::string::npos) {
        overrides.push_back(s);
      } else if (s.rfind("--", 0) == 0 || !dir.empty()) {
        KMOE_FAIL("unknown argument '" << s << "'\n" << kUsage);
      } else {
        dir = s;
      }
    }
    KMOE_REQUIRE(!dir.empty() && !deck_out.empty() && !ckpt_out.empty(),
                 "need a model directory, --deck and --checkpoint\n" << kUsage);
    int ranks = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    KMOE_REQUIRE(ranks == 1, "kmoe-import runs on one process (launched on " << ranks << ")");
    const auto t0 = std::chrono::steady_clock::now();

    // 1. The deck: the model from config.json, training defaults a user edits or overrides.
    const std::string config_json = (fs::path(dir) / "config.json").string();
    const kmoe::HfImport hf = kmoe::hf_import_config(config_json);
    const bool bytes = kmoe::hf_byte_level_tokenizer((fs::path(dir) / "tokenizer.json").string());
    const int seq_len =
        hf.max_position_embeddings > 0 ? std::min(hf.max_position_embeddings, 4096) : 2048;
    std::ostringstream d;
    d << "# Imported by kmoe-import from " << dir << " (" << kmoe::hf_model_type(hf.arch)
      << "). The model sections come from its config.json; train, optimizer and data are\n"
      << "# defaults to edit. train.seq_len is part of the model from the first step on.\n\n"
      << hf.model_sections << "\n[train]\nseq_len = " << seq_len
      << "\nglobal_batch = 8\nmicro_batch = 1\nmax_steps = 1000\n\n"
      << "[optimizer]\nlr = 1e-4\nwarmup_steps = 100\n\n"
      << "[data]\npaths = data/train.bin\ndtype = " << (hf.vocab_size > 65536 ? "uint32" : "uint16")
      << "\ntokenizer = " << (bytes ? "bytes" : "external") << "\n";
    if (hf.has_eos) d << "eod_id = " << hf.eos_token_id << "\n";
    d << "\n[checkpoint]\nresume = " << ckpt_out << "\n";
    // A deck error in a key config.json gave names config.json's key.
    const kmoe::Config cfg = kmoe::parse_deck(
        d.str(), deck_out, overrides, [&](const std::string& key, const std::string& value) {
          const auto it = hf.source_keys.find(key);
          return it == hf.source_keys.end()
                     ? std::string()
                     : config_json + ": " + it->second + " gives " + key + " = " + value;
        });
    const kmoe::HfArch arch = kmoe::hf_arch_for(cfg);
    KMOE_REQUIRE(arch == hf.arch, deck_out << ": the overrides make the model a "
                                           << kmoe::hf_model_type(arch) << ", not the "
                                           << kmoe::hf_model_type(hf.arch) << " of " << dir);

    // 2. The tensors: every kmoe tensor from its Hugging Face tensors, shapes checked; every
    // tensor of the directory must find its place.
    const kmoe::HfWeights weights(dir);
    const std::vector<kmoe::TensorSpec> tensors = kmoe::model_tensors(cfg);
    std::set<std::string> used;
    std::int64_t read_values = 0;
    kmoe::write_initial_checkpoint(
        ckpt_out, cfg, tensors, [&](const kmoe::TensorSpec& g, std::vector<float>& v) {
          for (const kmoe::HfTensor& h : kmoe::hf_tensors_of(cfg, arch, g)) {
            const kmoe::StTensor& t = weights.tensor(h.name);
            KMOE_REQUIRE(t.shape == h.shape,
                         dir << ": tensor " << h.name << " has shape " << shape_text(t.shape)
                             << ", config.json makes it " << shape_text(h.shape));
            const std::int64_t n = t.numel();
            float* at = v.data() + (h.expert < 0 ? 0 : h.expert * n);
            weights.read_f32(h.name, at);
            for (std::int64_t i = 0; i < n; ++i)  // a NaN or Inf would be trained on
              KMOE_REQUIRE(std::isfinite(at[i]),
                           dir << ": tensor " << h.name << " holds " << at[i] << " at element "
                               << i << " (a non-finite value): refusing to import it");
            used.insert(h.name);
            read_values += n;
          }
        });
    for (const std::string& n : weights.names()) {
      if (used.count(n) || n.find("rotary_emb.inv_freq") != std::string::npos) continue;
      // A tied model's file may carry the head's copy of the embedding; the loaders drop it.
      if (n == "lm_head.weight" && cfg.model.tie_embeddings) continue;
      std::error_code ec;
      fs::remove(ckpt_out, ec);
      KMOE_FAIL(dir << ": tensor " << n << " has no place in the " << kmoe::hf_model_type(arch)
                    << " model config.json describes (a bias, or another architecture's?)");
    }

    // 3. The deck, resolved: every key with its value, the overrides included.
    {
      std::ofstream out(deck_out);
      out << "# kmoe-import " << dir << " (" << kmoe::hf_model_type(arch) << "): every key "
          << "resolved; edit [train], [optimizer] and [data] before training.\n"
          << cfg.resolved_text;
      out.close();
      KMOE_REQUIRE(!out.fail(), deck_out << ": cannot write");
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("imported %s (%s): %zu tensors, %.1f MiB of fp32 weights in %.2f s; wrote %s "
                "and %s (data.tokenizer = %s)\n",
                dir.c_str(), kmoe::hf_model_type(arch), tensors.size(),
                read_values * 4.0 / (1024.0 * 1024.0), secs, ckpt_out.c_str(), deck_out.c_str(),
                bytes ? "bytes" : "external");
  });
}
