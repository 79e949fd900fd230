// Input deck: values and defaults, overrides, the resolved deck's round trip, and that every kind
// of user mistake is an error naming the file, the key, the value and the line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "io/deck.hpp"
#include "io/deck_schema.hpp"
#include "train/planner.hpp"

namespace kmoe {
namespace {

// Line numbers matter to the error tests: d_model is on line 4, n_heads 6, global_batch 12,
// max_steps 13, lr 16, paths 19, dtype 20, [parallel] 22; the text ends on line 24.
const char* const kDeck = R"(# tiny test model
[model]
vocab_size = 1000
d_model = 64
n_layers = 4
n_heads = 4   # head dim 16
ffn_hidden = 128

[train]
seq_len = 32
micro_batch = 2
global_batch = 8
max_steps = 10

[optimizer]
lr = 3e-3

[data]
paths = a.bin, /data/b*.npy
dtype = uint16

[parallel]
pp = 2
dp = 2
)";

// kDeck with the first line that starts with `prefix` replaced by `line`.
std::string deck_with(const std::string& prefix, const std::string& line) {
  std::string text = kDeck;
  const auto at = text.find("\n" + prefix) + 1;
  return text.replace(at, text.find('\n', at) - at, line);
}

std::string deck_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse_deck(text, "test.deck", overrides);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "deck parsed without error:\n" << text;
  return "";
}

