#include "modules/moe/moe.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "core/segments.hpp"

namespace kmoe {
namespace {

// A float's bits as an unsigned integer in the float's order (not NaN).
KOKKOS_INLINE_FUNCTION std::uint32_t ordered_bits(float f) {
  std::uint32_t u = 0;
  memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace

namespace {
// The sizes the MoE layer's workspace use depends on (bytes, each take rounded).
struct MoeWorkspace {
  std::int64_t staging, hidden, rows_fp32, wire_in;
  bool wire;
  MoeWorkspace(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e, std::int64_t N,
               int ep) {
    const bool bf16 = ctx.bf16();
    auto r = [](std::int64_t bytes) { return Workspace::rounded(bytes); };
    const std::int64_t D = m.d_model, Fe = e.expert_hidden, S = N * e.top_k;
    const int El = e.experts / std::max(ep, 1);
    // The expert side's rows (under expert parallelism twice this rank's slots: the routing
    // decides, and a busier step grows the workspace once), and the most rows one expert can
    // take: one per token of the micro-batch (of every member's under expert parallelism), so
    // the per-expert buffers never grow with the routing.
    const std::int64_t rows = ep > 1 ? 2 * S : S;
    const std::int64_t most = use_grouped_expert_gemm(e.expert_gemm)
                                  ? rows
                                  : std::min(rows, N * std::max(ep, 1));
    wire = ep > 1 && bf16 && D % 2 == 0;  // rows and their gradients travel as bf16
    staging = bf16 ? 2 * r(4 * most * Fe) : 0;
    hidden = expert_threads(ctx, e, m.d_model, El, bf16) * 3 * r(4 * most * Fe);  // per thread
    rows_fp32 = r(4 * rows * D);
    wire_in = wire ? r(2 * rows * D) : 0;
  }
  // Under expert parallelism: the outputs and a transfer buffer (fp32 back) or the bf16
  // staging (forward); the received gradients (and their bf16 form), then a transfer buffer or
  // the hidden gradients (backward).
  std::int64_t expert_side() const {
    return std::max(rows_fp32 + std::max(rows_fp32, staging),
                    rows_fp32 + wire_in + std::max(rows_fp32, hidden));
  }
};
}  // namespace

std::int64_t MoeLayer::expert_side_workspace_bytes(const RunContext& ctx, const ModelCfg& m,
                                                   const MoeCfg& e, std::int64_t N, int ep) {
  return ep > 1 ? MoeWorkspace(ctx, m, e, N, ep).expert_side() : 0;
}

std::int64_t MoeLayer::workspace_bytes(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e,
                                       std::int64_t N, int ep) {
  auto r = [](std::int64_t bytes) { return Workspace::rounded(bytes); };
  const MoeWorkspace w(ctx, m, e, N, ep);
  const std::int64_t D = m.d_model, S = N * e.top_k;
  const std::int64_t shared =
      e.shared_experts > 0
          ? SwigluMlp::workspace_bytes(N, e.shared_experts * e.shared_hidden, ctx.bf16())
          : 0;
  // The slots' weight and row gradients (and the rows' bf16 form), then the expert side (here:
  // the hidden gradients) or, after it, the logit gradients; the forward's staging.
  const std::int64_t experts = ep > 1 ? w.expert_side() : std::max(w.staging, w.hidden);
  const std::int64_t slots = r(4 * S) + r(4 * S * D) + (w.wire ? r(2 * S * D) : 0);
  return std::max({shared, slots + std::max(experts, r(4 * N * e.experts))});
}

void update_router_bias(TensorTable& table, int bias_index, const std::vector<double>& counts,
                        double gamma) {
  const int E = static_cast<int>(counts.size());
  double mean = 0.0;
  for (double c : counts) mean += c;
  mean /= E;
  auto b = Kokkos::View<float*, Layout, MemSpace, Unmanaged>(table.param(bias_index), E);
  auto h = read_to_host("router bias", b);
  for (int e = 0; e < E; ++e) {
    const double d = mean - counts[e];
    h(e) += static_cast<float>(gamma * (d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0)));
  }
  mark_host_sync("router bias");
  Kokkos::deep_copy(b, h);
}

MoeStatColumns MoeLayer::declare_stats(StepStats& stats, int block, const MoeCfg& e) {
  const std::string p = "moe" + std::to_string(block) + "_";
  MoeStatColumns c;
  c.lb = stats.add(StatColumn::mean_per_micro_batch(p + "lb"));
  c.rz = stats.add(StatColumn::mean_per_micro_batch(p + "rz"));
  c.load = stats.add(StatColumn::max_over_mean(p + "load_max_mean", e.experts)
                         .summarized("moe load max/mean", StatSummary::Max));
  if (e.capacity_factor > 0)
    c.drop = stats.add(StatColumn::fraction_of(p + "drop", p + "load_max_mean"));
  return c;
}

void MoeLayer::after_optimizer_step(TensorTable& table, const StepStats& stats) const {
  if (bias_ < 0 || !stats_) return;
  // Every rank holds the same global counts, so the replicated biases stay identical.
  const double* counts = stats.host(cols_.load);
  update_router_bias(table, bias_, std::vector<double>(counts, counts + E_), cfg_.bias_update_rate);
}

MoeLayer::MoeLayer(const RunContext& ctx, const ModelCfg& m, const MoeCfg& e,
                   const std::string& prefix, std::int64_t max_tokens, TensorTable& table,
                   const Communicator* ep, const DataComm* ep_data, StepStats* stats, int block)
    : ctx_(ctx.unpooled()),
      D_(m.d_model),
      E_(e.experts),
      k_(e.top_k),
      Fe_(e.expert_hidden),
      P_(ep ? ep->size() : 1),
      El_(e.experts / P_),
      e0_(ep ? ep->rank() * El_ : 0),
      cfg_(e),
      stats_(stats),
      buckets_(max_tokens * e.top_k, e.experts) {
  if (stats_) cols_ = declare_stats(*stats_, block, e);
  KMOE_REQUIRE(E_ % P_ == 0,
               "moe.experts (" << E_ << ") must be divisible by parallel.ep (" << P_ << ")");
  router_ = table.add(TensorSpec::matrix(prefix + "router", {E_, D_}, m.matrix_std(D_)));
  // This ep rank's row block [E/P experts] of the global [E, ...] tensors; each expert's matrix
  // initialized by its own input width (w2 an output projection).
  auto expert = [&](const char* name, std::int64_t a, std::int64_t b, bool output) {
    return table.add(TensorSpec::matrix(prefix + name, {E_, a, b}, m.matrix_std(b, output))
                         .row_block(Shard::Ep, e0_, El_)
                         .gemm_weight());
  };
  w1_ = expert("experts.w1", Fe_, D_, false);
  w3_ = expert("experts.w3", Fe_, D_, false);
  w2_ = expert("experts.w2", D_, Fe_, true);
  if (e.bias_update_rate > 0) bias_ = table.add(TensorSpec::buffer(prefix + "router_bias", {E_}));
  if (e.shared_experts > 0)
    shared_ = std::make_unique<SwigluMlp>(ctx, prefix + "shared.", m, e.shared_experts * e.shared_hidden,
                                          max_tokens, table);
  const std::int64_t slots = max_tokens * k_;
  logits_ = saved_floats(ctx, "moe::logits", max_tokens * E_);
  probs_ = saved_floats(ctx, "moe::probs", max_tokens * E_);
  lse_ = saved_floats(ctx, "moe::lse", max_tokens);
  sel_ = View1I("moe::sel", slots);
  weights_ = saved_floats(ctx, "moe::weights", slots);
  slot_row_ = saved_ints(ctx, "moe::slot_row", slots);
  row_slot_ = saved_ints(ctx, "moe::row_slot", slots);
  row_offsets_ = View1I("moe::row_offsets", E_ + 1);
  if (P_ > 1) {
    // The expert side's rows depend on the routing of every ep rank: sized here for twice a
    // balanced share, grown in a step only beyond that.
    const std::int64_t rows = 2 * slots;
    dispatch_ = std::make_unique<ExpertDispatch>(*ep, ep_data ? *ep_data : *ep, E_, D_, rows);
    ex_in_ = KeptOperand(ctx, "moe::ex_in", rows * D_, /*may_be_bf16=*/D_ % 2 == 0);
    ex_up1_ = KeptOperand(ctx, "moe::ex_up1", rows * Fe_);
    ex_up3_ = KeptOperand(ctx, "moe::ex_up3", rows * Fe_);
    ex_act_ = KeptOperand(ctx, "moe::ex_act", rows * Fe_);
  }
  // With expert parallelism the gathered rows are the dispatch's send buffer (bf16 only when
  // they can travel as 4-byte pairs), and the expert side uses the ex_* buffers instead of up1_,
  // up3_, act_.
  rows_in_ = KeptOperand(ctx, "moe::rows_in", slots * D_, /*may_be_bf16=*/P_ == 1 || D_ % 2 == 0);
  if (P_ == 1) {
    up1_ = KeptOperand(ctx, "moe::up1", slots * Fe_);
    up3_ = KeptOperand(ctx, "moe::up3", slots * Fe_);
    act_ = KeptOperand(ctx, "moe::act", slots * Fe_);
  }
  rows_out_ = saved_floats(ctx, "moe::rows_out", slots * D_);
  aux_sums_ = View1D("moe::aux_sums", E_ + 1);
  report_ = View1D("moe::report", E_ + 3);
  aux_partial_ = View1D("moe::aux_partial", ((max_tokens + kAuxChunk - 1) / kAuxChunk) * (E_ + 1));
  if (use_grouped_expert_gemm(e.expert_gemm)) {
    grouped_ = std::make_unique<GroupedGemm>(ctx, El_);
    if (P_ > 1) local_offsets_ = View1I("moe::local_offsets", El_ + 1);
  }
}

// auto is per_expert on every backend: on an H200 the vendor's per-expert GEMMs ran the
// 64-expert bench deck 2.3x (bf16) and 3.6x (fp32) faster than the grouped kernel, their host
// read of the row counts included (docs/PERFORMANCE.md, "One GPU").
bool use_grouped_expert_gemm(ExpertGemm choice) { return choice == ExpertGemm::Grouped; }

int expert_threads(const RunContext& ctx, const MoeCfg& e, int d_model, int local_experts,
                   bool bf16) {
  if (bf16 || ctx.bf16() || use_grouped_expert_gemm(e.expert_gemm) ||
      local_experts < 2)
    return 1;
  // A single-column product is gemm()'s gemv, not the call gemm_on_host_thread makes.
  if (d_model == 1 || e.expert_hidden == 1) return 1;
  return std::min(ctx.batch_threads, local_experts);
}

MoeStats MoeLayer::report() const {
  auto h = read_to_host("moe report", report_);
  MoeStats st;
  st.load.resize(E_);
  for (int e = 0; e < E_; ++e) st.load[e] = static_cast<std::int64_t>(h(e));
  st.dropped = static_cast<std::int64_t>(h(E_));
  st.lb = h(E_ + 1);
  st.rz = h(E_ + 2);
  st.aux = cfg_.lb_coef * st.lb + cfg_.z_coef * st.rz;
  return st;
}

void MoeLayer::forward(const TensorTable& table, ConstMat x, Mat y, Workspace& ws, View1D aux,
                       bool count) {
  N_ = x.extent(0);
  route(table, x);
  const int cap = capacity(N_);
  assign_rows(cap);
  gather_rows(x);
  run_experts(table, ws);
  combine(table, x, y, ws);
  add_aux_losses(aux, count, cap);
}

int MoeLayer::capacity(int N) const {
  return cfg_.capacity_factor > 0
             ? static_cast<int>(std::ceil(cfg_.capacity_factor * double(N) * k_ / E_))
             : INT_MAX;
}

void MoeLayer::route(const TensorTable& table, ConstMat x) {
  const int N = N_, E = E_, k = k_, D = D_;
  const bool softmax = cfg_.score == RouterScore::Softmax, normalize = cfg_.normalize_topk;
  // Router logits (N, E), then per token: logsumexp, scores, top-k of the scores (strictly
  // greater wins, so ties go to the lower expert index), and the k weights.
  Mat z = as_mat(logits_.data(), N, E);
  // The router stays fp32 in every precision (MODEL.md section 8).
  gemm(ctx_.exact_fp32(), Trans::N, Trans::T, 1.0f, x, as_cmat(table.param(router_), E, D), 0.0f,
       z);
  auto p = as_mat(probs_.data(), N, E);
  auto lse = lse_;
  auto sel = sel_;
  auto w = weights_;
  const float* bias = bias_ >= 0 ? table.param(bias_) : nullptr;  // selection only
  // One team per token, its threads over the experts. Each of the k picks is a max over
  // (score, -expert) packed into one integer: exact and order-free, so the lower expert wins a
  // tie on every backend.
  Kokkos::parallel_for(
      "moe::route", row_policy(N), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int t = tm.league_rank();
        float mx = 0.0f, sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, E), [&](int e, float& m) { m = z(t, e) > m ? z(t, e) : m; },
            Kokkos::Max<float>(mx));
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, E), [&](int e, float& s) { s += math::exp(z(t, e) - mx); },
            sum);
        const float l = mx + math::log(sum);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, E), [&](int e) {
          p(t, e) = softmax ? math::exp(z(t, e) - l) : 1.0f / (1.0f + math::exp(-z(t, e)));
        });
        Kokkos::single(Kokkos::PerTeam(tm), [&]() { lse(t) = l; });
        tm.team_barrier();  // p and the picks so far, seen by every thread
        float wsum = 0.0f;
        for (int j = 0; j < k; ++j) {
          std::uint64_t best = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(tm, E),
              [&](int e, std::uint64_t& b) {
                bool taken = false;
                for (int i = 0; i < j; ++i) taken = taken || sel(t * k + i) == e;
                if (taken) return;
                const float score = p(t, e) + (bias ? bias[e] : 0.0f);
                const std::uint64_t key = (std::uint64_t(ordered_bits(score)) << 32) |
                                          std::uint64_t(0xFFFFFFFFu - std::uint32_t(e));
                b = key > b ? key : b;
              },
              Kokkos::Max<std::uint64_t>(best));
          const int pick = static_cast<int>(0xFFFFFFFFu - std::uint32_t(best & 0xFFFFFFFFu));
          Kokkos::single(Kokkos::PerTeam(tm), [&]() {
            sel(t * k + j) = pick;
            w(t * k + j) = p(t, pick);
          });
          wsum += p(t, pick);
          tm.team_barrier();
        }
        if (normalize)
          Kokkos::single(Kokkos::PerTeam(tm), [&]() {
            for (int j = 0; j < k; ++j) w(t * k + j) /= wsum;
          });
      });
}

