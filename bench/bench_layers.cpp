// Times each layer of the dense model, forward and backward, on one micro-batch of the tiny
// config (or --d_model/--seq_len/... overrides), and prints time and GFLOP/s per op; the MoE
// layer takes --experts, --top_k and --expert_hidden. --attention_sweep 1 prints only the
// attention time per token (forward + backward) of the blocked kernel against the full-matrix
// one (the test oracle, tests/unit/full_attention) for plain causal, document-masked and
// windowed attention at T = 256, 1024 and 4096 (--sweep_tokens tokens per call, default 4096),
// and the share of the T x T scores the blocked kernel computed. --batch_threads N runs
// strided batches and per-expert GEMMs side by side on N host threads (gemm.hpp).
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/gemm.hpp"
#include "modules/attention/attention.hpp"
#include "modules/embedding/embedding.hpp"
#include "modules/engram/engram.hpp"
#include "modules/engram/engram_hash.hpp"
#include "modules/loss/lm_head.hpp"
#include "modules/mlp/swiglu.hpp"
#include "modules/model/stage.hpp"
#include "modules/moe/moe.hpp"
#include "modules/norm/rmsnorm.hpp"
#include "unit/full_attention.hpp"

using namespace kmoe;

namespace {

double time_it(int reps, const std::function<void()>& f) {
  f();
  Kokkos::fence();
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) f();
  Kokkos::fence();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

void report(const char* name, double s, double flops) {
  std::printf("  %-28s %9.3f ms  %8.1f GFLOP/s\n", name, 1e3 * s, flops / s / 1e9);
}

// Forward + backward time per token of the blocked (tiled) attention core, the fused core
// (train.attention = fused) and the full-matrix oracle on b sequences of T tokens, and the
// saved bytes per token of the two cores; masks: "causal", "documents" (a document ends every 256
// tokens or so), "window" (window 1024 below T, else T / 4).
void attention_sweep(const RunContext& ctx, ModelCfg m, int tokens, int reps) {
  std::printf("attention forward+backward per token (D %d, H %d, dh %d, %d tokens per call)\n",
              m.d_model, m.n_heads, m.head_dim(), tokens);
  std::printf("  %6s %-10s %12s %12s %8s %10s %10s %12s %12s\n", "T", "mask", "full us/tok",
              "blocked", "speedup", "scores", "fused", "tiled B/tok", "fused B/tok");
  for (int T : {256, 1024, 4096}) {
    const int b = std::max(1, tokens / T), N = b * T, D = m.d_model;
    for (const char* mask : {"causal", "documents", "window"}) {
      const std::string k = mask;
      const int window = k == "window" ? (T > 1024 ? 1024 : T / 4) : 0;
      TensorTable ta, tb, tc;
      RunContext fctx = ctx;
      fctx.attention = AttentionKernel::Fused;
      Attention blocked(ctx, m, "blocks.0.attn.", b, T, ta, window);
      Attention fused(fctx, m, "blocks.0.attn.", b, T, tc, window);
      oracle::FullMatrixAttention full(ctx, m, "blocks.0.attn.", b, T, tb, window);
      ta.allocate();
      tb.allocate();
      tc.allocate();
      ta.initialize(1);
      tb.initialize(1);
      tc.initialize(1);
      RopeTables rope(T, m.head_dim(), m.rope_theta);
      Workspace wa, wb, wc;
      std::vector<int> ids(N, 1);
      std::mt19937 gen(T);
      for (int i = 0; i < N; ++i)
        if (gen() % 256 == 0) ids[i] = 0;
      View1I ids_dev("ids", N), starts("starts", N);
      Kokkos::deep_copy(
          ids_dev, Kokkos::View<const int*, HostSpace, Kokkos::MemoryUnmanaged>(ids.data(), N));
      document_starts(ConstIVec(ids_dev.data(), N), b, T, 0, starts);
      std::vector<int> tile_start;  // the host's plan, as a training stage makes it
      document_tile_starts(ids.data(), b, T, 0, kAttentionPlanRows, tile_start);
      DocStarts docs;
      if (k == "documents") {
        docs = DocStarts{ConstIVec(starts.data(), N)};
        docs.tile_start = tile_start.data();
        docs.tile_rows = kAttentionPlanRows;
        docs.tiles = static_cast<int>(tile_start.size()) / b;
      }
      View1F x("x", std::int64_t(N) * D), y("y", std::int64_t(N) * D),
          dx("dx", std::int64_t(N) * D);
      Kokkos::deep_copy(x, 0.1f);
      Kokkos::deep_copy(dx, 0.01f);
      const double t_full = time_it(reps, [&] {
        full.forward(tb, rope, as_cmat(x.data(), N, D), as_mat(y.data(), N, D), wb, docs);
        full.backward(tb, rope, as_cmat(x.data(), N, D), as_cmat(dx.data(), N, D),
                      as_mat(y.data(), N, D), wb);
      });
      const double t_blocked = time_it(reps, [&] {
        blocked.forward(ta, rope, as_cmat(x.data(), N, D), as_mat(y.data(), N, D), wa, docs);
        blocked.backward(ta, rope, as_cmat(x.data(), N, D), as_cmat(dx.data(), N, D),
                         as_mat(y.data(), N, D), wa);
      });
      const double t_fused = time_it(reps, [&] {
        fused.forward(tc, rope, as_cmat(x.data(), N, D), as_mat(y.data(), N, D), wc, docs);
        fused.backward(tc, rope, as_cmat(x.data(), N, D), as_cmat(dx.data(), N, D),
                       as_mat(y.data(), N, D), wc);
      });
      const double computed = double(blocked.scores_computed()) / (double(b) * m.n_heads * T * T);
      const AttentionDims dims = Attention::core_dims(m, b, T, window);
      auto saved = [&](AttentionPath p) {
        return double(attention_core_sizes(p, dims, ctx.bf16()).saved.get()) / N;
      };
      std::printf("  %6d %-10s %12.2f %12.2f %7.2fx %9.1f%% %10.2f %12.0f %12.0f\n", T,
                  (k + (window ? " " + std::to_string(window) : "")).c_str(), 1e6 * t_full / N,
                  1e6 * t_blocked / N, t_full / t_blocked, 100.0 * computed, 1e6 * t_fused / N,
                  saved(AttentionPath::Tiled), saved(AttentionPath::Fused));
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  ModelCfg m;
  m.vocab_size = 320;
  m.d_model = 256;
  m.n_layers = 1;
  m.n_heads = 4;
  m.n_kv_heads = 4;
  m.ffn_hidden = 768;
  RunContext ctx;  // fp32; --batch_threads sets its host threads
  int b = 8, T = 256, reps = 5, sweep = 0, sweep_tokens = 4096;
  MoeCfg e;  // the MoE section's layer: 8 experts, top-2, Fe = F/2 unless overridden
  e.experts = 8;
  e.top_k = 2;
  e.expert_hidden = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::stoi(argv[i + 1]);
    if (k == "--d_model")
      m.d_model = v;
    else if (k == "--n_heads")
      m.n_heads = m.n_kv_heads = v;
    else if (k == "--ffn_hidden")
      m.ffn_hidden = v;
    else if (k == "--seq_len")
      T = v;
    else if (k == "--micro_batch")
      b = v;
    else if (k == "--reps")
      reps = v;
    else if (k == "--experts")
      e.experts = v;
    else if (k == "--top_k")
      e.top_k = v;
    else if (k == "--expert_hidden")
      e.expert_hidden = v;
    else if (k == "--attention_sweep")
      sweep = v;
    else if (k == "--sweep_tokens")
      sweep_tokens = v;
    else if (k == "--batch_threads")  // host threads for side-by-side products (gemm.hpp)
      ctx = make_run_context(Precision::Fp32, v);
    else
      throw std::invalid_argument("bench_layers: unknown option " + k);
  }
  if (e.expert_hidden == 0) e.expert_hidden = m.ffn_hidden / 2;
  if (sweep) {
    attention_sweep(ctx, m, sweep_tokens, reps);
    return 0;
  }
  const int N = b * T, D = m.d_model, F = m.ffn_hidden, V = m.vocab_size;
  TensorTable table;
  RopeTables rope(T, m.head_dim(), m.rope_theta);
  Attention attn(ctx, m, "blocks.0.attn.", b, T, table);
  SwigluMlp mlp(ctx, "blocks.0.mlp.", m, F, N, table);
  const int embed = table.add(Embedding::weight_spec(V, D, 0.02));
  LmHead head(ctx, m, N, embed, table);
  table.allocate();
  table.initialize(1);
  Workspace ws;  // the layers' temporaries, taken as a training run takes them
  View2F x("x", N, D), y("y", N, D), dx("dx", N, D);
  {  // realistic magnitudes: unit-variance activations, small gradients
    auto hx = Kokkos::create_mirror_view(x);
    auto hd = Kokkos::create_mirror_view(dx);
    std::mt19937 gen(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int i = 0; i < N; ++i)
      for (int d = 0; d < D; ++d) {
        hx(i, d) = nd(gen);
        hd(i, d) = 1e-4f * nd(gen);
      }
    Kokkos::deep_copy(x, hx);
    Kokkos::deep_copy(dx, hd);
  }
  View1I tokens("tokens", N);
  View1F rstd("rstd", N);
  View1F g("g", D);
  Kokkos::deep_copy(g, 1.0f);

  const double attn_proj = 2.0 * N * D * (4.0 * D),
               attn_core = 2.0 * 2.0 * b * m.n_heads * T * T * m.head_dim();
  const double mlp_f = 2.0 * N * D * 3.0 * F, head_f = 2.0 * N * D * V;
  std::printf("bench_layers: N = %d tokens (b %d x T %d), D %d, H %d, F %d, V %d\n", N, b, T, D,
              m.n_heads, F, V);
  report("attention forward",
         time_it(reps, [&] { attn.forward(table, rope, as_cmat(x), as_mat(y), ws); }),
         attn_proj + attn_core);
  report("attention backward",
         time_it(reps, [&] { attn.backward(table, rope, as_cmat(x), as_cmat(dx), as_mat(y), ws); }),
         2 * (attn_proj + attn_core));
  report("mlp forward", time_it(reps, [&] { mlp.forward(table, as_cmat(x), as_mat(y), ws); }),
         mlp_f);
  report("mlp backward",
         time_it(reps, [&] { mlp.backward(table, as_cmat(x), as_cmat(dx), as_mat(y), ws); }),
         2 * mlp_f);
  {
    View2F up("up", N, 2 * F), act("act", N, F), dup("dup", N, 2 * F);
    Kokkos::deep_copy(up, 0.3f);
    report("swiglu activate", time_it(reps, [&] { swiglu_activate(as_cmat(up), as_mat(act)); }), 0);
    report("swiglu activate backward",
           time_it(reps, [&] { swiglu_activate_backward(as_cmat(up), as_cmat(act), as_mat(dup)); }),
           0);
  }
  report("rmsnorm forward",
         time_it(reps,
                 [&] {
                   rmsnorm_forward(as_cmat(x), ConstVec(g.data(), D), 1e-6f, ConstMat(), as_mat(y),
                                   Vec(rstd.data(), N));
                 }),
         0);
  // The head's loss runs in chunks and, with a gradient, takes both of d logits' products at
  // once: forward is the head's three products here, backward the final norm's alone.
  report(
      "head + loss forward and products' backward",
      time_it(reps,
              [&] { head.forward(table, as_cmat(x), ConstIVec(tokens.data(), N), T, 1.0f, ws); }),
      3 * head_f);
  report("head backward (final norm)",
         time_it(reps, [&] { head.backward(table, as_cmat(x), as_mat(y)); }), 0);
  {
    // MoE layer (--experts, --top_k, --expert_hidden) against the dense MLP, and the share of
    // MoE time outside the expert GEMMs (routing, permutation, combine): the MoE's nine GEMMs
    // per expert, on the measured row counts, are timed alone.
    TensorTable t3;
    StepStats stats;  // the statistics a training run records
    MoeLayer moe(ctx, m, e, "blocks.0.moe.", N, t3, nullptr, nullptr, &stats);
    t3.allocate();
    t3.initialize(2);
    const double t_moe = time_it(reps, [&] {
      moe.forward(t3, as_cmat(x), as_mat(y), ws);
      moe.backward(t3, as_cmat(x), as_cmat(dx), as_mat(y), ws, 1.0f);
    });
    const MoeStats st = moe.report();
    // The same layer with grouped expert GEMMs (row counts read on the device).
    MoeCfg eg = e;
    eg.expert_gemm = ExpertGemm::Grouped;
    TensorTable t3g;
    MoeLayer moe_g(ctx, m, eg, "blocks.0.moe.", N, t3g, nullptr, nullptr, &stats);
    t3g.allocate();
    t3g.initialize(2);
    const double t_grouped = time_it(reps, [&] {
      moe_g.forward(t3g, as_cmat(x), as_mat(y), ws);
      moe_g.backward(t3g, as_cmat(x), as_cmat(dx), as_mat(y), ws, 1.0f);
    });
    const int Fe = e.expert_hidden;
    View2F rows("rows", N * e.top_k, D), h1("h1", N * e.top_k, Fe), h2("h2", N * e.top_k, Fe);
    View2F w13("w13", Fe, D), w2("w2", D, Fe);
    const double t_gemm = time_it(reps, [&] {
      for (int ex = 0; ex < e.experts; ++ex) {
        const int n = st.load[ex];
        auto in = as_mat(rows.data(), n, D);
        auto a = as_mat(h1.data(), n, Fe), b = as_mat(h2.data(), n, Fe);
        gemm(ctx, Trans::N, Trans::T, 1.0f, as_cmat(in), as_cmat(w13), 0.0f, a);          // up1
        gemm(ctx, Trans::N, Trans::T, 1.0f, as_cmat(in), as_cmat(w13), 0.0f, b);          // up3
        gemm(ctx, Trans::N, Trans::T, 1.0f, as_cmat(a), as_cmat(w2), 0.0f, in);           // down
        gemm(ctx, Trans::N, Trans::N, 1.0f, as_cmat(in), as_cmat(w2), 0.0f, a);           // d act
        gemm(ctx, Trans::T, Trans::N, 1.0f, as_cmat(in), as_cmat(b), 1.0f, as_mat(w2));   // d w2
        gemm(ctx, Trans::T, Trans::N, 1.0f, as_cmat(a), as_cmat(in), 1.0f, as_mat(w13));  // d w1
        gemm(ctx, Trans::T, Trans::N, 1.0f, as_cmat(b), as_cmat(in), 1.0f, as_mat(w13));  // d w3
        gemm(ctx, Trans::N, Trans::N, 1.0f, as_cmat(a), as_cmat(w13), 0.0f, in);  // d in (w1)
        gemm(ctx, Trans::N, Trans::N, 1.0f, as_cmat(b), as_cmat(w13), 1.0f, in);  // d in (w3)
      }
    });
    const double t_dense = time_it(reps, [&] {
      mlp.forward(table, as_cmat(x), as_mat(y), ws);
      mlp.backward(table, as_cmat(x), as_cmat(dx), as_mat(y), ws);
    });
    std::printf("  moe layer fwd+bwd (E %d, k %d, Fe %d) %9.3f ms = %.2f us/token\n", e.experts,
                e.top_k, Fe, 1e3 * t_moe, 1e6 * t_moe / N);
    std::printf("  the same, grouped expert GEMMs        %9.3f ms = %.2f us/token\n",
                1e3 * t_grouped, 1e6 * t_grouped / N);
    std::printf("  dense mlp fwd+bwd (F %d)              %9.3f ms = %.2f us/token\n", F,
                1e3 * t_dense, 1e6 * t_dense / N);
    std::printf("  moe time outside the expert GEMMs: %.0f%% (routing, permutation, combine)%s\n",
                100.0 * std::max(0.0, 1.0 - t_gemm / t_moe),
                expert_threads(ctx, e, m.d_model, e.experts, false) > 1
                    ? "; the GEMMs alone run one after the other, the layer's side by side"
                    : "");
  }
  {
    // Engram layer of inputs/tiny_engram.deck (N 3, K 8, De 512, table_size 5 V per order):
    // time per token of the whole layer and the lookup bandwidth (bytes of table rows
    // gathered per second by steps 1-6: hashing, lookup counts and the gather).
    EngramCfg g;
    g.layers = {0};
    auto plans = engram_hash_plans(g, V);
    plans[0].pad_c = g.pad_id;
    TensorTable t4;
    StepStats stats;  // the lookup counts and gate metric a training run keeps
    EngramLayer eng(ctx, m, g, plans[0], "blocks.0.engram.", N, T, t4, EngramSharding(), &stats);
    t4.allocate();
    t4.initialize(3);
    View1I ids("ids", N);
    {
      auto h = Kokkos::create_mirror_view(ids);
      std::mt19937 gen(7);
      for (int i = 0; i < N; ++i) h(i) = gen() % V;
      Kokkos::deep_copy(ids, h);
    }
    const ConstIVec tok(ids.data(), N);
    const std::int64_t rows = plans[0].rows;
    const double t_look = time_it(reps, [&] { eng.lookup(t4, tok); });
    const double t_fwd = time_it(reps, [&] { eng.forward(t4, as_cmat(x), tok, as_mat(y)); });
    const double t_fb = time_it(reps, [&] {
      eng.forward(t4, as_cmat(x), tok, as_mat(y));
      eng.backward(t4, as_cmat(x), as_cmat(dx), as_mat(y), ws);
    });
    const double gathered = double(N) * eng.memory_width() * sizeof(float);
    std::printf("  engram layer (N %d, K %d, De %d, d_mem %d, %lld rows = %.1f MiB table)\n",
                g.max_ngram, g.heads, g.embed_per_ngram, eng.memory_width(),
                static_cast<long long>(rows),
                rows * (g.embed_per_ngram / g.heads) * 4.0 / (1 << 20));
    std::printf(
        "    lookup (hash + gather)   %9.3f ms = %.2f us/token, %.2f GB/s of rows gathered\n",
        1e3 * t_look, 1e6 * t_look / N, gathered / t_look / 1e9);
    std::printf("    forward                  %9.3f ms = %.2f us/token\n", 1e3 * t_fwd,
                1e6 * t_fwd / N);
    std::printf(
        "    forward + backward       %9.3f ms = %.2f us/token (projections %.1f GFLOP/s)\n",
        1e3 * t_fb, 1e6 * t_fb / N, 3 * 2.0 * 2.0 * N * D * eng.memory_width() / t_fb / 1e9);
  }
  {
    ModelCfg full = m;
    full.n_layers = 4;
    TensorTable t2;
    Stage stage(ctx, full, MoeCfg(), b, T, t2);
    t2.allocate();
    t2.initialize(1);
    std::vector<std::int32_t> ids(N);
    std::mt19937 gen(1);
    for (auto& id : ids) id = gen() % V;
    report("stage forward (4 layers)",
           time_it(reps, [&] { stage.forward(t2, ids.data(), b, 1.0f / N); }), 0);
    report("stage forward+backward",
           time_it(reps,
                   [&] {
                     stage.forward(t2, ids.data(), b, 1.0f / N);
                     stage.backward(t2);
                   }),
           0);
  }
  return 0;
}
