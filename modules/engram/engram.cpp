#include "modules/engram/engram.hpp"

#include <algorithm>
#include <cmath>

#include "core/column_sums.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/gemm.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe {

namespace {

// Column sums in a fixed order: dst[d] += sum_t src[t, d].
void add_column_sums(ConstMat src, float* dst_data) {
  const int N = src.extent(0), D = src.extent(1);
  column_sums(
      "engram::column_sums", N, D, KOKKOS_LAMBDA(int t, int d) { return src(t, d); },
      Vec(dst_data, D));
}

// Bias add: y[t, d] += b[d].
void add_bias(Mat y, const float* b_data) {
  ConstVec b(b_data, y.extent(1));
  Kokkos::parallel_for(
      "engram::bias", Range2({0, 0}, {int(y.extent(0)), int(y.extent(1))}),
      KOKKOS_LAMBDA(int t, int d) { y(t, d) += b(d); });
}

// mem[t, j*dh + i] = tab[rows(t, j), i] for N tokens of Kt heads: one team per token, its
// threads over the heads and each head's row copied by vector lanes: coalesced on GPUs (lanes
// read one table row and write consecutive columns), a contiguous row copy on CPUs (one-thread
// teams, one lane). `tab` is the table, or the row cache of a table kept in host memory with
// `row_ids` (device, N x Kt) its slots.
void gather_rows(ConstMat tab, const int* row_ids, int N, int Kt, const KeptOut& mem) {
  const Kokkos::View<const int**, Layout, MemSpace, Unmanaged> rows(row_ids, N, Kt);
  const int dh = tab.extent(1);
  const std::int64_t dm = std::int64_t(Kt) * dh;
  Kokkos::parallel_for(
      "engram::lookup", team_policy(N, vector_lanes(dh)), KOKKOS_LAMBDA(const TeamMember& team) {
        const int t = team.league_rank();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, Kt), [&](int j) {
          const int r = rows(t, j);
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, dh),
                               [&](int i) { mem.set(t * dm + j * dh + i, tab(r, i)); });
        });
      });
}

}  // namespace

