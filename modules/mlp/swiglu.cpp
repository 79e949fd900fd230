#include "modules/mlp/swiglu.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/fault_injection.hpp"
#include "core/gemm.hpp"

namespace kmoe {

namespace {
// The element-wise math, shared by the kernels and the host-thread forms.
KOKKOS_INLINE_FUNCTION float swiglu_value(float a, float b) { return math::silu(a) * b; }
// curv: 1, or 0 under KMOE_FAULT=drop_silu_curvature (a planted one-term gradient bug that the
// finite-difference and reference tests must catch: silu' without its a s (1 - s) term).
KOKKOS_INLINE_FUNCTION void swiglu_grads(float a, float b, float dy, float curv, float& da,
                                         float& db) {
  const float sg = math::sigmoid(a);
  da = dy * b * sg * (1.0f + curv * a * (1.0f - sg));  // silu' = s (1 + a (1 - s))
  db = dy * a * sg;
}
float silu_curvature() {
  static const float curv = fault_requested("drop_silu_curvature") ? 0.0f : 1.0f;
  return curv;
}
}  // namespace

// One team per row, its threads over the features: coalesced on GPUs; on CPUs a one-thread
// team's contiguous inner loop, which vectorizes (exp_poly is branch-free).
void swiglu_activate(const float* a_data, const float* b_data, int ld, int N, int F,
                     KeptOut act, KeptOut keep_a, KeptOut keep_b) {
  const bool round = keep_a.b16 != nullptr;
  Kokkos::parallel_for(
      "swiglu::activate", row_policy(N), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank();
        const std::int64_t x = std::int64_t(r) * ld, y = std::int64_t(r) * F;
        const float* a = a_data + x;
        const float* b = b_data + x;
        if (!round) {
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, F),
                               [&](int f) { act.set(y + f, swiglu_value(a[f], b[f])); });
          return;
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, F), [&](int f) {
          const std::uint16_t ab = bf16_bits(a[f]), bb = bf16_bits(b[f]);
          keep_a.b16[x + f] = ab;
          keep_b.b16[x + f] = bb;
          act.set(y + f, swiglu_value(bf16_to_float(ab), bf16_to_float(bb)));
        });
      });
}

namespace {
// One row's SwiGLU backward from a and b as stored (fp32 or bf16 pointers, row start applied).
// da, db: the row's outputs, fp32 or bf16 (rounded as written).
template <class P, class Q>
KOKKOS_INLINE_FUNCTION void swiglu_row_backward(const TeamMember& tm, int F, P a, P b,
                                                const float* dy, float curv, Q da, Q db) {
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, F), [&](int f) {
    float ga, gb;
    swiglu_grads(kept_load(a, f), kept_load(b, f), dy[f], curv, ga, gb);
    kept_store(da, f, ga);
    kept_store(db, f, gb);
  });
}
}  // namespace

void swiglu_activate_backward(KeptIn a, KeptIn b, int ld, ConstMat d_act, KeptOut da, KeptOut db,
                              int ld_out) {
  KMOE_REQUIRE((a.b16 == nullptr) == (b.b16 == nullptr),
               "swiglu backward: one pre-activation kept as bf16, the other as fp32");
  KMOE_REQUIRE((da.b16 == nullptr) == (db.b16 == nullptr),
               "swiglu backward: one gradient written as bf16, the other as fp32");
  const int N = d_act.extent(0), F = d_act.extent(1);
  const float curv = silu_curvature();
  Kokkos::parallel_for(
      "swiglu::activate_backward", row_policy(N), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank();
        const std::int64_t x = std::int64_t(r) * ld, o = std::int64_t(r) * ld_out;
        const float* dy = &d_act(r, 0);
        // The storage of each side chosen once per row: the inner loops stay plain.
        if (a.b16 && da.b16)
          swiglu_row_backward(tm, F, a.b16 + x, b.b16 + x, dy, curv, da.b16 + o, db.b16 + o);
        else if (a.b16)
          swiglu_row_backward(tm, F, a.b16 + x, b.b16 + x, dy, curv, da.f32 + o, db.f32 + o);
        else if (da.b16)
          swiglu_row_backward(tm, F, a.f32 + x, b.f32 + x, dy, curv, da.b16 + o, db.b16 + o);
        else
          swiglu_row_backward(tm, F, a.f32 + x, b.f32 + x, dy, curv, da.f32 + o, db.f32 + o);
      });
}

