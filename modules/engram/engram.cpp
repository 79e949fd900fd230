#include "modules/engram/engram.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/gemm.hpp"
#include "modules/norm/rmsnorm.hpp"

namespace kmoe {

namespace {

// Column sums in row order: dst[d] += sum_t src[t, d].
void add_column_sums(ConstMat src, float* dst_data) {
  const int N = src.extent(0), D = src.extent(1);
  Vec dst(dst_data, D);
  Kokkos::parallel_for(
      "engram::column_sums", Range(0, D), KOKKOS_LAMBDA(int d) {
        float acc = 0.0f;
        for (int t = 0; t < N; ++t) acc += src(t, d);
        dst(d) += acc;
      });
}

// Bias add: y[t, d] += b[d].
void add_bias(Mat y, const float* b_data) {
  ConstVec b(b_data, y.extent(1));
  Kokkos::parallel_for(
      "engram::bias", Range2({0, 0}, {int(y.extent(0)), int(y.extent(1))}),
      KOKKOS_LAMBDA(int t, int d) { y(t, d) += b(d); });
}

}  // namespace

EngramLayer::EngramLayer(const ModelCfg& m, const EngramCfg& g, const EngramHashPlan& plan,
                         const std::string& prefix, int max_tokens, int seq_len,
                         TensorTable& table, const Sharding& shard)
    : D_(m.d_model),
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
      buckets_(max_tokens * heads_total_, static_cast<int>(plan.rows)),
      shard_(shard) {
  const double std = g.init_std;
  // The table: no weight decay, its own learning-rate multiplier (MODEL.md section 4).
  const TensorSpec table_spec =
      TensorSpec::matrix(prefix + "table", {R_, dh_}, std).no_decay().with_lr_mult(g.lr_mult);
  P_ = shard.kind != Shard::None && shard.comm ? shard.comm->size() : 1;
  if (P_ > 1) {
    KMOE_REQUIRE(shard.data, "EngramLayer: a sharded table needs a data communicator");
    block_ = (R_ + P_ - 1) / P_;
    row0_ = std::min<std::int64_t>(R_, block_ * shard.comm->rank());
    local_rows_ = std::min<std::int64_t>(block_, R_ - row0_);
    table_ = table.add(table_spec.row_block(shard.kind, row0_, local_rows_));
    const int requests = max_tokens * heads_total_;
    owner_ = View1I("engram::owner", requests);
    by_owner_ = KeyBuckets(requests, P_);
    by_local_row_ = KeyBuckets(requests * P_, static_cast<int>(std::max<std::int64_t>(1, local_rows_)));
  } else {
    local_rows_ = R_;
    table_ = table.add(table_spec);
  }
  wk_ = table.add(TensorSpec::matrix(prefix + "wk", {D_, d_mem_}, std));
  wv_ = table.add(TensorSpec::matrix(prefix + "wv", {D_, d_mem_}, std));
  bk_ = table.add(TensorSpec::zeros(prefix + "bk", {D_}));
  bv_ = table.add(TensorSpec::zeros(prefix + "bv", {D_}));
  q_norm_ = table.add(TensorSpec::gain(prefix + "q_norm.weight", D_));
  k_norm_ = table.add(TensorSpec::gain(prefix + "k_norm.weight", D_));
  c_norm_ = table.add(TensorSpec::gain(prefix + "conv_norm.weight", D_));
  conv_ = table.add(TensorSpec::zeros(prefix + "conv", {D_, kernel_}));

  const std::int64_t N = max_tokens;
  rows_ = Kokkos::View<int**, Layout, MemSpace>("engram::rows", N, heads_total_);
  mem_ = View1F("engram::mem", N * d_mem_);
  for (View1F* v : {&key_, &val_, &kn_, &qn_, &v_, &u_, &c_, &d_a_, &d_b_})
    *v = View1F("engram::act", N * D_);
  for (View1F* v : {&rstd_k_, &rstd_q_, &rstd_c_, &score_, &gate_, &d_gate_})
    *v = View1F("engram::row", N);
  d_mem_buf_ = View1F("engram::d_mem", N * d_mem_);
  touched_ = View1I("engram::touched", R_);
  gate_sum_ = View1D("engram::gate_sum", 1);
  gate_now_ = Kokkos::View<double, MemSpace>("engram::gate_now");
}

ConstMat EngramLayer::lookup(const TensorTable& table, ConstIVec tokens) {
  const int N = tokens.extent(0), dh = dh_;
  auto rows = Kokkos::subview(rows_, Kokkos::make_pair(0, N), Kokkos::ALL);
  hasher_.rows(tokens, T_, rows_);
  auto touched = touched_;
  Kokkos::parallel_for(
      "engram::count_lookups", Range2({0, 0}, {N, heads_total_}),
      KOKKOS_LAMBDA(int t, int j) { Kokkos::atomic_add(&touched(rows(t, j)), 1); });

  // mem[t, j*dh + i] = table[row(t, j), i].
  Mat mem = as_mat(mem_.data(), N, d_mem_);
  if (P_ > 1) {
    fetch_rows(table, N);
    return as_cmat(mem);
  }
  auto tab = as_cmat(table.param(table_), R_, dh);
  Kokkos::parallel_for(
      "engram::lookup", Range2({0, 0}, {N, heads_total_}), KOKKOS_LAMBDA(int t, int j) {
        const int r = rows(t, j);
        for (int i = 0; i < dh; ++i) mem(t, j * dh + i) = tab(r, i);
      });
  return as_cmat(mem);
}

void EngramLayer::forward(const TensorTable& table, ConstMat x, ConstIVec tokens, Mat out) {
  const int N = x.extent(0), D = D_, T = T_, dm = d_mem_;
  const int Nn = Nn_, ker = kernel_;
  N_ = N;
  const ConstMat mem = lookup(table, tokens);

  Mat key = as_mat(key_.data(), N, D), val = as_mat(val_.data(), N, D);
  gemm(Trans::N, Trans::T, 1.0f, mem, as_cmat(table.param(wk_), D, dm), 0.0f, key);
  gemm(Trans::N, Trans::T, 1.0f, mem, as_cmat(table.param(wv_), D, dm), 0.0f, val);
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
  Kokkos::parallel_for(
      "engram::gate", Range(0, N), KOKKOS_LAMBDA(int t) {
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += kn(t, d) * qn(t, d);
        s *= inv_sqrt_d;
        float a = s;
        if (signed_sqrt) {
          const float m = math::sqrt(math::fmax(math::fabs(s), 1e-6f));
          a = s < 0.0f ? -m : m;
        }
        const float alpha = 1.0f / (1.0f + math::exp(-a));
        score(t) = s;
        gate(t) = alpha;
        for (int d = 0; d < D; ++d) v(t, d) = alpha * val(t, d);
      });
  // The gate metric stays on the device: this forward's mean joins the running sum.
  auto gsum = gate_sum_;
  Kokkos::parallel_reduce(
      "engram::gate_sum", Range(0, N), KOKKOS_LAMBDA(int t, double& acc) { acc += gate(t); },
      gate_now_);
  auto now = gate_now_;
  Kokkos::parallel_for(
      "engram::gate_mean", Range(0, 1), KOKKOS_LAMBDA(int) { gsum(0) += now() / N; });

  // u = RMSNorm_c(v); causal depthwise conv with dilation N within each sequence;
  // out = v + silu(c).
  Mat u = as_mat(u_.data(), N, D), c = as_mat(c_.data(), N, D);
  rmsnorm_forward(as_cmat(v), ConstVec(table.param(c_norm_), D), eps_, ConstMat(), u,
                  Vec(rstd_c_.data(), N));
  auto wc = as_cmat(table.param(conv_), D, ker);
  Kokkos::parallel_for(
      "engram::conv", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int r, int d) {
        const int t = r % T;
        float acc = 0.0f;
        for (int i = 0; i < ker; ++i) {
          const int back = (ker - 1 - i) * Nn;
          if (t - back >= 0) acc += wc(d, i) * u(r - back, d);
        }
        c(r, d) = acc;
        out(r, d) = v(r, d) + math::silu(acc);
      });
}