EngramLayer::EngramLayer(const RunContext& ctx, const ModelCfg& m, const EngramCfg& g,
                         const EngramHashPlan& plan, const std::string& prefix, int max_tokens,
                         int seq_len, TensorTable& table, const Sharding& shard, StepStats* stats)
    : ctx_(ctx.unpooled()),
      D_(m.d_model),
      T_(seq_len),
      Nn_(g.max_ngram),
      kernel_(g.kernel),
      heads_total_((g.max_ngram - 1) * g.heads),
      dh_(g.embed_per_ngram / g.heads),
      d_mem_((g.max_ngram - 1) * g.embed_per_ngram),
      R_(plan.rows),
      signed_sqrt_(g.gate == EngramGate::SignedSqrt),
      eps_(static_cast<float>(m.norm_eps)),
      hasher_(plan, g.max_ngram, g.heads, plan.pad_c),
      stats_(stats),
      offload_(g.offload == EngramOffload::Host) {
  if (stats_) cols_ = declare_stats(*stats_, plan.layer);
  const double std = g.init_std;
  // The table: no weight decay, its own learning-rate multiplier (MODEL.md section 4).
  // engram.offload = host: in host memory, with nothing the size of the table on the device.
  TensorSpec table_spec =
      TensorSpec::matrix(prefix + "table", {R_, dh_}, std).no_decay().with_lr_mult(g.lr_mult);
  if (offload_) table_spec = table_spec.in_host_memory();
  const int max_items = max_tokens * heads_total_;
  if (shard.kind != Shard::None && shard.comm && shard.comm->size() > 1) {
    shard_ = std::make_unique<EngramShard>(shard, R_, dh_, max_items, offload_);
    table_ = table.add(table_spec.row_block(shard.kind, shard_->first_row(), shard_->local_rows()));
  } else {
    table_ = table.add(table_spec);
    if (offload_)
      cache_ = std::make_unique<EngramRowCache>(dh_, max_items);
    else
      buckets_ = KeyBuckets(max_items, static_cast<int>(R_));
  }
  if (offload_) host_rows_.resize(max_items);
  // The projections: engram.init_std, or under model.init = fan_in init_gain/sqrt(d_mem).
  const double proj = m.init == InitScheme::FanIn ? m.matrix_std(d_mem_) : std;
  wk_ = table.add(TensorSpec::matrix(prefix + "wk", {D_, d_mem_}, proj).gemm_weight());
  wv_ = table.add(TensorSpec::matrix(prefix + "wv", {D_, d_mem_}, proj).gemm_weight());
  bk_ = table.add(TensorSpec::zeros(prefix + "bk", {D_}));
  bv_ = table.add(TensorSpec::zeros(prefix + "bv", {D_}));
  q_norm_ = table.add(TensorSpec::gain(prefix + "q_norm.weight", D_));
  k_norm_ = table.add(TensorSpec::gain(prefix + "k_norm.weight", D_));
  c_norm_ = table.add(TensorSpec::gain(prefix + "conv_norm.weight", D_));
  conv_ = table.add(TensorSpec::zeros(prefix + "conv", {D_, kernel_}));

  const std::int64_t N = max_tokens;
  rows_ = Kokkos::View<int**, Layout, MemSpace>("engram::rows", N, heads_total_);
  // Kept as bf16 in bf16 runs, unless the sharded lookup fills it (its rows arrive as fp32).
  mem_ = KeptOperand(ctx, "engram::mem", N * d_mem_, /*may_be_bf16=*/!shard_);
  for (View1F* v : {&key_, &val_, &kn_, &qn_, &v_, &u_, &c_})
    *v = saved_floats(ctx, "engram::act", N * D_);
  for (View1F* v : {&rstd_k_, &rstd_q_, &rstd_c_, &score_, &gate_})
    *v = saved_floats(ctx, "engram::row", N);
  gate_now_ = Kokkos::View<double, MemSpace>("engram::gate_now");
  if (stats_ && !offload_) {  // a host table flags its rows in host memory
    touched_ = View1F("engram::touched", R_);
    touched_rows_ = Kokkos::View<double, MemSpace>("engram::touched_rows");
  }
}

void EngramLayer::prefetch(const TensorTable& table, const std::int32_t* tokens, const int* starts,
                           int N) {
  KMOE_REQUIRE(offload_, "EngramLayer::prefetch: the table is in device memory");
  // A sharded table's holders stage what they are asked for; its rows here only count.
  if (!shard_ || stats_) hasher_.rows_host(tokens, N, T_, starts, 0, host_rows_.data());
  if (!shard_) stage_rows(table, N);
  staged_n_ = N;
  pending_ = true;
}

void EngramLayer::host_rows_from_device(ConstIVec tokens, DocStarts docs, int N) {
  // Not prefetched (generation, direct calls): the ids, and document starts, read back.
  std::vector<std::int32_t> ids(N);
  const auto t = read_to_host("engram offload ids", tokens);
  std::copy_n(t.data(), N, ids.begin());
  std::vector<int> starts;
  if (!docs.empty()) {
    const auto d = read_to_host("engram offload document starts", docs.start);
    starts.assign(d.data(), d.data() + N);
  }
  hasher_.rows_host(ids.data(), N, T_, starts.empty() ? nullptr : starts.data(), docs.shift,
                    host_rows_.data());
}

void EngramLayer::stage_rows(const TensorTable& table, int N) {
  cache_->stage(table, table_, host_rows_.data(), N * heads_total_, settled_);
  settled_ = false;
}

Operand EngramLayer::lookup_cached(int N) {
  // The same values as the table's rows, from the cache at each lookup's slot.
  cache_->wait();
  gather_rows(cache_->cache(), cache_->slots().data(), N, heads_total_, mem_.out());
  return mem_.matrix(N, d_mem_);
}