void MoeLayer::assign_rows(int cap) {
  const int N = N_, E = E_, k = k_;
  // Dispatch: slots grouped per expert in token order; with a capacity, each expert keeps its
  // first `cap` slots (token order) and drops the rest.
  const int slots = N * k;
  buckets_.build(ConstIVec(sel_.data(), slots));
  auto off = buckets_.offsets;
  auto ord = buckets_.order;
  auto roff = row_offsets_;
  // Kept-row offsets on the device, from the device counts: a prefix sum over the experts.
  Kokkos::parallel_scan(
      "moe::row_offsets", Range(0, E), KOKKOS_LAMBDA(int e, int& before, bool final) {
        const int c = off(e + 1) - off(e);
        before += c < cap ? c : cap;
        if (final) {
          if (e == 0) roff(0) = 0;
          roff(e + 1) = before;
        }
      });
  // Per-expert GEMMs and the ep dispatch size their work on the host: they read the offsets
  // (one wait). Grouped GEMMs read them on the device; the row buffers then hold the bound N*k
  // (every row when dropless), kernels skipping rows past the kept ones.
  host_offsets_.clear();
  rows_ = slots;
  if (!grouped_ || dispatch_) {
    auto h = read_to_host("moe expert offsets", roff);
    host_offsets_.assign(h.data(), h.data() + E + 1);
    rows_ = host_offsets_[E];
  }
  auto slot_row = slot_row_, row_slot = row_slot_;
  // One thread per grouped slot; its expert from the offsets (the last e with off(e) <= a).
  Kokkos::parallel_for(
      "moe::assign_rows", Range(0, slots), KOKKOS_LAMBDA(int a) {
        const int e = segment_of(off, E, a), rank = a - off(e), slot = ord(a);
        if (rank < cap) {
          slot_row(slot) = roff(e) + rank;
          row_slot(roff(e) + rank) = slot;
        } else {
          slot_row(slot) = -1;
        }
      });
}