void EngramLayer::backward(TensorTable& table, ConstMat x, ConstMat dout, Mat dx) {
  const int N = N_, D = D_, T = T_, dh = dh_, dm = d_mem_, Nn = Nn_, ker = kernel_;
  auto u = as_cmat(u_.data(), N, D), c = as_cmat(c_.data(), N, D);
  auto v = as_cmat(v_.data(), N, D), val = as_cmat(val_.data(), N, D);
  auto wc = as_cmat(table.param(conv_), D, ker);
  Mat dc = as_mat(d_a_.data(), N, D), du = as_mat(d_b_.data(), N, D);

  // dc = dout * silu'(c); conv weight gradient (per (d, i), rows in order); du by gathering
  // the taps that read each position.
  Kokkos::parallel_for(
      "engram::silu_backward", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int r, int d) {
        const float z = c(r, d), sg = 1.0f / (1.0f + math::exp(-z));
        dc(r, d) = dout(r, d) * sg * (1.0f + z * (1.0f - sg));
      });
  auto dwc = as_mat(table.grad(conv_), D, ker);
  Kokkos::parallel_for(
      "engram::conv_weight_grad", Range2({0, 0}, {D, ker}), KOKKOS_LAMBDA(int d, int i) {
        const int back = (ker - 1 - i) * Nn;
        float acc = 0.0f;
        for (int r = 0; r < N; ++r)
          if (r % T - back >= 0) acc += dc(r, d) * u(r - back, d);
        dwc(d, i) += acc;
      });
  Kokkos::parallel_for(
      "engram::conv_input_grad", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int r, int d) {
        const int t = r % T;
        float acc = 0.0f;
        for (int i = 0; i < ker; ++i) {
          const int fwd = (ker - 1 - i) * Nn;
          if (t + fwd < T) acc += wc(d, i) * dc(r + fwd, d);
        }
        du(r, d) = acc;
      });
  // dv = dout + RMSNorm_c backward of du (into dc, free again).
  Mat dv = dc;
  rmsnorm_backward(v, ConstVec(table.param(c_norm_), D), ConstVec(rstd_c_.data(), N),
                   as_cmat(du), dout, dv, Vec(table.grad(c_norm_), D));

  // v = alpha * val: dval = alpha dv (into du, consumed above); dalpha = <dv, val>, then
  // through the gate to d score. Saved buffers whose last reader is done are reused below.
  auto gate = gate_, score = score_, dgate = d_gate_;
  const bool signed_sqrt = signed_sqrt_;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  Mat dval = du;
  Kokkos::parallel_for(
      "engram::gate_backward", Range(0, N), KOKKOS_LAMBDA(int t) {
        const float alpha = gate(t);
        float dalpha = 0.0f;
        for (int d = 0; d < D; ++d) {
          dalpha += dv(t, d) * val(t, d);
          dval(t, d) = alpha * dv(t, d);
        }
        float ds = dalpha * alpha * (1.0f - alpha);
        if (signed_sqrt) {
          const float a = math::fabs(score(t));
          ds = a > 1e-6f ? ds * 0.5f / math::sqrt(a) : 0.0f;
        }
        dgate(t) = ds * inv_sqrt_d;  // d score / d (kn . qn) folded in
      });
  // dkn = dgate * qn, dqn = dgate * kn; written into the freed key/val-sized buffers.
  auto kn = as_cmat(kn_.data(), N, D), qn = as_cmat(qn_.data(), N, D);
  Mat dkn = as_mat(v_.data(), N, D), dqn = as_mat(u_.data(), N, D);  // v, u no longer needed
  Kokkos::parallel_for(
      "engram::score_backward", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int t, int d) {
        dkn(t, d) = dgate(t) * qn(t, d);
        dqn(t, d) = dgate(t) * kn(t, d);
      });
  rmsnorm_backward(x, ConstVec(table.param(q_norm_), D), ConstVec(rstd_q_.data(), N),
                   as_cmat(dqn), ConstMat(), dx, Vec(table.grad(q_norm_), D));
  Mat dkey = as_mat(c_.data(), N, D);  // c no longer needed
  rmsnorm_backward(as_cmat(key_.data(), N, D), ConstVec(table.param(k_norm_), D),
                   ConstVec(rstd_k_.data(), N), as_cmat(dkn), ConstMat(), dkey,
                   Vec(table.grad(k_norm_), D));

  // Projections: dW += d^T mem, db += column sums, dmem = dkey Wk + dval Wv.
  auto mem = as_cmat(mem_.data(), N, dm);
  gemm(Trans::T, Trans::N, 1.0f, as_cmat(dkey), mem, 1.0f, as_mat(table.grad(wk_), D, dm));
  gemm(Trans::T, Trans::N, 1.0f, as_cmat(dval), mem, 1.0f, as_mat(table.grad(wv_), D, dm));
  add_column_sums(as_cmat(dkey), table.grad(bk_));
  add_column_sums(as_cmat(dval), table.grad(bv_));
  Mat dmem = as_mat(d_mem_buf_.data(), N, dm);
  gemm(Trans::N, Trans::N, 1.0f, as_cmat(dkey), as_cmat(table.param(wk_), D, dm), 0.0f, dmem);
  gemm(Trans::N, Trans::N, 1.0f, as_cmat(dval), as_cmat(table.param(wv_), D, dm), 1.0f, dmem);

  if (P_ > 1) {
    send_row_grads(table, as_cmat(dmem), N);
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

namespace {
void ensure(View1F& v, std::int64_t n, const char* label) {
  if (std::int64_t(v.extent(0)) < n) v = View1F(std::string(label), n + n / 4);
}
void ensure(View1I& v, std::int64_t n, const char* label) {
  if (std::int64_t(v.extent(0)) < n) v = View1I(std::string(label), n + n / 4);
}
// Row ids travel through the float data plane bit for bit (4-byte items; nothing converts).
float* as_words(int* p) { return reinterpret_cast<float*>(p); }
}  // namespace

void EngramLayer::fetch_rows(const TensorTable& table, int N) {
  const int Kt = heads_total_, dh = dh_, n_req = N * Kt;
  const std::int64_t block = block_, row0 = row0_;
  // Requests (token t, head j) = item t*Kt + j, grouped by holder in item order.
  auto rows = Kokkos::subview(rows_, Kokkos::make_pair(0, N), Kokkos::ALL);
  auto owner = owner_;
  Kokkos::parallel_for(
      "engram::owner", Range(0, n_req),
      KOKKOS_LAMBDA(int a) { owner(a) = static_cast<int>(rows(a / Kt, a % Kt) / block); });
  by_owner_.build(ConstIVec(owner_.data(), n_req));
  auto off = Kokkos::create_mirror_view_and_copy(HostSpace(), by_owner_.offsets);
  send_req_.assign(P_, 0);
  recv_req_.assign(P_, 0);
  for (int q = 0; q < P_; ++q) send_req_[q] = off(q + 1) - off(q);
  shard_.comm->all_to_all(send_req_.data(), recv_req_.data(), 1);
  std::int64_t n_in = 0;
  for (auto c : recv_req_) n_in += c;

  ensure(req_out_, n_req, "engram::req_out");
  ensure(req_in_, n_in, "engram::req_in");
  auto ord = by_owner_.order;
  auto req_out = req_out_;
  Kokkos::parallel_for(
      "engram::pack_requests", Range(0, n_req),
      KOKKOS_LAMBDA(int a) { req_out(a) = rows(ord(a) / Kt, ord(a) % Kt); });
  shard_.data->all_to_all_v(as_words(req_out_.data()), send_req_, as_words(req_in_.data()),
                            recv_req_);

  // Serve: the requested rows of the local block, in the order asked.
  ensure(rows_in_, n_in * dh, "engram::rows_in");
  ensure(rows_out_, std::int64_t(n_req) * dh, "engram::rows_out");
  auto tab = as_cmat(table.param(table_), std::max<std::int64_t>(1, local_rows_), dh);
  auto req_in = req_in_;
  auto served = as_mat(rows_in_.data(), std::max<std::int64_t>(1, n_in), dh);
  Kokkos::parallel_for(
      "engram::serve_rows", Range2({0, 0}, {int(n_in), dh}),
      KOKKOS_LAMBDA(int a, int i) { served(a, i) = tab(req_in(a) - row0, i); });
  std::vector<std::int64_t> back_send(P_), back_recv(P_);
  for (int q = 0; q < P_; ++q) {
    back_send[q] = recv_req_[q] * dh;
    back_recv[q] = send_req_[q] * dh;
  }
  shard_.data->all_to_all_v(rows_in_.data(), back_send, rows_out_.data(), back_recv);

  // Place: reply a belongs to request ord(a).
  Mat mem = as_mat(mem_.data(), N, d_mem_);
  auto got = as_cmat(rows_out_.data(), std::max(1, n_req), dh);
  Kokkos::parallel_for(
      "engram::place_rows", Range2({0, 0}, {n_req, dh}), KOKKOS_LAMBDA(int a, int i) {
        const int item = ord(a);
        mem(item / Kt, (item % Kt) * dh + i) = got(a, i);
      });
}

void EngramLayer::send_row_grads(TensorTable& table, ConstMat dmem, int N) {
  const int Kt = heads_total_, dh = dh_, n_req = N * Kt;
  std::int64_t n_in = 0;
  for (auto c : recv_req_) n_in += c;
  // The requests' gradients in holder order (the order of the forward's requests) ...
  auto ord = by_owner_.order;
  auto out = as_mat(rows_out_.data(), std::max(1, n_req), dh);
  Kokkos::parallel_for(
      "engram::pack_row_grads", Range2({0, 0}, {n_req, dh}), KOKKOS_LAMBDA(int a, int i) {
        const int item = ord(a);
        out(a, i) = dmem(item / Kt, (item % Kt) * dh + i);
      });
  std::vector<std::int64_t> sc(P_), rc(P_);
  for (int q = 0; q < P_; ++q) {
    sc[q] = send_req_[q] * dh;
    rc[q] = recv_req_[q] * dh;
  }
  shard_.data->all_to_all_v(rows_out_.data(), sc, rows_in_.data(), rc);
  // ... summed per local row over the received requests in arrival order (member, then item).
  const std::int64_t row0 = row0_;
  auto req_in = req_in_;
  auto local = owner_;  // free again: reused as the received requests' local rows
  ensure(local, n_in, "engram::owner");
  owner_ = local;
  Kokkos::parallel_for(
      "engram::local_rows", Range(0, int(n_in)),
      KOKKOS_LAMBDA(int a) { local(a) = static_cast<int>(req_in(a) - row0); });
  by_local_row_.build(ConstIVec(local.data(), n_in));
  auto loff = by_local_row_.offsets;
  auto lord = by_local_row_.order;
  auto in = as_cmat(rows_in_.data(), std::max<std::int64_t>(1, n_in), dh);
  auto dtab = as_mat(table.grad(table_), std::max<std::int64_t>(1, local_rows_), dh);
  Kokkos::parallel_for(
      "engram::table_grad_sharded", Range2({0, 0}, {int(local_rows_), dh}),
      KOKKOS_LAMBDA(int row, int i) {
        if (loff(row + 1) == loff(row)) return;
        float acc = 0.0f;
        for (int a = loff(row); a < loff(row + 1); ++a) acc += in(lord(a), i);
        dtab(row, i) += acc;
      });
}

double EngramLayer::take_gate_sum() const {
  // Read before the reset: on a host backend the mirror is the view itself.
  const double sum = Kokkos::create_mirror_view_and_copy(HostSpace(), gate_sum_)(0);
  Kokkos::deep_copy(gate_sum_, 0.0);
  return sum;
}

double EngramLayer::mean_gate() const {
  auto h = Kokkos::create_mirror_view_and_copy(
      HostSpace(), Kokkos::subview(gate_, Kokkos::make_pair(0, N_)));
  double s = 0.0;
  for (int t = 0; t < N_; ++t) s += h(t);
  return N_ > 0 ? s / N_ : 0.0;
}

}  // namespace kmoe