void expect_contains(const std::string& message, std::initializer_list<const char*> parts) {
  for (const char* part : parts) {
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

void expect_same_config(const Config& a, const Config& b) {
  EXPECT_EQ(a.model.vocab_size, b.model.vocab_size);
  EXPECT_EQ(a.model.d_model, b.model.d_model);
  EXPECT_EQ(a.model.n_layers, b.model.n_layers);
  EXPECT_EQ(a.model.n_heads, b.model.n_heads);
  EXPECT_EQ(a.model.n_kv_heads, b.model.n_kv_heads);
  EXPECT_EQ(a.model.ffn_hidden, b.model.ffn_hidden);
  EXPECT_EQ(a.model.norm_eps, b.model.norm_eps);
  EXPECT_EQ(a.model.rope_theta, b.model.rope_theta);
  EXPECT_EQ(a.model.qk_norm, b.model.qk_norm);
  EXPECT_EQ(a.model.block_norm, b.model.block_norm);
  EXPECT_EQ(a.model.tie_embeddings, b.model.tie_embeddings);
  EXPECT_EQ(a.model.init_std, b.model.init_std);
  EXPECT_EQ(a.model.output_z_coef, b.model.output_z_coef);
  EXPECT_EQ(a.train.seq_len, b.train.seq_len);
  EXPECT_EQ(a.train.global_batch, b.train.global_batch);
  EXPECT_EQ(a.train.micro_batch, b.train.micro_batch);
  EXPECT_EQ(a.train.max_steps, b.train.max_steps);
  EXPECT_EQ(a.train.seed, b.train.seed);
  EXPECT_EQ(a.train.eval_every, b.train.eval_every);
  EXPECT_EQ(a.train.eval_instances, b.train.eval_instances);
  EXPECT_EQ(a.optimizer.lr, b.optimizer.lr);
  EXPECT_EQ(a.optimizer.beta1, b.optimizer.beta1);
  EXPECT_EQ(a.optimizer.beta2, b.optimizer.beta2);
  EXPECT_EQ(a.optimizer.eps, b.optimizer.eps);
  EXPECT_EQ(a.optimizer.weight_decay, b.optimizer.weight_decay);
  EXPECT_EQ(a.optimizer.clip, b.optimizer.clip);
  EXPECT_EQ(a.optimizer.schedule, b.optimizer.schedule);
  EXPECT_EQ(a.optimizer.warmup_steps, b.optimizer.warmup_steps);
  EXPECT_EQ(a.optimizer.final_lr_ratio, b.optimizer.final_lr_ratio);
  EXPECT_EQ(a.optimizer.decay_steps, b.optimizer.decay_steps);
  EXPECT_EQ(a.data.paths, b.data.paths);
  EXPECT_EQ(a.data.val_paths, b.data.val_paths);
  EXPECT_EQ(a.data.dtype, b.data.dtype);
  EXPECT_EQ(a.parallel.pp, b.parallel.pp);
  EXPECT_EQ(a.parallel.dp, b.parallel.dp);
  EXPECT_EQ(a.parallel.ep, b.parallel.ep);
  EXPECT_EQ(a.parallel.schedule, b.parallel.schedule);
  EXPECT_EQ(a.parallel.pp_layers, b.parallel.pp_layers);
  EXPECT_EQ(a.parallel.engram_shard, b.parallel.engram_shard);
  EXPECT_EQ(a.parallel.watchdog_seconds, b.parallel.watchdog_seconds);
  EXPECT_EQ(a.checkpoint.dir, b.checkpoint.dir);
  EXPECT_EQ(a.checkpoint.every, b.checkpoint.every);
  EXPECT_EQ(a.checkpoint.keep, b.checkpoint.keep);
  EXPECT_EQ(a.checkpoint.resume, b.checkpoint.resume);
  EXPECT_EQ(a.checkpoint.save_initial, b.checkpoint.save_initial);
  EXPECT_EQ(a.output.dir, b.output.dir);
  EXPECT_EQ(a.output.log_every, b.output.log_every);
  EXPECT_EQ(a.output.peak_flops, b.output.peak_flops);
  EXPECT_EQ(a.output.dump_step, b.output.dump_step);
}

TEST(Deck, ValidDeckParsesWithValuesAndDefaults) {
  const Config c = parse_deck(kDeck, "test.deck");
  EXPECT_EQ(c.model.vocab_size, 1000);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_EQ(c.model.n_layers, 4);
  EXPECT_EQ(c.model.n_heads, 4);
  EXPECT_EQ(c.model.ffn_hidden, 128);
  EXPECT_EQ(c.model.head_dim(), 16);
  EXPECT_EQ(c.train.seq_len, 32);
  EXPECT_EQ(c.train.global_batch, 8);
  EXPECT_EQ(c.train.micro_batch, 2);
  EXPECT_EQ(c.train.max_steps, 10);
  EXPECT_EQ(c.optimizer.lr, 3e-3);
  EXPECT_EQ(c.data.paths, (std::vector<std::string>{"a.bin", "/data/b*.npy"}));
  EXPECT_TRUE(c.data.val_paths.empty());
  EXPECT_EQ(c.parallel.pp, 2);
  EXPECT_EQ(c.parallel.dp, 2);
  EXPECT_EQ(c.parallel.world(), 4);
  EXPECT_EQ(c.deck_path, "");

  // Every key not in the deck takes the default config.hpp gives its member: the key table and
  // the structs must not drift apart.
  Config expected;
  expected.model.vocab_size = 1000;
  expected.model.d_model = 64;
  expected.model.n_layers = 4;
  expected.model.n_heads = 4;
  expected.model.n_kv_heads = 4;
  expected.model.ffn_hidden = 128;
  expected.train.seq_len = 32;
  expected.train.global_batch = 8;
  expected.train.micro_batch = 2;
  expected.train.max_steps = 10;
  expected.optimizer.lr = 3e-3;
  expected.data.paths = c.data.paths;
  expected.parallel.pp = 2;
  expected.parallel.dp = 2;
  expect_same_config(c, expected);
  EXPECT_EQ(c.train.seed, 0u);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.schedule, LrSchedule::Cosine);
  EXPECT_EQ(c.parallel.watchdog_seconds, 300);
  EXPECT_EQ(c.parallel.spin_microseconds, 200);
  EXPECT_EQ(c.checkpoint.resume, "auto");
  EXPECT_EQ(c.output.peak_flops, 0.0);
}

TEST(Deck, KvHeadsDefaultToQueryHeads) {
  EXPECT_EQ(parse_deck(kDeck, "test.deck").model.n_kv_heads, 4);
  EXPECT_EQ(parse_deck(kDeck, "test.deck", {"--model.n_heads=2"}).model.n_kv_heads, 2);
  EXPECT_EQ(
      parse_deck(deck_with("n_heads", "n_heads = 4\nn_kv_heads = 2"), "test.deck").model.n_kv_heads,
      2);
}

TEST(Deck, OverridesWinOverTheFile) {
  const Config c =
      parse_deck(kDeck, "test.deck",
                 {"--train.max_steps=50", "optimizer.lr = 0.01", "--model.qk_norm=false",
                  "--data.paths=x.bin", "--output.dump_step=1, 5", "--train.max_steps=60"});
  EXPECT_EQ(c.train.max_steps, 60);  // the later override wins
  EXPECT_EQ(c.optimizer.lr, 0.01);
  EXPECT_FALSE(c.model.qk_norm);
  EXPECT_EQ(c.data.paths, std::vector<std::string>{"x.bin"});
  EXPECT_EQ(c.output.dump_step, (std::vector<int>{1, 5}));
}

TEST(Deck, ResolvedTextRoundTrips) {
  const Config a = parse_deck(
      deck_with("n_heads", "n_heads = 4\nrope_theta = 10000\nnorm_eps = 1e-5\nqk_norm = off"),
      "test.deck",
      {"--optimizer.lr=0.00030000000000000003", "--train.seed=18446744073709551615",
       "--output.peak_flops=9.89e14", "--parallel.pp_layers=1,3", "--data.val_paths=v.bin",
       "--optimizer.schedule=wsd", "--optimizer.decay_steps=3", "--checkpoint.save_initial=yes"});
  EXPECT_EQ(a.resolved_text.rfind("# kmoe resolved deck\n", 0), 0u) << a.resolved_text;
  EXPECT_NE(a.resolved_text.find("\nn_kv_heads = 4\n"), std::string::npos) << a.resolved_text;
  EXPECT_NE(a.resolved_text.find("\nrope_theta = 10000\n"), std::string::npos);
  EXPECT_NE(a.resolved_text.find("\nval_paths = v.bin\n"), std::string::npos);
  EXPECT_EQ(a.train.seed, std::numeric_limits<std::uint64_t>::max());

  const Config b = parse_deck(a.resolved_text, "resolved.deck");
  expect_same_config(a, b);
  EXPECT_EQ(a.resolved_text, b.resolved_text);
  // Every optional key left at its default still shows, empty lists included.
  const Config d = parse_deck(kDeck, "test.deck");
  expect_same_config(d, parse_deck(d.resolved_text, "resolved.deck"));
  EXPECT_NE(d.resolved_text.find("\n[checkpoint]\ndir = checkpoints\n"), std::string::npos);
  EXPECT_NE(d.resolved_text.find("\ndump_step =\n"), std::string::npos) << d.resolved_text;
}

TEST(Deck, UnknownKeyNamesKeyLineAndValue) {
  const std::string e = deck_error(deck_with("d_model", "d_modle = 64"));
  expect_contains(e,
                  {"test.deck:4:", "[model] d_modle = 64", "unknown key model.d_modle", "d_model"});
}

TEST(Deck, UnknownSectionIsAnError) {
  const std::string e = deck_error(std::string(kDeck) + "\n[modle]\ntop_k = 2\n");
  expect_contains(e, {"test.deck:27:", "unknown key modle.top_k", "no section [modle]", "2"});
}

TEST(Deck, BadIntAndBadBoolNameTheValue) {
  expect_contains(deck_error(deck_with("d_model", "d_model = abc")),
                  {"test.deck:4:", "model.d_model", "'abc'", "int"});
  expect_contains(deck_error(deck_with("n_heads", "n_heads = 4\nqk_norm = maybe")),
                  {"test.deck:7:", "model.qk_norm", "'maybe'", "bool"});
  expect_contains(deck_error(deck_with("n_heads", "n_heads = 4\nqk_norm =")),
                  {"test.deck:7:", "model.qk_norm", "empty value"});
  expect_contains(deck_error(deck_with("lr", "lr = nan")), {"test.deck:16:", "finite"});
  expect_contains(deck_error(deck_with("max_steps", "max_steps = 10\nseed = -1")),
                  {"test.deck:14:", "train.seed", "'-1'"});
  expect_contains(deck_error(kDeck, {"--parallel.pp_layers=2,x"}),
                  {"command line: --parallel.pp_layers=2,x", "'x' is not an int"});
}

TEST(Deck, DuplicateKeyNamesBothLines) {
  const std::string e = deck_error(std::string(kDeck) + "[model]\nd_model = 128\n");
  expect_contains(
      e, {"test.deck:26:", "[model] d_model = 128", "duplicate key model.d_model", "line 4"});
}

TEST(Deck, SyntaxErrorsNameTheLine) {
  expect_contains(deck_error("x = 1\n"), {"test.deck:1:", "outside any [section]"});
  expect_contains(deck_error(deck_with("dtype", "dtype uint16")), {"test.deck:20:", "dtype"});
  expect_contains(deck_error(deck_with("[parallel]", "[parallel")), {"test.deck:22:", "section"});
}

TEST(Deck, MissingRequiredKeysAreListed) {
  const std::string e = deck_error(deck_with("d_model", "# no width"));
  expect_contains(e, {"test.deck: missing required key model.d_model ([model] d_model): hidden"});
  const std::string all = deck_error("");
  for (const char* key : {"model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads",
                          "model.ffn_hidden", "train.seq_len", "train.global_batch",
                          "train.micro_batch", "train.max_steps", "optimizer.lr", "data.paths"}) {
    expect_contains(all, {key});
  }
  EXPECT_EQ(all.find("model.n_kv_heads"), std::string::npos);
}

TEST(Deck, HeadsMustDivideWidth) {
  expect_contains(deck_error(deck_with("n_heads", "n_heads = 5")),
                  {"test.deck:6: [model] n_heads = 5:", "must divide model.d_model (64)"});
  expect_contains(deck_error(kDeck, {"--model.n_heads=5"}),
                  {"command line: --model.n_heads=5:", "must divide model.d_model (64)"});
  expect_contains(deck_error(kDeck, {"--model.n_kv_heads=3"}),
                  {"command line: --model.n_kv_heads=3:", "must divide model.n_heads (4)"});
  expect_contains(deck_error(kDeck, {"--model.d_model=48", "--model.n_heads=16"}),
                  {"command line: --model.n_heads=16:", "head dim", "48 / 16 = 3", "even"});
  expect_contains(deck_error(kDeck, {"--model.n_heads=64"}), {"head dim", "= 1", "even"});
}

TEST(Deck, GlobalBatchMustSplitOverReplicas) {
  const std::string e = deck_error(kDeck, {"--parallel.ep=4"});
  expect_contains(e, {"test.deck:12: [train] global_batch = 8:", "train.micro_batch", "parallel.dp",
                      "parallel.ep", "2 * 2 * 4 = 16"});
}

// parallel.dp = auto: read as unresolved (dp 0), then resolved against a rank count by reading
// the deck again, so the usual checks see the grid the launch runs.
TEST(Deck, DataParallelAuto) {
  const Config a = parse_deck(kDeck, "test.deck", {"--parallel.dp=auto"});
  EXPECT_TRUE(a.parallel.dp_auto);
  EXPECT_EQ(a.parallel.dp, 0);
  EXPECT_NE(a.resolved_text.find("dp = auto"), std::string::npos);
  expect_contains(deck_error(kDeck, {"--parallel.dp=aut"}),
                  {"--parallel.dp=aut", "parallel.dp", "expected an int or auto"});
  expect_contains(deck_error(kDeck, {"--parallel.dp=0"}), {"parallel.dp must be at least 1"});

  auto read = [](const std::vector<std::string>& over) {
    return parse_deck(kDeck, "test.deck", over);
  };
  std::string note;
  const Config eight = resolve_auto_dp(read, {"--parallel.dp=auto"}, 8, &note);
  EXPECT_EQ(eight.parallel.dp, 4);  // pp 2
  EXPECT_EQ(eight.parallel.world(), 8);
  EXPECT_TRUE(eight.parallel.dp_auto);
  EXPECT_NE(eight.resolved_text.find("dp = 4"), std::string::npos);
  expect_contains(note, {"parallel.dp = auto", "dp 4 for 8 rank(s)"});
  // A global batch of 8 does not split over 2 * 3 replicas' micro-batches.
  try {
    resolve_auto_dp(read, {"--parallel.dp=auto"}, 6, &note);
    ADD_FAILURE() << "6 ranks accepted";
  } catch (const Error& e) {
    expect_contains(e.what(), {"parallel.dp = auto chose dp 3 for 6 rank(s)", "train.global_batch",
                               "2 * 3 * 1 = 6"});
  }
  try {
    resolve_auto_dp(read, {"--parallel.dp=auto"}, 5, &note);
    ADD_FAILURE() << "5 ranks accepted";
  } catch (const Error& e) {
    expect_contains(e.what(),
                    {"parallel.dp = auto", "5 rank(s)", "parallel.pp * parallel.ep = 2 * 1"});
  }
  // A number stays the deck's, whatever the ranks (the grid then refuses a mismatch).
  const Config fixed = resolve_auto_dp(read, {}, 8, &note);
  EXPECT_EQ(fixed.parallel.dp, 2);
  EXPECT_FALSE(fixed.parallel.dp_auto);
  EXPECT_TRUE(note.empty());

  // A tool that only loads a checkpoint (launch_layout): auto where the launch fits the deck's
  // pp and ep, else a layout of its own; a grid key on its command line stands, error and all.
  auto read_auto = [](const std::vector<std::string>& over) {
    return parse_deck(deck_with("dp", "dp = auto"), "test.deck", over);
  };
  EXPECT_EQ(launch_layout(read_auto, {}, 8, &note).parallel.dp, 4);
  expect_contains(note, {"dp 4 for 8 rank(s)"});
  const Config one = launch_layout(read_auto, {}, 1, &note);
  EXPECT_EQ(one.parallel.world(), 1);
  expect_contains(note, {"pp 2 x dp auto x ep 1", "is not this launch's 1 rank(s)"});
  EXPECT_THROW(launch_layout(read_auto, {"--parallel.pp=2"}, 1, &note), Error);
}

TEST(Deck, BadStageLayout) {
  expect_contains(deck_error(kDeck, {"--parallel.pp_layers=1,1,2"}),
                  {"command line: --parallel.pp_layers=1,1,2:", "3 entries", "parallel.pp = 2"});
  expect_contains(deck_error(kDeck, {"--parallel.pp_layers=1,2"}),
                  {"parallel.pp_layers sums to 3", "model.n_layers is 4"});
  expect_contains(deck_error(kDeck, {"--parallel.pp_layers=4,0"}), {"stage 1 0 blocks"});
  expect_contains(deck_error(kDeck, {"--parallel.pp=8"}),
                  {"command line: --parallel.pp=8:", "exceeds model.n_layers (4)"});
  EXPECT_EQ(parse_deck(kDeck, "t", {"--parallel.pp_layers=3, 1"}).parallel.pp_layers,
            (std::vector<int>{3, 1}));
}

TEST(Deck, BadChoicesAndRanges) {
  expect_contains(deck_error(deck_with("n_heads", "n_heads = 4\nblock_norm = post")),
                  {"test.deck:7: [model] block_norm = post:", "reordered | pre", "'post'"});
  expect_contains(deck_error(kDeck, {"--optimizer.schedule=linear"}),
                  {"optimizer.schedule", "cosine | constant | wsd"});
  expect_contains(deck_error(kDeck, {"--parallel.schedule=zb"}), {"1f1b | gpipe"});
  expect_contains(deck_error(kDeck, {"--parallel.engram_shard=dp"}), {"none | ep | stage"});
  expect_contains(deck_error(deck_with("dtype", "dtype = int8")), {"test.deck:20:", "uint32"});
  expect_contains(deck_error(kDeck, {"--model.vocab_size=70000"}), {"65536", "uint32"});
  EXPECT_NO_THROW(parse_deck(kDeck, "t", {"--model.vocab_size=70000", "--data.dtype=uint32"}));
  expect_contains(deck_error(kDeck, {"--optimizer.schedule=wsd"}),
                  {"test.deck: [optimizer] decay_steps = 0 (default):", "[1, ", "= 10]"});
  expect_contains(deck_error(kDeck, {"--optimizer.warmup_steps=-1"}),
                  {"command line: --optimizer.warmup_steps=-1", ">= 0"});
  EXPECT_NO_THROW(parse_deck(kDeck, "t", {"--optimizer.warmup_steps=11"}));
  expect_contains(deck_error(kDeck, {"--optimizer.beta1=1"}), {"[0, 1)"});
  expect_contains(deck_error(kDeck, {"--train.seq_len=1"}), {"at least 2"});
  expect_contains(deck_error(kDeck, {"--checkpoint.keep=0"}), {"checkpoint.keep"});
  expect_contains(deck_error(kDeck, {"--output.dump_step=3,0"}), {"output.dump_step", "got 0"});
  expect_contains(deck_error(deck_with("paths", "paths =")), {"test.deck:19:", "data.paths"});
}

// Sequences (MODEL.md section 1): document masking resolves the end-of-document id; windows
// default to OLMo 3's pattern; bad values name their key.
TEST(Deck, DocumentMaskAndSlidingWindow) {
  const Config plain = parse_deck(kDeck, "t");
  EXPECT_EQ(plain.model.document_eod, -1);
  EXPECT_TRUE(plain.model.window_layers.empty());
  EXPECT_EQ(plain.model.window(0), 0);
  const Config c = parse_deck(kDeck, "t", {"--train.document_mask=true", "--model.sliding_window=8"});
  EXPECT_EQ(c.model.document_eod, 256);  // the byte-level tokenizer's
  EXPECT_EQ(c.model.window_layers, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(c.model.window(2), 8);
  EXPECT_EQ(c.model.window(3), 0);
  const Config r = parse_deck(c.resolved_text, "resolved");  // the resolved deck says the same
  EXPECT_EQ(r.model.window_layers, c.model.window_layers);
  EXPECT_EQ(r.model.document_eod, 256);
  EXPECT_EQ(parse_deck(kDeck, "t", {"--train.document_mask=true", "--data.eod_id=7"})
                .model.document_eod,
            7);
  expect_contains(deck_error(kDeck, {"--train.document_mask=true", "--data.tokenizer=external"}),
                  {"train.document_mask", "data.eod_id", "external"});
  expect_contains(deck_error(kDeck, {"--model.sliding_window=-4"}),
                  {"command line: --model.sliding_window=-4", "-4"});
  expect_contains(deck_error(kDeck, {"--model.sliding_window=4", "--model.window_layers=1,4"}),
                  {"model.window_layers", "entry 4", "[0, 4)"});
  expect_contains(deck_error(kDeck, {"--model.window_layers=1,1"}), {"model.window_layers"});
}

TEST(Deck, BadOverrides) {
  expect_contains(deck_error(kDeck, {"--model.n_head=2"}),
                  {"command line: --model.n_head=2:", "unknown key model.n_head"});
  expect_contains(deck_error(kDeck, {"--mtp.depth=1"}), {"no section [mtp]"});
  expect_contains(deck_error(kDeck, {"--train.max_steps"}),
                  {"command line: --train.max_steps", "--section.key=value"});
  expect_contains(deck_error(kDeck, {"--train.max_steps=ten"}),
                  {"command line: --train.max_steps=ten:", "'ten'", "train.max_steps", "int"});
}

TEST(Deck, HelpListsEverySectionAndKey) {
  const std::string help = deck_help();
  const std::pair<const char*, std::vector<const char*>> sections[] = {
      {"[model]",
       {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "norm_eps",
        "rope_theta", "qk_norm", "block_norm", "tie_embeddings", "init_std", "output_z_coef",
        "sliding_window", "window_layers"}},
      {"[train]",
       {"seq_len", "global_batch", "micro_batch", "max_steps", "seed", "eval_every",
        "eval_instances", "document_mask"}},
      {"[optimizer]",
       {"lr", "beta1", "beta2", "eps", "weight_decay", "clip", "schedule", "warmup_steps",
        "final_lr_ratio", "decay_steps"}},
      {"[data]", {"paths", "val_paths", "dtype"}},
      {"[parallel]",
       {"pp", "dp", "ep", "schedule", "pp_layers", "engram_shard", "watchdog_seconds",
        "spin_microseconds"}},
      {"[checkpoint]", {"dir", "every", "keep", "resume", "save_initial"}},
      {"[output]", {"dir", "log_every", "peak_flops", "dump_step"}}};
  for (const auto& [section, keys] : sections) {
    const auto begin = help.find(section);
    ASSERT_NE(begin, std::string::npos) << section;
    const std::string body = help.substr(begin, help.find("\n[", begin + 1) - begin);
    for (const char* key : keys) {
      EXPECT_NE(body.find("\n  " + std::string(key) + " "), std::string::npos)
          << section << " " << key << " missing from:\n"
          << body;
    }
  }
  expect_contains(help, {"required", "500000", "= n_heads", "reordered"});
}

// Each section comes from its owner: the nine sections in deck order, each with a check and
// keys of its own, no key declared twice, model checked first.
TEST(Deck, SectionsComeFromTheirOwners) {
  const std::vector<deck::DeckSection>& sections = deck::deck_sections();
  Config scratch;
  const deck::Schema schema(scratch);
  std::vector<std::string> names;
  std::set<int> orders;
  for (const deck::DeckSection& s : sections) {
    names.push_back(s.name);
    EXPECT_NE(s.check, nullptr) << s.name;
    int declared = 0;
    for (const deck::KeySpec& k : schema.keys()) declared += k.section == s.name;
    EXPECT_GE(declared, 1) << s.name;
    EXPECT_TRUE(orders.insert(s.check_order).second) << s.name << ": check order taken";
  }
  EXPECT_EQ(names, (std::vector<std::string>{"model", "moe", "engram", "train", "optimizer",
                                             "data", "parallel", "checkpoint", "output"}));
  EXPECT_EQ(sections.front().check_order, 0) << "model is checked first";
  std::set<std::string> keys;
  for (const deck::KeySpec& k : schema.keys())
    EXPECT_TRUE(keys.insert(k.name()).second) << k.name() << " declared twice";
  EXPECT_EQ(keys.size(), schema.keys().size());
}

TEST(Deck, ReadDeckFromFile) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("kmoe_test_deck_" + std::to_string(::getpid()) + ".deck");
  {
    std::ofstream out(path);
    out << deck_with("n_heads", "n_heads = 5");
  }
  std::string message;
  try {
    read_deck(path.string());
  } catch (const Error& e) {
    message = e.what();
  }
  expect_contains(message, {path.string().c_str(), ":6: [model] n_heads = 5:"});
  const Config c = read_deck(path.string(), {"--model.n_heads=4"});
  EXPECT_EQ(c.deck_path, path.string());
  EXPECT_EQ(c.model.n_heads, 4);
  std::filesystem::remove(path);

  message.clear();
  try {
    read_deck(path.string());
  } catch (const Error& e) {
    message = e.what();
  }
  expect_contains(message, {"cannot open", path.string().c_str()});
}

}  // namespace
TEST(Deck, EngramSection) {
  const Config none = parse_deck(kDeck, "test.deck");
  EXPECT_FALSE(none.engram.enabled());
  EXPECT_EQ(none.engram.init_std, none.model.init_std);
  const Config g =
      parse_deck(kDeck, "t",
                 {"--engram.layers=1", "--engram.heads=4", "--engram.embed_per_ngram=32",
                  "--engram.table_size=100,200", "--model.init_std=0.01"});
  EXPECT_TRUE(g.engram.enabled());
  EXPECT_EQ(g.engram.table_size, (std::vector<int>{100, 200}));
  EXPECT_EQ(g.engram.init_std, 0.01);
  expect_contains(deck_error(kDeck, {"--engram.layers=1", "--engram.embed_per_ngram=30"}),
                  {"engram.embed_per_ngram", "multiple of engram.heads (8)"});
  expect_contains(deck_error(kDeck, {"--engram.table_size=100"}),
                  {"engram.table_size needs one entry per order 2..3 (2 entries)"});
  expect_contains(deck_error(kDeck, {"--engram.gate=tanh"}), {"sigmoid | signed_sqrt"});
  expect_contains(deck_error(kDeck, {"--engram.max_ngram=1"}), {"at least 2"});
  // A block named twice would silently build another model.
  expect_contains(deck_error(kDeck, {"--engram.layers=1,1"}),
                  {"command line: --engram.layers=1,1", "engram.layers lists block 1 twice"});
  // Without Engram its pad id is not checked: a bad vocabulary is blamed on model.vocab_size.
  expect_contains(deck_error(kDeck, {"--model.vocab_size=0"}),
                  {"model.vocab_size must be positive"});
  EXPECT_EQ(deck_error(kDeck, {"--model.vocab_size=0"}).find("pad_id"), std::string::npos);
  expect_contains(deck_error(kDeck, {"--engram.layers=1", "--engram.pad_id=1000"}),
                  {"engram.pad_id must be a token id in [0, 1000)"});
  expect_contains(deck_error(kDeck, {"--parallel.spin_microseconds=-2"}),
                  {"parallel.spin_microseconds must be -1 (never sleep) or at least 0"});
}