void MoeLayer::gather_rows(ConstMat x) {
  const int E = E_, k = k_, D = D_;
  auto roff = row_offsets_;
  auto row_slot = row_slot_;
  const int R = static_cast<int>(rows_);
  const KeptOut rows_in = rows_in_.out();
  // Row copies: one team per row, its threads over the features (coalesced on GPUs, a plain
  // loop on CPUs).
  Kokkos::parallel_for(
      "moe::gather", row_policy(R), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank();
        if (r >= roff(E)) return;
        const int t = row_slot(r) / k;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, D),
                             [&](int d) { rows_in.set(std::int64_t(r) * D + d, x(t, d)); });
      });
}

void MoeLayer::run_experts(const TensorTable& table, Workspace& ws) {
  const int D = D_, Fe = Fe_, R = static_cast<int>(rows_);
  // Experts: one contiguous row block each, here or on their ep rank.
  if (!dispatch_) {
    if (grouped_) grouped_->plan(row_offsets_, R);
    experts_forward(table, rows_in_.matrix(R, D), host_offsets_, R, up1_, up3_, act_,
                    rows_out_.data(), ws);
  } else {
    dispatch_->plan(host_offsets_);
    const std::int64_t Rx = dispatch_->local_rows();
    ex_in_.ensure(Rx * D);
    for (KeptOperand* v : {&ex_up1_, &ex_up3_, &ex_act_}) v->ensure(Rx * Fe);
    Workspace::Frame frame(ws);
    float* ex_out = frame.floats(std::max<std::int64_t>(Rx, 1) * D);  // (Rx, D) expert outputs
    if (grouped_) {
      const std::vector<int>& lo = dispatch_->local_offsets();
      Kokkos::deep_copy(ExecSpace(), local_offsets_,
                        Kokkos::View<const int*, HostSpace, Unmanaged>(lo.data(), lo.size()));
      grouped_->plan(local_offsets_, Rx);
    }
    if (rows_in_.is_bf16())
      dispatch_->dispatch(rows_in_.b16(), ex_in_.b16(), ws);
    else
      dispatch_->dispatch(rows_in_.f32(), ex_in_.f32(), ws);
    experts_forward(table, ex_in_.matrix(static_cast<int>(Rx), D), dispatch_->local_offsets(), Rx,
                    ex_up1_, ex_up3_, ex_act_, ex_out, ws);
    dispatch_->combine(ex_out, rows_out_.data(), ws);
  }
}

