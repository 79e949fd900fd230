// kmoe-export CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--max-shard-size MiB] [--overwrite]
// A checkpoint as a Hugging Face model directory (docs/INTEROP.md): config.json,
// generation_config.json, the weights as safetensors (one model.safetensors, or
// model-0000k-of-0000n.safetensors shards of at most --max-shard-size MiB with
// model.safetensors.index.json) and, for byte-level ids, the tokenizer. The model is the
// checkpoint's own deck (its /input/deck); a model no Hugging Face type can express is an
// error naming the feature, and so is a non-finite weight (before OUT_DIR is touched). One
// process; tensors are read and written one at a time.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "drivers/driver_main.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"
#include "io/hdf5_file.hpp"
#include "io/hf_model.hpp"
#include "io/safetensors.hpp"
#include "modules/model/stage.hpp"

namespace {

namespace fs = std::filesystem;

const char* kUsage =
    "usage: kmoe-export CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--max-shard-size MiB] "
    "[--overwrite]\n"
    "  writes CHECKPOINT's model as a Hugging Face model directory: config.json,\n"
    "  generation_config.json, safetensors weights (--dtype, default fp32; sharded above\n"
    "  --max-shard-size MiB, default 5000) and, for byte-level ids, the tokenizer files.\n"
    "  dense reordered -> olmo2, dense pre -> llama, MoE reordered -> flex_olmo, MoE pre ->\n"
    "  olmoe. --overwrite replaces an OUT_DIR that already holds a model.\n";

struct Piece {  // one Hugging Face tensor: which kmoe tensor and which expert of it
  kmoe::StTensor st;
  std::size_t source;
  int expert;
};

std::string shard_name(std::size_t k, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  KMOE_REQUIRE(!out.fail(), path.string() << ": cannot write");
}

}  // namespace

