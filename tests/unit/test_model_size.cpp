// model_size() and the rank memory estimate against a built Stage, the bytes per step, and the
// parameter names, shapes and weight-decay groups a Stage declares.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensor_table.hpp"
#include "io/deck.hpp"
#include "modules/model/model_size.hpp"
#include "modules/model/stage.hpp"
#include "train/memory_check.hpp"

#include "train_units_util.hpp"

namespace kmoe {
namespace {

using namespace unit;

// ---------------------------------------------------------------------------------------------
// 5. model_size() against the TensorTable of a built Stage.

ModelCfg small_model() {
  ModelCfg m;
  m.vocab_size = 64;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 4;
  m.ffn_hidden = 48;
  return m;
}

struct Variant {
  const char* label;
  bool tie;
  bool qk_norm;
  int kv_heads;
  const char* block_norm;
};

TEST(ModelSize, MatchesBuiltStage) {
  const int T = 16, max_seqs = 2;
  const Variant variants[] = {
      {"untied qk_norm MHA reordered", false, true, 4, "reordered"},
      {"tied qk_norm MHA reordered", true, true, 4, "reordered"},
      {"untied no qk_norm MHA reordered", false, false, 4, "reordered"},
      {"untied qk_norm GQA2 reordered", false, true, 2, "reordered"},
      {"tied qk_norm MQA pre", true, true, 1, "pre"},
      {"untied no qk_norm GQA2 pre", false, false, 2, "pre"},
      {"tied no qk_norm GQA2 pre", true, false, 2, "pre"},
  };
  for (const auto& var : variants) {
    SCOPED_TRACE(var.label);
    ModelCfg m = small_model();
    m.tie_embeddings = var.tie;
    m.qk_norm = var.qk_norm;
    m.n_kv_heads = var.kv_heads;
    m.block_norm = choice_from<BlockNorm>(var.block_norm);
    TensorTable table;
    Stage stage(RunContext(), m, MoeCfg(), max_seqs, T, table);
    const ModelSize s = model_size(m, MoeCfg(), max_seqs, T);
    const std::int64_t V = m.vocab_size, D = m.d_model, L = m.n_layers;
    EXPECT_EQ(s.total_params, table.total_elements());
    EXPECT_EQ(s.active_params, s.total_params);  // dense
    EXPECT_EQ(s.embedding_params, V * D);
    const double expected_flops =
        6.0 * double(s.total_params - (var.tie ? 0 : V * D)) + 6.0 * double(L * D * T);
    EXPECT_DOUBLE_EQ(s.flops_per_token, expected_flops);
    EXPECT_EQ(s.state_bytes, 16 * s.total_params);
    EXPECT_GT(s.activation_bytes, 0);
  }
}

// With MoE layers (block 0 dense, block 1 MoE with a shared expert): total = the table; active
// counts k of the E experts.
TEST(ModelSize, MoeCountsMatchBuiltStage) {
  ModelCfg m = small_model();
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 8;
  e.dense_layers = {0};
  e.shared_experts = 1;
  e.shared_hidden = 6;
  TensorTable table;
  Stage stage(RunContext(), m, e, 2, 16, table);
  const ModelSize s = model_size(m, e, 2, 16);
  const std::int64_t D = m.d_model;
  EXPECT_EQ(s.total_params, table.total_elements());
  EXPECT_EQ(s.total_params - s.active_params, 3 * (e.experts - e.top_k) * e.expert_hidden * D);
  EXPECT_GE(table.find("blocks.1.moe.experts.w1"), 0);
  EXPECT_GE(table.find("blocks.1.moe.shared.w2"), 0);
  EXPECT_GE(table.find("blocks.0.mlp.w1"), 0);
  EXPECT_LT(table.find("blocks.1.mlp.w1"), 0);

  // With Engram at both blocks: the tables and projections count in the total.
  EngramCfg g;
  g.layers = {0, 1};
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {50, 60};
  TensorTable t2;
  Stage s2(RunContext(), m, e, 2, 16, t2, g);
  EXPECT_EQ(model_size(m, e, 2, 16, g).total_params, t2.total_elements());
  EXPECT_GE(t2.find("blocks.0.engram.table"), 0);
}

// A rank's share (the memory check's estimate) holds exactly the tensors its Stage declares,
// for every pipeline stage plan, tied or not, with and without aux-free router biases.
TEST(ModelSize, RankShareMatchesTheStagesTable) {
  ModelCfg m = small_model();
  m.n_layers = 3;
  MoeCfg e;
  e.experts = 4;
  e.top_k = 2;
  e.expert_hidden = 8;
  e.dense_layers = {0};
  EngramCfg g;
  g.layers = {1};
  g.heads = 2;
  g.embed_per_ngram = 8;
  g.table_size = {50, 60};
  for (bool tie : {false, true})
    for (double bias : {0.0, 0.01})
      for (const auto& [first, last] : {std::pair{0, 3}, std::pair{0, 1}, std::pair{1, 3}}) {
        SCOPED_TRACE(std::to_string(first) + ".." + std::to_string(last) + (tie ? " tied" : "") +
                     (bias > 0 ? " bias" : ""));
        m.tie_embeddings = tie;
        e.bias_update_rate = bias;
        StagePlan plan;
        plan.first_block = first;
        plan.last_block = last;
        plan.embed = first == 0;
        plan.head = last == 3;
        TensorTable table;
        Stage stage(RunContext(), m, e, 2, 16, table, g, plan);
        RankShare r;
        r.first_block = first;
        r.last_block = last;
        r.embed = plan.embed;
        r.head = plan.head;
        const RankMemory mem = rank_memory(m, e, g, 2, 16, r);
        EXPECT_EQ(mem.elements, table.total_elements());
        EXPECT_EQ(mem.state_bytes, 16 * mem.elements);
        EXPECT_GT(mem.activation_bytes, 0);
        // The tensors only products read: the dense ones counted apart from the experts.
        std::int64_t gemm_only = 0;
        for (const TensorEntry& en : table.entries()) gemm_only += en.spec.gemm_only ? en.size : 0;
        EXPECT_EQ(mem.gemm_elements + mem.expert_elements, gemm_only);
        EXPECT_EQ(mem.copy_elements, 0);
        // bf16 with sharded state on 4 dense / 2 expert replicas: the copies at 2 bytes, their
        // fp32 master rows a quarter (dense) and a half (experts).
        RankShare sh = r;
        sh.precision = Precision::Bf16;
        sh.dense_replicas = 4;
        sh.expert_replicas = 2;
        const RankMemory c = rank_memory(m, e, g, 2, 16, sh);
        EXPECT_EQ(c.copy_elements, mem.gemm_elements + mem.expert_elements);
        const std::int64_t masters = (mem.gemm_elements + 3) / 4 + (mem.expert_elements + 1) / 2;
        EXPECT_EQ(c.param_bytes, 4 * (c.elements - c.copy_elements) + 2 * c.copy_elements +
                                     4 * masters);
        sh.precision = Precision::Fp32;  // fp32 runs compute from the fp32 values: no copies
        EXPECT_EQ(rank_memory(m, e, g, 2, 16, sh).param_bytes, 4 * mem.elements);
        // bf16 without sharded state: the same copies beside every fp32 value.
        RankShare whole = r;
        whole.precision = Precision::Bf16;
        const RankMemory u = rank_memory(m, e, g, 2, 16, whole);
        EXPECT_EQ(u.copy_elements, mem.gemm_elements + mem.expert_elements);
        EXPECT_EQ(u.param_bytes, 4 * u.elements + 2 * u.copy_elements);
        r.in_flight = 3;  // more micro-batches in flight keep more activations
        EXPECT_GT(rank_memory(m, e, g, 2, 16, r).activation_bytes, mem.activation_bytes);
        r.precision = Precision::Bf16;  // bf16 keeps some of them at half the bytes
        const RankMemory half = rank_memory(m, e, g, 2, 16, r);
        r.precision = Precision::Fp32;
        const RankMemory full = rank_memory(m, e, g, 2, 16, r);
        // ... and its product weights' compute copies beside the fp32 state.
        EXPECT_EQ(half.state_bytes, full.state_bytes + 2 * half.copy_elements);
        EXPECT_GT(half.copy_elements, 0);
        EXPECT_LT(half.activation_bytes, full.activation_bytes);
        EXPECT_GT(2 * half.activation_bytes, full.activation_bytes);
      }
}

// The dry run's bytes sent per step (train/memory_check.hpp step_traffic), from its formulas.
TEST(StepTraffic, FollowsTheGridAndThePrecision) {
  const char* deck = R"([model]
vocab_size = 320
d_model = 64
n_layers = 4
n_heads = 4
ffn_hidden = 128
[moe]
experts = 4
top_k = 2
expert_hidden = 32
[train]
seq_len = 32
micro_batch = 2
global_batch = 16
max_steps = 1
[optimizer]
lr = 1e-3
[data]
paths = a.bin
)";
  auto cfg = [&](const std::vector<std::string>& o) { return parse_deck(deck, "t.deck", o); };
  EXPECT_EQ(step_traffic(cfg({}), 0).total(), 0.0);  // one rank sends nothing
  // dp 2: every gradient once around the ring (2 (2 - 1) / 2 = one buffer), 4 bytes each.
  const Config dp2 = cfg({"--parallel.dp=2"});
  const RankMemory m =
      rank_memory(dp2.model, dp2.moe, dp2.engram, 2, 32, rank_share(dp2, 0, 1));
  const StepTraffic a = step_traffic(dp2, 0);
  EXPECT_DOUBLE_EQ(a.stage_grads + a.dp_grads, 4.0 * m.elements);
  EXPECT_GT(a.dp_grads, 0.0);  // the experts
  EXPECT_EQ(a.all_to_all, 0.0);
  EXPECT_EQ(a.pipeline, 0.0);
  // bf16 with sharded state: the reduce-scatter at 4 bytes, the all-gather of the tensors only
  // products read at 2 (their bf16 copies): a quarter less for those tensors.
  const Config sb = cfg({"--parallel.dp=2", "--optimizer.shard=replicas", "--train.precision=bf16"});
  const RankMemory ms = rank_memory(sb.model, sb.moe, sb.engram, 2, 32, rank_share(sb, 0, 1));
  const StepTraffic c = step_traffic(sb, 0);
  EXPECT_DOUBLE_EQ(c.stage_grads + c.dp_grads, 4.0 * m.elements - 1.0 * ms.copy_elements);
  EXPECT_EQ(ms.copy_elements, ms.gemm_elements + ms.expert_elements);
  EXPECT_EQ(step_traffic(cfg({"--parallel.dp=2", "--optimizer.shard=replicas"}), 0).total(),
            a.total());  // fp32: the gather moves what the all-reduce's second half did
  // ep 2: 4 micro-batches per replica x 4 MoE layers x 64 of the 128 rows leaving x D 64, out
  // and back, forward and backward, 4 bytes each; bf16 halves the rows and output gradients.
  const StepTraffic f = step_traffic(cfg({"--parallel.ep=2"}), 0);
  const StepTraffic b = step_traffic(cfg({"--parallel.ep=2", "--train.precision=bf16"}), 0);
  EXPECT_DOUBLE_EQ(f.all_to_all, 4.0 * 4 * 64 * 64 * 16);
  EXPECT_DOUBLE_EQ(b.all_to_all, 0.75 * f.all_to_all);
  EXPECT_EQ(f.dp_grads, 0.0);  // dp 1: experts are not reduced
  // pp 2: 8 micro-batches, each stage sending one boundary (64 tokens x 64 x 4 bytes) each way
  // it has a neighbour.
  const Config pp2 = cfg({"--parallel.pp=2"});
  EXPECT_DOUBLE_EQ(step_traffic(pp2, 0).pipeline, 8.0 * 64 * 64 * 4);
  EXPECT_DOUBLE_EQ(step_traffic(pp2, 1).pipeline, 8.0 * 64 * 64 * 4);
  EXPECT_EQ(step_traffic(pp2, 0).stage_grads, 0.0);
}

// Sizes beyond 64 bits are an error naming the keys, not a negative estimate.
TEST(ModelSize, OverflowIsAnErrorNamingTheKeys) {
  ModelCfg m = small_model();
  m.d_model = 1000000000;
  m.n_heads = 1;
  m.n_kv_heads = 1;
  try {
    model_size(m, MoeCfg(), 2, 16);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("overflow 64-bit"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.d_model"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rank_memory(m, MoeCfg(), EngramCfg(), 2, 16, RankShare{0, 2}), Error);
}

// ---------------------------------------------------------------------------------------------
// 6. MODEL.md section 5 names and shapes, section 6 decay groups, section 7 init kinds.

struct Expected {
  std::vector<std::int64_t> shape;
  bool decay;
  InitKind init;
};

std::map<std::string, Expected> expected_tensors(const ModelCfg& m) {
  const std::int64_t V = m.vocab_size, D = m.d_model, F = m.ffn_hidden, dh = m.head_dim();
  const std::int64_t qd = m.n_heads * dh, kd = m.n_kv_heads * dh;
  std::map<std::string, Expected> e;
  e["embed.weight"] = {{V, D}, false, InitKind::Normal};
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    e[b + "attn.wq"] = {{qd, D}, true, InitKind::Normal};
    e[b + "attn.wk"] = {{kd, D}, true, InitKind::Normal};
    e[b + "attn.wv"] = {{kd, D}, true, InitKind::Normal};
    e[b + "attn.wo"] = {{D, qd}, true, InitKind::Normal};
    if (m.qk_norm) {
      e[b + "attn.q_norm.weight"] = {{qd}, false, InitKind::Ones};
      e[b + "attn.k_norm.weight"] = {{kd}, false, InitKind::Ones};
    }
    e[b + "attn_norm.weight"] = {{D}, false, InitKind::Ones};
    e[b + "ffn_norm.weight"] = {{D}, false, InitKind::Ones};
    e[b + "mlp.w1"] = {{F, D}, true, InitKind::Normal};
    e[b + "mlp.w3"] = {{F, D}, true, InitKind::Normal};
    e[b + "mlp.w2"] = {{D, F}, true, InitKind::Normal};
  }
  e["final_norm.weight"] = {{D}, false, InitKind::Ones};
  if (!m.tie_embeddings) e["lm_head.weight"] = {{V, D}, true, InitKind::Normal};
  return e;
}

void check_names_and_shapes(const ModelCfg& m) {
  TensorTable table;
  Stage stage(RunContext(), m, MoeCfg(), 2, 16, table);
  const auto expected = expected_tensors(m);
  std::map<std::string, int> seen;
  for (int i = 0; i < table.size(); ++i) {
    const auto& s = table.entry(i).spec;
    seen[s.name] = i;
    const auto it = expected.find(s.name);
    if (it == expected.end()) {
      ADD_FAILURE() << "unexpected tensor " << s.name;
      continue;
    }
    EXPECT_EQ(s.shape, it->second.shape) << s.name;
    EXPECT_EQ(s.weight_decay, it->second.decay) << s.name;
    EXPECT_EQ(s.init == InitKind::Ones, it->second.init == InitKind::Ones) << s.name;
    EXPECT_EQ(s.init == InitKind::Normal, it->second.init == InitKind::Normal) << s.name;
    if (s.init == InitKind::Normal) {
      EXPECT_DOUBLE_EQ(s.init_std, m.init_std) << s.name;
    }
    EXPECT_DOUBLE_EQ(s.lr_mult, 1.0) << s.name;
  }
  EXPECT_EQ(table.size(), static_cast<int>(expected.size()));  // no duplicates either
  for (const auto& kv : expected) EXPECT_EQ(seen.count(kv.first), 1u) << "missing " << kv.first;
  EXPECT_EQ(table.find("lm_head.weight") >= 0, !m.tie_embeddings);

  // Fused GEMMs rely on wq|wk|wv and w1|w3 being adjacent in the flat buffers.
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    auto start_of = [&](const std::string& n) -> std::int64_t {
      const int i = table.find(n);
      return i < 0 ? -1 : table.entry(i).offset;
    };
    auto end_of = [&](const std::string& n) -> std::int64_t {
      const int i = table.find(n);
      return i < 0 ? -2 : table.entry(i).offset + table.entry(i).size;
    };
    EXPECT_EQ(end_of(b + "attn.wq"), start_of(b + "attn.wk")) << b;
    EXPECT_EQ(end_of(b + "attn.wk"), start_of(b + "attn.wv")) << b;
    EXPECT_EQ(end_of(b + "mlp.w1"), start_of(b + "mlp.w3")) << b;
  }
}

TEST(StageTensors, NamesShapesAndDecayUntiedQkNorm) {
  ModelCfg m = small_model();
  m.n_kv_heads = 2;  // GQA, so wk/wv and k_norm differ from wq/q_norm
  m.qk_norm = true;
  m.tie_embeddings = false;
  check_names_and_shapes(m);
}

TEST(StageTensors, TiedHasNoLmHead) {
  ModelCfg m = small_model();
  m.n_kv_heads = 2;
  m.tie_embeddings = true;
  check_names_and_shapes(m);
}

TEST(StageTensors, NoQkNormPreNorm) {
  ModelCfg m = small_model();
  m.qk_norm = false;
  m.block_norm = BlockNorm::Pre;
  m.init_std = 0.05;
  check_names_and_shapes(m);
}

}  // namespace
}  // namespace kmoe