Operand EngramLayer::lookup(const TensorTable& table, ConstIVec tokens, bool count,
                            DocStarts docs) {
  const int N = tokens.extent(0), dh = dh_;
  if (offload_) {
    // The rows this forward reads: prefetched for a counted forward, still staged for its
    // recompute, else computed here from the ids read back.
    const bool staged = count ? pending_ : staged_n_ == N;
    const bool need_rows = !shard_ || (stats_ && count);  // a sharded table's: for statistics
    if (!staged && need_rows) {
      host_rows_from_device(tokens, docs, N);
      if (!shard_) stage_rows(table, N);
      staged_n_ = N;
    }
    if (count) pending_ = false;
    if (stats_ && count) {  // rows touched, flagged on the host
      std::vector<float>& flags = stats_->host_flags(cols_.touched, R_);
      for (std::int64_t a = 0, n = std::int64_t(N) * heads_total_; a < n; ++a)
        flags[host_rows_[a]] = 1.0f;
    }
    if (!shard_) return lookup_cached(N);
  }
  auto rows = Kokkos::subview(rows_, Kokkos::make_pair(0, N), Kokkos::ALL);
  hasher_.rows(tokens, T_, rows_, docs);
  if (stats_ && count && !offload_) {  // lookups per row, for the rows-touched metric (exact)
    auto touched = stats_->counters(cols_.touched, R_);
    Kokkos::parallel_for(
        "engram::count_lookups", Range2({0, 0}, {N, heads_total_}),
        KOKKOS_LAMBDA(int t, int j) { Kokkos::atomic_add(&touched(rows(t, j)), 1); });
  }

  // mem[t, j*dh + i] = table[row(t, j), i].
  if (shard_) {
    shard_->fetch(table, table_, ConstIVec(rows_.data(), N * heads_total_), N * heads_total_,
                  mem_.f32());
    return mem_.matrix(N, d_mem_);
  }
  gather_rows(as_cmat(table.param(table_), R_, dh), rows_.data(), N, heads_total_, mem_.out());
  return mem_.matrix(N, d_mem_);
}