void MoeLayer::combine(const TensorTable& table, ConstMat x, Mat y, Workspace& ws) {
  const int N = N_, k = k_, D = D_, R = static_cast<int>(rows_);
  auto slot_row = slot_row_;
  auto w = weights_;
  // Combine: y = shared(x) + sum_j w_j expert_j(x), slots in order (dropped ones give 0).
  if (shared_)
    shared_->forward(table, x, y, ws);
  else
    Kokkos::deep_copy(ExecSpace(),
                      Kokkos::View<float**, Layout, MemSpace, Unmanaged>(y.data(), N, D), 0.0f);
  auto out = as_cmat(rows_out_.data(), std::max(R, 1), D);
  Kokkos::parallel_for(
      "moe::combine", row_policy(N), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int t = tm.league_rank();
        for (int j = 0; j < k; ++j) {  // slots in order: the same sum order per feature
          const int r = slot_row(t * k + j);
          if (r < 0) continue;
          const float wj = w(t * k + j);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, D),
                               [&](int d) { y(t, d) += wj * out(r, d); });
        }
      });
}

void MoeLayer::add_aux_losses(View1D aux, bool count, int cap) {
  const int N = N_, E = E_, k = k_;
  auto p = as_mat(probs_.data(), N, E);
  auto lse = lse_;
  auto off = buckets_.offsets;
  // LB = (E/k) sum_e (c_e / N) P_e with P_e = mean_t p_te; RZ = mean_t lse_t^2. Column sums in
  // two fixed-order stages (chunks of tokens, then the chunks in order: the same sums on every
  // backend), then the report, the statistics and the loss term, all on the device.
  const int chunk = kAuxChunk, chunks = (N + chunk - 1) / chunk;
  Kokkos::View<double**, Layout, MemSpace, Unmanaged> part(aux_partial_.data(), chunks, E + 1);
  Kokkos::parallel_for(
      "moe::aux_partial", Range2({0, 0}, {chunks, E + 1}), KOKKOS_LAMBDA(int c, int e) {
        const int t1 = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        double acc = 0.0;
        for (int t = c * chunk; t < t1; ++t)
          acc += e < E ? double(p(t, e)) : double(lse(t)) * lse(t);
        part(c, e) = acc;
      });
  auto sums = aux_sums_;
  Kokkos::parallel_for(
      "moe::aux_sums", Range(0, E + 1), KOKKOS_LAMBDA(int e) {
        double acc = 0.0;
        for (int c = 0; c < chunks; ++c) acc += part(c, e);
        sums(e) = acc;
      });
  using DevD = Kokkos::View<double*, Layout, MemSpace, Unmanaged>;
  DevD st_lb, st_rz, st_load, st_drop;
  if (stats_) {
    st_lb = stats_->device(cols_.lb);
    st_rz = stats_->device(cols_.rz);
    st_load = stats_->device(cols_.load);
    if (cols_.drop >= 0) st_drop = stats_->device(cols_.drop);
  }
  const bool has_stats = stats_ != nullptr && count, has_drop = st_drop.extent(0) > 0;
  const bool has_aux = aux.extent(0) > 0 && count;
  const double lb_coef = cfg_.lb_coef, z_coef = cfg_.z_coef;
  auto rep = report_;
  Kokkos::parallel_for(
      "moe::aux_finish", Range(0, 1), KOKKOS_LAMBDA(int) {
        double lb = 0.0;
        std::int64_t dropped = 0;
        for (int e = 0; e < E; ++e) {
          const int c = off(e + 1) - off(e);
          rep(e) = c;
          dropped += c > cap ? c - cap : 0;
          lb += double(c) / N * (sums(e) / N);
        }
        lb *= double(E) / k;
        const double rz = sums(E) / N;
        rep(E) = double(dropped);
        rep(E + 1) = lb;
        rep(E + 2) = rz;
        if (has_aux) aux(0) += lb_coef * lb + z_coef * rz;
        if (has_stats) {
          st_lb(0) += lb;
          st_rz(0) += rz;
          for (int e = 0; e < E; ++e) st_load(e) += off(e + 1) - off(e);
          if (has_drop) st_drop(0) += double(dropped);
        }
      });
}