int main(int argc, char** argv) {
  return kmoe::run_driver(argc, argv, "kmoe-export", kUsage, [](int argc, char** argv, const kmoe::ExecutionPlan&) {
    std::vector<std::string> positional;
    std::string dtype = "fp32";
    double shard_mib = 5000.0;
    bool overwrite = false;
    for (int i = 1; i < argc; ++i) {
      const std::string s = argv[i];
      if (s == "--dtype" && i + 1 < argc) {
        dtype = argv[++i];
      } else if (s == "--max-shard-size" && i + 1 < argc) {
        try {
          shard_mib = std::stod(argv[++i]);
        } catch (const std::exception&) {
          KMOE_FAIL("--max-shard-size " << argv[i] << ": not a number of MiB");
        }
      } else if (s == "--overwrite") {
        overwrite = true;
      } else if (s.rfind("--", 0) == 0) {
        KMOE_FAIL("unknown argument '" << s << "'\n" << kUsage);
      } else {
        positional.push_back(s);
      }
    }
    KMOE_REQUIRE(positional.size() == 2, "need a checkpoint and an output directory\n" << kUsage);
    KMOE_REQUIRE(dtype == "fp32" || dtype == "bf16", "--dtype " << dtype << ": fp32 or bf16");
    KMOE_REQUIRE(shard_mib > 0, "--max-shard-size " << shard_mib << ": must be positive");
    int ranks = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    KMOE_REQUIRE(ranks == 1, "kmoe-export runs on one process (launched on " << ranks << ")");
    const std::string checkpoint = positional[0];
    const fs::path out = positional[1];
    const auto t0 = std::chrono::steady_clock::now();

    // 1. The model: the checkpoint's own deck, checked against the file.
    KMOE_REQUIRE(fs::exists(checkpoint), checkpoint << ": no such file");
    const kmoe::H5File file = kmoe::H5File::open(checkpoint, MPI_COMM_SELF);
    KMOE_REQUIRE(file.has_attr("/input", "deck"),
                 checkpoint << ": not a kmoe checkpoint (no /input deck attribute)");
    const kmoe::Config cfg =
        kmoe::parse_deck(file.attr_string("/input", "deck"), checkpoint + ":/input/deck");
    const kmoe::TrainState state = kmoe::check_checkpoint(checkpoint, cfg, nullptr);
    const kmoe::HfArch arch = kmoe::hf_arch_for(cfg);

    // 2. The Hugging Face tensors in model order, cut into shards at tensor boundaries.
    const std::vector<kmoe::TensorSpec> tensors = kmoe::model_tensors(cfg);
    const kmoe::StDtype st = dtype == "bf16" ? kmoe::StDtype::BF16 : kmoe::StDtype::F32;
    const std::int64_t limit = static_cast<std::int64_t>(shard_mib * 1024 * 1024);
    std::vector<std::vector<Piece>> shards(1);
    std::int64_t in_shard = 0, total = 0;
    for (std::size_t i = 0; i < tensors.size(); ++i)
      for (const kmoe::HfTensor& h : kmoe::hf_tensors_of(cfg, arch, tensors[i])) {
        kmoe::StTensor t;
        t.name = h.name;
        t.dtype = st;
        t.shape = h.shape;
        const std::int64_t bytes = t.numel() * kmoe::st_dtype_bytes(st);
        if (in_shard > 0 && in_shard + bytes > limit) {
          shards.emplace_back();
          in_shard = 0;
        }
        shards.back().push_back({t, i, h.expert});
        in_shard += bytes;
        total += bytes;
      }

    // 2b. Every weight finite, checked before OUT_DIR is touched: exported, a NaN or Inf would
    // load silently elsewhere (every kmoe tool refuses such a checkpoint).
    {
      std::vector<float> v;
      for (const kmoe::TensorSpec& g : tensors) {
        std::int64_t n = 1;
        for (std::int64_t d : g.shape) n *= d;
        v.resize(n);
        const std::string dataset = "/model/" + kmoe::tensor_path(g.name);
        file.read_f32(dataset, g.shape, v.data());
        kmoe::require_finite(checkpoint, dataset, g, 0, v.data(), n, "export");
      }
    }

    // 3. The directory: a fresh one, or --overwrite.
    std::error_code ec;
    if (fs::exists(out / "config.json") || fs::exists(out / "model.safetensors") ||
        fs::exists(out / "model.safetensors.index.json"))
      KMOE_REQUIRE(overwrite, out.string() << " already holds a model; pass --overwrite to "
                                              "replace it");
    fs::create_directories(out, ec);
    KMOE_REQUIRE(!ec, out.string() << ": cannot create: " << ec.message());
    for (const auto& entry : fs::directory_iterator(out)) {  // no stale shards of another export
      const std::string n = entry.path().filename().string();
      if (n.rfind("model-", 0) == 0 && n.find(".safetensors") != std::string::npos)
        fs::remove(entry.path());
    }
    fs::remove(out / "model.safetensors.index.json", ec);

    // 4. The weights: each kmoe tensor read once, its pieces written in order.
    const std::map<std::string, std::string> meta = {{"format", "pt"}};
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    std::vector<float> values;
    std::size_t loaded = tensors.size();  // the kmoe tensor `values` holds
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const std::string name = shards.size() == 1 ? "model.safetensors" : shard_name(k, shards.size());
      std::vector<kmoe::StTensor> plan;
      for (const Piece& p : shards[k]) plan.push_back(p.st);
      kmoe::SafetensorsWriter w((out / name).string(), plan, meta);
      for (const Piece& p : shards[k]) {
        const kmoe::TensorSpec& g = tensors[p.source];
        if (loaded != p.source) {
          std::int64_t n = 1;
          for (std::int64_t d : g.shape) n *= d;
          values.resize(n);
          file.read_f32("/model/" + kmoe::tensor_path(g.name), g.shape, values.data());
          loaded = p.source;
        }
        const std::int64_t n = p.st.numel();
        w.write_next(p.st.name, values.data() + (p.expert < 0 ? 0 : p.expert * n), n);
        weight_map[p.st.name] = name;
      }
      w.finish();
    }
    if (shards.size() > 1) {
      nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}},
                                      {"weight_map", weight_map}};
      write_text(out / "model.safetensors.index.json", index.dump(2) + "\n");
    }
    for (const auto& [name, text] :
         kmoe::hf_model_files(cfg, arch, dtype == "bf16" ? "bfloat16" : "float32"))
      write_text(out / name, text);

    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("exported %s (step %d) as %s to %s: %zu tensors, %zu file(s), %.1f MiB of %s "
                "weights in %.2f s\n",
                checkpoint.c_str(), state.step, kmoe::hf_model_type(arch), out.string().c_str(),
                weight_map.size(), shards.size(), total / (1024.0 * 1024.0), dtype.c_str(), secs);
    if (cfg.data.tokenizer == kmoe::Tokenizer::External)
      std::printf("note: data.tokenizer = external: no tokenizer files written (the ids are "
                  "another tool's)\n");
    if (cfg.data.tokenizer == kmoe::Tokenizer::SentencePiece)
      std::printf("note: data.tokenizer = sentencepiece: no Hugging Face tokenizer files written; "
                  "the model's SentencePiece file is %s\n",
                  cfg.data.tokenizer_model.c_str());
  });
}