void EngramLayer::forward(const TensorTable& table, ConstMat x, ConstIVec tokens, Mat out,
                          bool count, DocStarts docs) {
  const int N = x.extent(0), D = D_, T = T_, dm = d_mem_;
  const int Nn = Nn_, ker = kernel_;
  N_ = N;
  docs_ = docs;
  const Operand mem = lookup(table, tokens, count, docs);

  Mat key = as_mat(key_.data(), N, D), val = as_mat(val_.data(), N, D);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, mem, table.weight(wk_, D, dm), 0.0f, key);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, mem, table.weight(wv_, D, dm), 0.0f, val);
  add_bias(key, table.param(bk_));
  add_bias(val, table.param(bv_));

  // Gate: alpha = g(sum_d RMSNorm_k(key) RMSNorm_q(x) / sqrt(D)).
  Mat kn = as_mat(kn_.data(), N, D), qn = as_mat(qn_.data(), N, D);
  rmsnorm_forward(as_cmat(key), ConstVec(table.param(k_norm_), D), eps_, ConstMat(), kn,
                  Vec(rstd_k_.data(), N));
  rmsnorm_forward(x, ConstVec(table.param(q_norm_), D), eps_, ConstMat(), qn,
                  Vec(rstd_q_.data(), N));
  auto score = score_, gate = gate_;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  const bool signed_sqrt = signed_sqrt_;
  Mat v = as_mat(v_.data(), N, D);
  // One team per row (as RMSNorm): the dot product over the team's threads, then the scaled
  // values.
  Kokkos::parallel_for(
      "engram::gate", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int t = team.league_rank();
        float s = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, D),
            [&](int d, float& acc) { acc += kn(t, d) * qn(t, d); }, s);
        s *= inv_sqrt_d;
        float a = s;
        if (signed_sqrt) {
          const float m = math::sqrt(math::fmax(math::fabs(s), 1e-6f));
          a = s < 0.0f ? -m : m;
        }
        const float alpha = 1.0f / (1.0f + math::exp(-a));
        Kokkos::single(Kokkos::PerTeam(team), [&] {
          score(t) = s;
          gate(t) = alpha;
        });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, D),
                             [&](int d) { v(t, d) = alpha * val(t, d); });
      });
  if (stats_ && count) {  // the gate metric stays on the device: this forward's mean joins the sum
    auto gsum = stats_->device(cols_.gate);
    Kokkos::parallel_reduce(
        "engram::gate_sum", Range(0, N), KOKKOS_LAMBDA(int t, double& acc) { acc += gate(t); },
        gate_now_);
    auto now = gate_now_;
    Kokkos::parallel_for(
        "engram::gate_mean", Range(0, 1), KOKKOS_LAMBDA(int) { gsum(0) += now() / N; });
  }

  // u = RMSNorm_c(v); causal depthwise conv with dilation N within each sequence (document);
  // out = v + silu(c).
  Mat u = as_mat(u_.data(), N, D), c = as_mat(c_.data(), N, D);
  rmsnorm_forward(as_cmat(v), ConstVec(table.param(c_norm_), D), eps_, ConstMat(), u,
                  Vec(rstd_c_.data(), N));
  auto wc = as_cmat(table.param(conv_), D, ker);
  Kokkos::parallel_for(
      "engram::conv", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int r, int d) {
        const int t = r % T, first = docs(r);
        float acc = 0.0f;
        for (int i = 0; i < ker; ++i) {
          const int back = (ker - 1 - i) * Nn;
          if (t - back >= first) acc += wc(d, i) * u(r - back, d);
        }
        c(r, d) = acc;
        out(r, d) = v(r, d) + math::silu(acc);
      });
}

std::int64_t EngramLayer::workspace_bytes(const ModelCfg& m, const EngramCfg& g,
                                          std::int64_t N) {
  const std::int64_t d_mem = std::int64_t(g.max_ngram - 1) * g.embed_per_ngram;
  return 2 * Workspace::rounded(4 * N * m.d_model) + Workspace::rounded(4 * N) +
         Workspace::rounded(4 * N * d_mem);
}