void MoeLayer::backward(TensorTable& table, ConstMat x, ConstMat dy, Mat dx, Workspace& ws,
                        float aux_scale) {
  const int N = N_, k = k_, D = D_, R = static_cast<int>(rows_);
  if (shared_)
    shared_->backward(table, x, dy, dx, ws);
  else
    Kokkos::deep_copy(ExecSpace(),
                      Kokkos::View<float**, Layout, MemSpace, Unmanaged>(dx.data(), N, D), 0.0f);
  Workspace::Frame frame(ws);
  const Vec dwt(frame.floats(std::int64_t(N) * k), std::int64_t(N) * k);  // (N*k)
  // (R, D): the rows' output gradients, then their input gradients
  Mat d_rows = frame.mat(std::max(R, 1), D);
  // In bf16 runs with expert parallelism the output gradients leave as bf16 (the products on
  // the expert side would round them anyway); otherwise they are d_rows.
  const bool wire = dispatch_ && rows_in_.is_bf16();
  std::uint16_t* wire_out = wire ? frame.words(std::int64_t(std::max(R, 1)) * D) : nullptr;
  row_grads(dy, dwt, wire ? KeptOut{nullptr, wire_out} : KeptOut{d_rows.data(), nullptr});
  run_experts_backward(table, d_rows, wire_out, ws);
  scatter_inputs(as_cmat(d_rows), dx);
  router_backward(table, x, dwt, dx, aux_scale, ws);
}

void MoeLayer::row_grads(ConstMat dy, Vec dwt, KeptOut g_rows) const {
  const int N = N_, E = E_, k = k_, D = D_, R = static_cast<int>(rows_);
  // Per expert row: the gradient of its output (w * dy of its token) and of its weight
  // (<dy, output>); dropped slots contributed 0 and get weight gradient 0.
  auto w = weights_;
  auto slot_row = slot_row_, row_slot = row_slot_;
  auto out = as_cmat(rows_out_.data(), std::max(R, 1), D);
  Kokkos::parallel_for(
      "moe::dropped_weight_grad", Range(0, N * k), KOKKOS_LAMBDA(int slot) {
        if (slot_row(slot) < 0) dwt(slot) = 0.0f;
      });
  auto roff = row_offsets_;
  Kokkos::parallel_for(
      "moe::row_grads", row_policy(R), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank();
        if (r >= roff(E)) return;
        const int slot = row_slot(r), t = slot / k;
        const float wv = w(slot);
        float dot = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(tm, D),
            [&](int d, float& acc) {
              g_rows.set(std::int64_t(r) * D + d, wv * dy(t, d));
              acc += dy(t, d) * out(r, d);
            },
            dot);
        Kokkos::single(Kokkos::PerTeam(tm), [&]() { dwt(slot) = dot; });
      });
}