void swiglu_activate_here(const float* a, const float* b, int ld, int N, int F, float* act) {
  for (int r = 0; r < N; ++r) {
    const float* ar = a + std::int64_t(r) * ld;
    const float* br = b + std::int64_t(r) * ld;
    float* y = act + std::int64_t(r) * F;
    for (int f = 0; f < F; ++f) y[f] = swiglu_value(ar[f], br[f]);
  }
}

void swiglu_activate_backward_here(const float* a, const float* b, int ld, const float* d_act,
                                   int N, int F, float* da, float* db, int ld_out) {
  const float curv = silu_curvature();
  for (int r = 0; r < N; ++r) {
    const std::int64_t x = std::int64_t(r) * ld, o = std::int64_t(r) * ld_out;
    const float* dy = d_act + std::int64_t(r) * F;
    for (int f = 0; f < F; ++f)
      swiglu_grads(a[x + f], b[x + f], dy[f], curv, da[o + f], db[o + f]);
  }
}

std::int64_t SwigluMlp::workspace_bytes(std::int64_t rows, int hidden, bool bf16) {
  const std::int64_t up = Workspace::rounded(4 * rows * 2 * hidden);
  return std::max(bf16 ? up : 0, Workspace::rounded(4 * rows * hidden) + up);
}

SwigluMlp::SwigluMlp(const RunContext& ctx, const std::string& prefix, const ModelCfg& m,
                     int hidden, std::int64_t max_rows, TensorTable& table)
    : ctx_(ctx.unpooled()), D_(m.d_model), F_(hidden) {
  const double in_std = m.matrix_std(D_), out_std = m.matrix_std(F_, /*output=*/true);
  w1_ = table.add(TensorSpec::matrix(prefix + "w1", {F_, D_}, in_std).gemm_weight());
  table.add(TensorSpec::matrix(prefix + "w3", {F_, D_}, in_std).gemm_weight());
  w2_ = table.add(TensorSpec::matrix(prefix + "w2", {D_, F_}, out_std).gemm_weight());
  up_ = KeptOperand(ctx, "mlp::up", max_rows * 2 * F_);
  act_ = KeptOperand(ctx, "mlp::act", max_rows * F_);
}

void SwigluMlp::forward(const TensorTable& table, const Operand& x, Mat y, Workspace& ws) {
  const int N = x.rows;
  Workspace::Frame frame(ws);
  float* staging = up_.is_bf16() ? frame.floats(std::int64_t(N) * 2 * F_) : nullptr;
  Mat up = as_mat(up_.product_target(staging), N, 2 * F_);
  gemm(ctx_, Trans::N, Trans::T, 1.0f, x, table.weight(w1_, 2 * F_, D_), 0.0f, up);
  swiglu_activate(up.data(), up.data() + F_, 2 * F_, N, F_, act_.out(), up_.out(), up_.out(F_));
  gemm(ctx_, Trans::N, Trans::T, 1.0f, act_.matrix(N, F_), table.weight(w2_, D_, F_), 0.0f, y);
}

void SwigluMlp::backward(TensorTable& table, const Operand& x, const Operand& dy, Mat dx,
                         Workspace& ws) {
  const int N = x.rows;
  Workspace::Frame frame(ws);
  Mat d_act = frame.mat(N, F_);
  // d up is read only by the two products: in bf16 runs the kernel writes it rounded, once.
  const std::int64_t n_up = std::int64_t(N) * 2 * F_;
  float* d_up = frame.floats(ctx_.bf16() ? (n_up + 1) / 2 : n_up);
  const KeptOut d_up_out = ctx_.bf16() ? KeptOut{nullptr, reinterpret_cast<std::uint16_t*>(d_up)}
                                       : KeptOut{d_up, nullptr};
  const Operand d_up_in{d_up_out.f32, d_up_out.b16, N, 2 * F_};
  gemm(ctx_, Trans::T, Trans::N, 1.0f, dy, act_.matrix(N, F_), 1.0f, as_mat(table.grad(w2_), D_, F_));
  gemm(ctx_, Trans::N, Trans::N, 1.0f, dy, table.weight(w2_, D_, F_), 0.0f, d_act);
  swiglu_activate_backward(up_.in(), up_.in(F_), 2 * F_, as_cmat(d_act), d_up_out,
                           d_up_out.offset(F_), 2 * F_);
  gemm(ctx_, Trans::T, Trans::N, 1.0f, d_up_in, x, 1.0f, as_mat(table.grad(w1_), 2 * F_, D_));
  gemm(ctx_, Trans::N, Trans::N, 1.0f, d_up_in, table.weight(w1_, 2 * F_, D_), 0.0f, dx);
}

}  // namespace kmoe