void EngramLayer::backward(TensorTable& table, ConstMat x, ConstMat dout, Mat dx, Workspace& ws) {
  const int N = N_, D = D_, T = T_, dh = dh_, dm = d_mem_, Nn = Nn_, ker = kernel_;
  auto u = as_cmat(u_.data(), N, D), c = as_cmat(c_.data(), N, D);
  auto v = as_cmat(v_.data(), N, D), val = as_cmat(val_.data(), N, D);
  auto wc = as_cmat(table.param(conv_), D, ker);
  const DocStarts docs = docs_;
  Workspace::Frame frame(ws);
  Mat dc = frame.mat(N, D), du = frame.mat(N, D);

  // dc = dout * silu'(c); conv weight gradient (per (d, i), rows in order); du by gathering
  // the taps that read each position.
  Kokkos::parallel_for(
      "engram::silu_backward", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int r, int d) {
        const float z = c(r, d), sg = 1.0f / (1.0f + math::exp(-z));
        dc(r, d) = dout(r, d) * sg * (1.0f + z * (1.0f - sg));
      });
  // Columns (d, i) of the (D, ker) weight gradient, rows in a fixed order.
  column_sums(
      "engram::conv_weight_grad", N, D * ker,
      KOKKOS_LAMBDA(int r, int c) {
        const int d = c / ker, back = (ker - 1 - c % ker) * Nn;
        return r % T - back >= docs(r) ? dc(r, d) * u(r - back, d) : 0.0f;
      },
      Vec(table.grad(conv_), D * ker));
  Kokkos::parallel_for(
      "engram::conv_input_grad", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int r, int d) {
        const int t = r % T;
        float acc = 0.0f;
        for (int i = 0; i < ker; ++i) {
          const int fwd = (ker - 1 - i) * Nn;
          // position t + fwd reads t when both are in one document
          if (t + fwd < T && docs(r + fwd) <= t) acc += wc(d, i) * dc(r + fwd, d);
        }
        du(r, d) = acc;
      });
  // dv = dout + RMSNorm_c backward of du (into dc, free again).
  Mat dv = dc;
  rmsnorm_backward(v, ConstVec(table.param(c_norm_), D), ConstVec(rstd_c_.data(), N), as_cmat(du),
                   dout, dv, Vec(table.grad(c_norm_), D));

  // v = alpha * val: dval = alpha dv (into du, consumed above); dalpha = <dv, val>, then
  // through the gate to d score. Saved buffers whose last reader is done are reused below.
  auto gate = gate_, score = score_;
  const Vec dgate(frame.floats(N), N);
  const bool signed_sqrt = signed_sqrt_;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  Mat dval = du;
  Kokkos::parallel_for(
      "engram::gate_backward", row_policy(N), KOKKOS_LAMBDA(const TeamMember& team) {
        const int t = team.league_rank();
        const float alpha = gate(t);
        float dalpha = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, D),
            [&](int d, float& acc) {
              acc += dv(t, d) * val(t, d);
              dval(t, d) = alpha * dv(t, d);
            },
            dalpha);
        float ds = dalpha * alpha * (1.0f - alpha);
        if (signed_sqrt) {
          const float a = math::fabs(score(t));
          ds = a > 1e-6f ? ds * 0.5f / math::sqrt(a) : 0.0f;
        }
        // d score / d (kn . qn) folded in
        Kokkos::single(Kokkos::PerTeam(team), [&] { dgate(t) = ds * inv_sqrt_d; });
      });
  // dkn = dgate * qn, dqn = dgate * kn; written into the freed key/val-sized buffers.
  auto kn = as_cmat(kn_.data(), N, D), qn = as_cmat(qn_.data(), N, D);
  Mat dkn = as_mat(v_.data(), N, D), dqn = as_mat(u_.data(), N, D);  // v, u no longer needed
  Kokkos::parallel_for(
      "engram::score_backward", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int t, int d) {
        dkn(t, d) = dgate(t) * qn(t, d);
        dqn(t, d) = dgate(t) * kn(t, d);
      });
  rmsnorm_backward(x, ConstVec(table.param(q_norm_), D), ConstVec(rstd_q_.data(), N), as_cmat(dqn),
                   ConstMat(), dx, Vec(table.grad(q_norm_), D));
  Mat dkey = as_mat(c_.data(), N, D);  // c no longer needed
  rmsnorm_backward(as_cmat(key_.data(), N, D), ConstVec(table.param(k_norm_), D),
                   ConstVec(rstd_k_.data(), N), as_cmat(dkn), ConstMat(), dkey,
                   Vec(table.grad(k_norm_), D));

  // Projections: dW += d^T mem, db += column sums, dmem = dkey Wk + dval Wv.
  const Operand mem = mem_.matrix(N, dm);
  gemm(ctx_, Trans::T, Trans::N, 1.0f, as_cmat(dkey), mem, 1.0f, as_mat(table.grad(wk_), D, dm));
  gemm(ctx_, Trans::T, Trans::N, 1.0f, as_cmat(dval), mem, 1.0f, as_mat(table.grad(wv_), D, dm));
  add_column_sums(as_cmat(dkey), table.grad(bk_));
  add_column_sums(as_cmat(dval), table.grad(bv_));
  Mat dmem = frame.mat(N, dm);
  gemm(ctx_, Trans::N, Trans::N, 1.0f, as_cmat(dkey), table.weight(wk_, D, dm), 0.0f, dmem);
  gemm(ctx_, Trans::N, Trans::N, 1.0f, as_cmat(dval), table.weight(wv_, D, dm), 1.0f, dmem);

  if (shard_) {
    shard_->return_gradients(table, table_, dmem.data(), N * heads_total_);
    return;
  }
  if (offload_) {  // dmem is (N * Kt, dh): one row gradient per (token, head), to the host
    cache_->add_gradients(table, table_, dmem.data());
    settled_ = true;
    return;
  }
  // Table rows: (token, head) items grouped by row, summed in item order.
  const int Kt = heads_total_;
  buckets_.build(ConstIVec(rows_.data(), N * Kt));
  auto off = buckets_.offsets;
  auto ord = buckets_.order;
  auto dtab = as_mat(table.grad(table_), R_, dh);
  Kokkos::parallel_for(
      "engram::table_grad", Range2({0, 0}, {int(R_), dh}), KOKKOS_LAMBDA(int row, int i) {
        if (off(row + 1) == off(row)) return;
        float acc = 0.0f;
        for (int a = off(row); a < off(row + 1); ++a) {
          const int item = ord(a), t = item / Kt, j = item % Kt;
          acc += dmem(t, j * dh + i);
        }
        dtab(row, i) += acc;
      });
}