void MoeLayer::run_experts_backward(TensorTable& table, Mat d_rows, const std::uint16_t* wire_out,
                                    Workspace& ws) const {
  const int D = D_, R = static_cast<int>(rows_);
  // Experts backward (here or on their ep rank): d_rows then holds the input gradients.
  const bool wire = wire_out != nullptr;
  if (!dispatch_) {
    experts_backward(table, operand(as_cmat(d_rows)), d_rows.data(), rows_in_.matrix(R, D), up1_,
                     up3_, act_, host_offsets_, R, ws);
  } else {
    const int Rx = static_cast<int>(dispatch_->local_rows());
    Workspace::Frame expert_side(ws);
    // (Rx, D): the received output gradients, then the rows' input gradients
    float* ex_grad = expert_side.floats(std::int64_t(std::max(Rx, 1)) * D);
    Operand g{ex_grad, nullptr, Rx, D};
    if (wire) {
      std::uint16_t* wire_in = expert_side.words(std::int64_t(std::max(Rx, 1)) * D);
      dispatch_->dispatch(wire_out, wire_in, ws);
      g = Operand{nullptr, wire_in, Rx, D};
    } else {
      dispatch_->dispatch(d_rows.data(), ex_grad, ws);
    }
    experts_backward(table, g, ex_grad, ex_in_.matrix(Rx, D), ex_up1_, ex_up3_, ex_act_,
                     dispatch_->local_offsets(), Rx, ws);
    dispatch_->combine(ex_grad, d_rows.data(), ws);
  }
}

void MoeLayer::scatter_inputs(ConstMat d_rows, Mat dx) const {
  const int N = N_, k = k_, D = D_;
  auto slot_row = slot_row_;
  Kokkos::parallel_for(
      "moe::scatter_inputs", row_policy(N), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int t = tm.league_rank();
        for (int j = 0; j < k; ++j) {
          const int r = slot_row(t * k + j);
          if (r < 0) continue;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, D),
                               [&](int d) { dx(t, d) += d_rows(r, d); });
        }
      });
}

void MoeLayer::router_backward(TensorTable& table, ConstMat x, ConstVec dwt, Mat dx,
                               float aux_scale, Workspace& ws) const {
  const int N = N_, E = E_, k = k_, D = D_;
  const bool softmax = cfg_.score == RouterScore::Softmax, normalize = cfg_.normalize_topk;
  auto w = weights_;
  // Router: d scores from the weights and the LB term, then through softmax/sigmoid, plus the
  // z-loss; dlogits -> router weight and input gradients.
  auto z = as_cmat(logits_.data(), N, E);
  auto p = as_cmat(probs_.data(), N, E);
  auto lse = lse_;
  auto sel = sel_;
  auto off = buckets_.offsets;
  Workspace::Frame frame(ws);
  Mat dz = frame.mat(N, E);
  const float lb_scale = aux_scale * cfg_.lb_coef * float(E) / k / (float(N) * N);
  const float rz_scale = aux_scale * cfg_.z_coef * 2.0f / N;
  Kokkos::parallel_for(
      "moe::router_backward", row_policy(N), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int t = tm.league_rank();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, E),
                             [&](int e) { dz(t, e) = lb_scale * float(off(e + 1) - off(e)); });
        tm.team_barrier();
        Kokkos::single(Kokkos::PerTeam(tm), [&]() {  // the k weights, in slot order
          if (normalize) {
            float sum = 0.0f, ws = 0.0f;
            for (int j = 0; j < k; ++j) {
              sum += p(t, sel(t * k + j));
              ws += dwt(t * k + j) * w(t * k + j);
            }
            for (int j = 0; j < k; ++j) dz(t, sel(t * k + j)) += (dwt(t * k + j) - ws) / sum;
          } else {
            for (int j = 0; j < k; ++j) dz(t, sel(t * k + j)) += dwt(t * k + j);
          }
        });
        tm.team_barrier();
        float dot = 0.0f;
        if (softmax)
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(tm, E), [&](int e, float& acc) { acc += p(t, e) * dz(t, e); },
              dot);
        tm.team_barrier();  // every thread has read dz before any rewrites it
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, E), [&](int e) {
          float g = softmax ? p(t, e) * (dz(t, e) - dot) : dz(t, e) * (p(t, e) * (1.0f - p(t, e)));
          g += rz_scale * lse(t) * math::exp(z(t, e) - lse(t));
          dz(t, e) = g;
        });
      });
  const RunContext fp32 = ctx_.exact_fp32();
  gemm(fp32, Trans::T, Trans::N, 1.0f, as_cmat(dz), x, 1.0f, as_mat(table.grad(router_), E, D));
  gemm(fp32, Trans::N, Trans::N, 1.0f, as_cmat(dz), as_cmat(table.param(router_), E, D), 1.0f,
       dx);
}

