#include "modules/engram/engram_keys.hpp"

#include <cstdint>

#include "core/error.hpp"

namespace kmoe {

namespace {

void check_engram(const EngramCfg& g, const ModelCfg& m, const deck::Locate& locate) {
  for (int l : g.layers)
    KMOE_DECK_REQUIRE(
        l >= 0 && l < m.n_layers, "engram.layers",
        "engram.layers entry " << l << " is not a block in [0, " << m.n_layers << ")");
  deck::check_distinct(g.layers, "engram.layers", locate);
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
  KMOE_DECK_REQUIRE(g.offload == EngramOffload::None || g.enabled(), "engram.offload",
                    "engram.offload = host keeps the Engram tables in host memory, but "
                    "engram.layers is empty: there are no tables");
  KMOE_DECK_REQUIRE(g.init_std > 0, "engram.init_std",
                    "engram.init_std = " << g.init_std << ": must be positive");
}

void declare_engram(deck::Schema& s, Config& c) {
  s.key(c.engram.layers, "layers", std::vector<int>{},
        "Engram blocks, comma-separated; empty = none");
  s.key(c.engram.max_ngram, "max_ngram", 3, "largest n-gram order N (orders 2..N)");
  s.key(c.engram.heads, "heads", 8, "hash heads K per order");
  s.key(c.engram.embed_per_ngram, "embed_per_ngram", 512,
        "memory width De per order (multiple of heads)");
  s.key(c.engram.table_size, "table_size", std::vector<int>{},
        "base rows per order n = 2..N, comma-separated; empty = 5 * V' each");
  s.key(c.engram.seed, "seed", std::uint64_t{0}, "seed of the hash multipliers");
  s.key(c.engram.kernel, "kernel", 4, "taps of the causal dilated depthwise convolution");
  s.key(c.engram.pad_id, "pad_id", 0, "token id that pads n-grams before the sequence start");
  s.key(c.engram.gate, "gate", EngramGate::Sigmoid, "gate: sigmoid | signed_sqrt");
  s.key(c.engram.lr_mult, "lr_mult", 5.0, "learning-rate multiplier of the tables");
  s.key(c.engram.compression_map, "compression_map", "",
        "file of V canonical token ids (uint32 or .npy); empty = identity");
  s.key(c.engram.offload, "offload", EngramOffload::None,
        "where the tables and their moments live: none (device) | host");
  s.derived<double>(
      c.engram.init_std, "init_std", "model.init_std", [&c] { return c.model.init_std; },
      "std of the table and projection init");
}

}  // namespace

deck::DeckSection engram_deck_section() {
  return {"engram", "Engram conditional memory (MODEL.md section 4); no layers = none",
          declare_engram,
          [](const Config& c, const deck::Locate& l) { check_engram(c.engram, c.model, l); }, 1};
}

}  // namespace kmoe
