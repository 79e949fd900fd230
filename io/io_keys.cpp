#include "io/io_keys.hpp"

#include <string>
#include <vector>

#include "core/error.hpp"

namespace kmoe {

namespace {

void check_data(const DataCfg& d, int vocab_size, const deck::Locate& locate) {
  deck::require_one_of(locate, "data.dtype", d.dtype, {"uint16", "uint32"});
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
  KMOE_DECK_REQUIRE(
      d.eod_id >= -1 && d.eod_id < vocab_size, "data.eod_id",
      "data.eod_id = " << d.eod_id << " is outside the vocabulary [0, " << vocab_size << ")");
}

void check_data_section(const Config& c, const deck::Locate& locate) {
  check_data(c.data, c.model.vocab_size, locate);
  KMOE_DECK_REQUIRE(!c.train.document_mask || c.data.end_of_document(c.model.vocab_size) >= 0,
                    "train.document_mask",
                    "train.document_mask = true needs an end-of-document id: set data.eod_id (the "
                    "tokenizer '"
                        << choice_name(c.data.tokenizer) << "' of a " << c.model.vocab_size
                        << "-id vocabulary has none)");
}

void declare_data(deck::Schema& s, Config& c) {
  s.required(c.data.paths, "paths", "training token files, comma-separated; globs allowed");
  s.key(c.data.val_paths, "val_paths", std::vector<std::string>{},
        "validation token files, comma-separated; empty = no validation");
  s.key(c.data.dtype, "dtype", "uint16", "token type of the files: uint16 | uint32");
  s.key(c.data.tokenizer, "tokenizer", Tokenizer::Bytes,
        "what the token ids mean: bytes (kmoe-prep's byte-level ids: 0..255 the bytes, 256 the "
        "end of a document) | sentencepiece (kmoe-prep --sentencepiece or --train-sentencepiece "
        "with data.tokenizer_model) | external (another tool's, e.g. a model imported from "
        "Hugging Face); kmoe-export and kmoe-generate read it from the checkpoint's deck");
  s.key(c.data.tokenizer_model, "tokenizer_model", "",
        "data.tokenizer = sentencepiece: the model file (kmoe-prep prints the deck lines)");
  s.key(c.data.eod_id, "eod_id", -1,
        "the id that ends a document, where generation stops; -1: the tokenizer's (bytes: 256, "
        "external: none; sentencepiece: give it, kmoe-prep prints it); an imported model's "
        "eos_token_id");
}

void check_checkpoint(const CheckpointCfg& k, const deck::Locate& locate) {
  KMOE_DECK_REQUIRE(!k.dir.empty(), "checkpoint.dir", "checkpoint.dir must not be empty");
  KMOE_DECK_REQUIRE(k.every >= 0, "checkpoint.every", "checkpoint.every must be >= 0");
  KMOE_DECK_REQUIRE(k.keep >= 1, "checkpoint.keep", "checkpoint.keep must be at least 1");
  KMOE_DECK_REQUIRE(k.lock_stale_seconds >= 1, "checkpoint.lock_stale_seconds",
                    "checkpoint.lock_stale_seconds must be at least 1");
  KMOE_DECK_REQUIRE(!k.resume.empty(), "checkpoint.resume",
                    "checkpoint.resume must be auto, none or a file");
}

void declare_checkpoint(deck::Schema& s, Config& c) {
  s.key(c.checkpoint.dir, "dir", "checkpoints", "checkpoint directory");
  s.key(c.checkpoint.every, "every", 0, "steps between checkpoints; 0 = at the end only");
  s.key(c.checkpoint.keep, "keep", 3, "newest checkpoint files kept");
  s.key(c.checkpoint.resume, "resume", "auto", "auto (newest in dir) | none | <file>");
  s.key(c.checkpoint.save_initial, "save_initial", false, "also save the step-0 state");
  s.key(c.checkpoint.at_end, "at_end", true,
        "save after train.max_steps (false: benchmarks; a stop by signal or error still saves)");
  s.key(c.checkpoint.overwrite, "overwrite", false,
        "a fresh run may replace another run's checkpoints (dir) and metrics.csv (output.dir)");
  s.key(c.checkpoint.lock_stale_seconds, "lock_stale_seconds", 600,
        "a run lock (dir/kmoe.lock) whose heartbeat is older than this is stale and taken over");
}

void check_output(const OutputCfg& o, const deck::Locate& locate) {
  KMOE_DECK_REQUIRE(!o.dir.empty(), "output.dir", "output.dir must not be empty");
  KMOE_DECK_REQUIRE(o.log_every >= 1, "output.log_every", "output.log_every must be at least 1");
  KMOE_DECK_REQUIRE(o.peak_flops >= 0, "output.peak_flops",
                    "output.peak_flops must be non-negative (0 = no MFU)");
  for (const int step : o.dump_step) {
    KMOE_DECK_REQUIRE(step >= 1, "output.dump_step",
                      "output.dump_step entries are steps, at least 1; got " << step);
  }
}

void declare_output(deck::Schema& s, Config& c) {
  s.key(c.output.dir, "dir", "run", "directory of metrics.csv, the resolved deck and dumps");
  s.key(c.output.log_every, "log_every", 1, "steps between log lines");
  s.key(c.output.peak_flops, "peak_flops", 0.0,
        "peak FLOP/s per rank for MFU, the device's dense peak for train.precision "
        "(H100/H200 SXM: fp32 67e12, tf32 494e12, bf16 989e12); 0 = no MFU");
  s.key(c.output.phase_timing, "phase_timing", false,
        "time the step's phases (data, forward, backward, ...): the host waits for the device "
        "at every phase boundary");
  s.key(c.output.dump_step, "dump_step", std::vector<int>{},
        "steps to dump (tokens, loss, gradients, routes) to <dir>/dump_step<s>.h5");
}

}  // namespace

deck::DeckSection data_deck_section() {
  return {"data", "token files (headerless arrays or .npy)", declare_data,
          [](const Config& c, const deck::Locate& l) { check_data_section(c, l); }, 5};
}

deck::DeckSection checkpoint_deck_section() {
  return {"checkpoint", "HDF5 checkpoints", declare_checkpoint,
          [](const Config& c, const deck::Locate& l) { check_checkpoint(c.checkpoint, l); }, 7};
}

deck::DeckSection output_deck_section() {
  return {"output", "logging, metrics and dumps", declare_output,
          [](const Config& c, const deck::Locate& l) { check_output(c.output, l); }, 8};
}

}  // namespace kmoe