void MoeLayer::experts_forward(const TensorTable& table, const Operand& in,
                               const std::vector<int>& off, std::int64_t rows,
                               const KeptOperand& up1, const KeptOperand& up3,
                               const KeptOperand& act, float* out, Workspace& ws) const {
  const int D = D_, Fe = Fe_, R = static_cast<int>(rows);
  const std::int64_t wsz = std::int64_t(Fe) * D;
  // bf16 runs: the up-projections go to workspace buffers first, then rounded into up1/up3
  // (grouped: every row's; per expert: one expert's at a time).
  const bool staged = up1.is_bf16();
  Workspace::Frame frame(ws);
  const std::int64_t staged_rows = !staged ? 0 : grouped_ ? rows : largest_block(off);
  float* s1 = staged ? frame.floats(std::max<std::int64_t>(staged_rows, 1) * Fe) : nullptr;
  float* s3 = staged ? frame.floats(std::max<std::int64_t>(staged_rows, 1) * Fe) : nullptr;
  if (grouped_) {  // one launch per product over every local expert
    float* u1 = up1.product_target(s1);
    float* u3 = up3.product_target(s3);
    grouped_->rows(Trans::T, 1.0f, in, D, table.weight(w1_, El_ * Fe, D), wsz, 0.0f, u1, Fe);
    grouped_->rows(Trans::T, 1.0f, in, D, table.weight(w3_, El_ * Fe, D), wsz, 0.0f, u3, Fe);
    swiglu_activate(u1, u3, Fe, R, Fe, act.out(), up1.out(), up3.out());
    grouped_->rows(Trans::T, 1.0f, act.matrix(R, Fe), Fe, table.weight(w2_, El_ * D, Fe), wsz,
                   0.0f, out, D);
    return;
  }
  if (const int threads = expert_threads(ctx_, cfg_, D_, El_, staged); threads > 1) {
    // fp32: the products write the kept buffers directly; each expert's chain on one thread.
    host_items_side_by_side("moe::experts_forward", El_, threads, [&](int le, int) {
      const int r0 = off[le], n = off[le + 1] - r0;
      if (n == 0) return;
      const std::int64_t h0 = std::int64_t(r0) * Fe;
      float* u1 = up1.product_target(nullptr, h0);
      float* u3 = up3.product_target(nullptr, h0);
      const Operand x = rows_of(in, r0, n);
      gemm_on_host_thread(Trans::N, Trans::T, 1.0f, x, table.weight(w1_, Fe, D, le * wsz), 0.0f,
                          as_mat(u1, n, Fe));
      gemm_on_host_thread(Trans::N, Trans::T, 1.0f, x, table.weight(w3_, Fe, D, le * wsz), 0.0f,
                          as_mat(u3, n, Fe));
      swiglu_activate_here(u1, u3, Fe, n, Fe, act.out(h0).f32);
      gemm_on_host_thread(Trans::N, Trans::T, 1.0f, act.matrix(n, Fe, h0),
                          table.weight(w2_, D, Fe, le * wsz), 0.0f,
                          as_mat(out + std::int64_t(r0) * D, n, D));
    });
    return;
  }
  for (int le = 0; le < El_; ++le) {
    const int r0 = off[le], n = off[le + 1] - r0;
    if (n == 0) continue;
    const Operand x = rows_of(in, r0, n);
    const std::int64_t h0 = std::int64_t(r0) * Fe;
    Mat u1 = as_mat(up1.product_target(s1, h0), n, Fe);
    Mat u3 = as_mat(up3.product_target(s3, h0), n, Fe);
    gemm(ctx_, Trans::N, Trans::T, 1.0f, x, table.weight(w1_, Fe, D, le * wsz), 0.0f, u1);
    gemm(ctx_, Trans::N, Trans::T, 1.0f, x, table.weight(w3_, Fe, D, le * wsz), 0.0f, u3);
    swiglu_activate(u1.data(), u3.data(), Fe, n, Fe, act.out(h0), up1.out(h0), up3.out(h0));
    gemm(ctx_, Trans::N, Trans::T, 1.0f, act.matrix(n, Fe, h0), table.weight(w2_, D, Fe, le * wsz), 0.0f,
         as_mat(out + std::int64_t(r0) * D, n, D));
  }
}