EngramStatColumns EngramLayer::declare_stats(StepStats& stats, int block) {
  const std::string p = "engram" + std::to_string(block);
  EngramStatColumns c;
  c.gate = stats.add(
      StatColumn::mean_per_micro_batch(p + "_gate").summarized("engram gate", StatSummary::Mean));
  c.touched = stats.add(StatColumn::sum(p + "_rows_touched"));
  return c;
}

void EngramLayer::finish_step(StepStats& stats, const DataComm& counted_over,
                              const Communicator& counted_over_mpi, bool write) const {
  if (!stats_) return;
  if (offload_) {  // the host flags: summed over the replicas, counted, the fraction added
    std::vector<float>& flags = stats.host_flags(cols_.touched, R_);
    if (counted_over_mpi.size() > 1) counted_over_mpi.allreduce_sum(flags.data(), R_);
    if (!write) return;
    std::int64_t used = 0;
    for (float f : flags) used += f > 0.0f ? 1 : 0;
    const auto acc = stats.device(cols_.touched);
    const double fraction = double(used) / double(R_);
    Kokkos::parallel_for(
        "engram::rows_touched_fraction", Range(0, 1),
        KOKKOS_LAMBDA(int) { acc(0) += fraction; });
    return;
  }
  // Flags, not counts, go over the data plane: a float sum of 0s and 1s is exact, and nonzero
  // exactly where some replica looked the row up.
  const IVec counts = stats.counters(cols_.touched, R_);
  const View1F flags = touched_;
  Kokkos::parallel_for(
      "engram::touched_flags", flat_range(0, R_),
      KOKKOS_LAMBDA(std::int64_t r) { flags(r) = counts(r) > 0 ? 1.0f : 0.0f; });
  if (counted_over.size() > 1) {
    Pending p = counted_over.start_allreduce_sum(flags.data(), R_);
    counted_over.complete(p);
  }
  if (!write) return;
  const auto used = touched_rows_;
  Kokkos::parallel_reduce(
      "engram::rows_touched", flat_range(0, R_),
      KOKKOS_LAMBDA(std::int64_t r, double& s) { s += flags(r) > 0.0f ? 1.0 : 0.0; }, used);
  const auto acc = stats.device(cols_.touched);
  const double rows = double(R_);
  Kokkos::parallel_for(
      "engram::rows_touched_fraction", Range(0, 1),
      KOKKOS_LAMBDA(int) { acc(0) += used() / rows; });
}

double EngramLayer::mean_gate() const {
  auto h = read_to_host("engram mean gate", Kokkos::subview(gate_, Kokkos::make_pair(0, N_)));
  double s = 0.0;
  for (int t = 0; t < N_; ++t) s += h(t);
  return N_ > 0 ? s / N_ : 0.0;
}

}  // namespace kmoe