TEST(Deck, MoeSection) {
  const Config dense = parse_deck(kDeck, "test.deck");
  EXPECT_FALSE(dense.moe.enabled());
  const Config moe =
      parse_deck(kDeck, "test.deck",
                 {"--moe.experts=8", "--moe.expert_hidden=32", "--moe.top_k=2",
                  "--moe.dense_layers=0", "--moe.shared_experts=1", "--moe.shared_hidden=16"});
  EXPECT_EQ(moe.moe.experts, 8);
  EXPECT_FALSE(moe.moe.is_moe_layer(0));
  EXPECT_TRUE(moe.moe.is_moe_layer(1));
  const Config only1 =
      parse_deck(kDeck, "t", {"--moe.experts=4", "--moe.expert_hidden=8", "--moe.layers=1"});
  EXPECT_TRUE(only1.moe.is_moe_layer(1));
  EXPECT_FALSE(only1.moe.is_moe_layer(0));
  expect_contains(deck_error(kDeck, {"--moe.experts=8"}),
                  {"moe.expert_hidden must be positive", "(default)"});
  expect_contains(deck_error(kDeck, {"--moe.experts=4", "--moe.expert_hidden=8", "--moe.top_k=5"}),
                  {"command line: --moe.top_k=5", "[1, moe.experts = 4]"});
  expect_contains(
      deck_error(kDeck, {"--moe.experts=4", "--moe.expert_hidden=8", "--moe.score=relu"}),
      {"softmax | sigmoid", "'relu'"});
  expect_contains(deck_error(kDeck, {"--moe.experts=4", "--moe.expert_hidden=8", "--moe.layers=7"}),
                  {"moe.layers entry 7"});
  expect_contains(
      deck_error(kDeck, {"--moe.experts=4", "--moe.expert_hidden=8", "--moe.layers=0,0"}),
      {"moe.layers lists block 0 twice"});
  expect_contains(
      deck_error(kDeck, {"--moe.experts=4", "--moe.expert_hidden=8", "--moe.dense_layers=1,1"}),
      {"moe.dense_layers lists block 1 twice"});
  expect_contains(
      deck_error(kDeck, {"--moe.experts=4", "--moe.expert_hidden=8", "--moe.shared_experts=1"}),
      {"moe.shared_hidden must be positive"});
}

}  // namespace kmoe