void MoeLayer::experts_backward(TensorTable& table, const Operand& g_rows, float* g_out,
                                const Operand& in, const KeptOperand& up1, const KeptOperand& up3,
                                const KeptOperand& act, const std::vector<int>& off,
                                std::int64_t rows, Workspace& ws) const {
  // An expert without rows leaves its (zeroed) gradients untouched.
  const int D = D_, Fe = Fe_, R = static_cast<int>(rows);
  const std::int64_t wsz = std::int64_t(Fe) * D;
  if (grouped_) {  // every local expert's rows at once: the hidden gradients for all rows
    Workspace::Frame frame(ws);
    const std::int64_t n = std::max<std::int64_t>(rows, 1) * Fe;
    float *da = frame.floats(n), *du1 = frame.floats(n), *du3 = frame.floats(n);
    grouped_->rows(Trans::N, 1.0f, g_rows, D, table.weight(w2_, El_ * D, Fe), wsz, 0.0f, da, Fe);
    grouped_->weight_grads(1.0f, g_rows, D, act.matrix(R, Fe), Fe, table.grad(w2_), wsz);
    swiglu_activate_backward(up1.in(), up3.in(), Fe, as_cmat(da, R, Fe), du1, du3, Fe);
    grouped_->weight_grads(1.0f, du1, Fe, in, D, table.grad(w1_), wsz);
    grouped_->weight_grads(1.0f, du3, Fe, in, D, table.grad(w3_), wsz);
    // The gradient w.r.t. the experts' inputs (g_out may be g_rows: read in full above).
    grouped_->rows(Trans::N, 1.0f, du1, Fe, table.weight(w1_, El_ * Fe, D), wsz, 0.0f, g_out, D);
    grouped_->rows(Trans::N, 1.0f, du3, Fe, table.weight(w3_, El_ * Fe, D), wsz, 1.0f, g_out, D);
    return;
  }
  const int most = largest_block(off);
  Workspace::Frame frame(ws);  // one expert's hidden gradients at a time (per thread)
  const std::int64_t hidden = std::max<std::int64_t>(most, 1) * Fe;
  if (const int threads = expert_threads(ctx_, cfg_, D_, El_, up1.is_bf16()); threads > 1) {
    float* bufs = frame.floats(threads * 3 * hidden);
    host_items_side_by_side("moe::experts_backward", El_, threads, [&](int le, int t) {
      const int r0 = off[le], n = off[le + 1] - r0;
      if (n == 0) return;
      float* da = bufs + t * 3 * hidden;
      float *du1 = da + hidden, *du3 = du1 + hidden;
      const Operand g = rows_of(g_rows, r0, n), x = rows_of(in, r0, n);
      const std::int64_t h0 = std::int64_t(r0) * Fe;
      const Operand w1 = table.weight(w1_, Fe, D, le * wsz),
                    w3 = table.weight(w3_, Fe, D, le * wsz);
      const Operand g_du1{du1, nullptr, n, Fe}, g_du3{du3, nullptr, n, Fe};
      gemm_on_host_thread(Trans::N, Trans::N, 1.0f, g, table.weight(w2_, D, Fe, le * wsz), 0.0f,
                          as_mat(da, n, Fe));
      gemm_on_host_thread(Trans::T, Trans::N, 1.0f, g, act.matrix(n, Fe, h0), 1.0f,
                          as_mat(table.grad(w2_) + le * wsz, D, Fe));
      swiglu_activate_backward_here(up1.in(h0).f32, up3.in(h0).f32, Fe, da, n, Fe, du1, du3, Fe);
      gemm_on_host_thread(Trans::T, Trans::N, 1.0f, g_du1, x, 1.0f,
                          as_mat(table.grad(w1_) + le * wsz, Fe, D));
      gemm_on_host_thread(Trans::T, Trans::N, 1.0f, g_du3, x, 1.0f,
                          as_mat(table.grad(w3_) + le * wsz, Fe, D));
      // The gradient w.r.t. the expert's inputs (after g's last read: g_out may be g_rows).
      Mat g_in = as_mat(g_out + std::int64_t(r0) * D, n, D);
      gemm_on_host_thread(Trans::N, Trans::N, 1.0f, g_du1, w1, 0.0f, g_in);
      gemm_on_host_thread(Trans::N, Trans::N, 1.0f, g_du3, w3, 1.0f, g_in);
    });
    return;
  }
  float *da_buf = frame.floats(hidden), *du1_buf = frame.floats(hidden),
        *du3_buf = frame.floats(hidden);
  for (int le = 0; le < El_; ++le) {
    const int r0 = off[le], n = off[le + 1] - r0;
    if (n == 0) continue;
    const Operand g = rows_of(g_rows, r0, n);
    Mat g_in = as_mat(g_out + std::int64_t(r0) * D, n, D);  // after g's last read
    const Operand x = rows_of(in, r0, n);
    const std::int64_t h0 = std::int64_t(r0) * Fe;
    Mat da = as_mat(da_buf, n, Fe);
    Mat du1 = as_mat(du1_buf, n, Fe), du3 = as_mat(du3_buf, n, Fe);
    gemm(ctx_, Trans::N, Trans::N, 1.0f, g, table.weight(w2_, D, Fe, le * wsz), 0.0f, da);
    gemm(ctx_, Trans::T, Trans::N, 1.0f, g, act.matrix(n, Fe, h0), 1.0f,
         as_mat(table.grad(w2_) + le * wsz, D, Fe));
    swiglu_activate_backward(up1.in(h0), up3.in(h0), Fe, as_cmat(da), du1.data(), du3.data(), Fe);
    gemm(ctx_, Trans::T, Trans::N, 1.0f, as_cmat(du1), x, 1.0f,
         as_mat(table.grad(w1_) + le * wsz, Fe, D));
    gemm(ctx_, Trans::T, Trans::N, 1.0f, as_cmat(du3), x, 1.0f,
         as_mat(table.grad(w3_) + le * wsz, Fe, D));
    // The gradient w.r.t. the expert's inputs.
    gemm(ctx_, Trans::N, Trans::N, 1.0f, as_cmat(du1), table.weight(w1_, Fe, D, le * wsz), 0.0f, g_in);
    gemm(ctx_, Trans::N, Trans::N, 1.0f, as_cmat(du3), table.weight(w3_, Fe, D, le * wsz), 1.0f, g_in);
  }
}

}  // namespace kmoe
