// RoPE, NeoX half-split layout (MODEL.md section 1): for a head vector u of width dh and
// position p, u'[i] = u[i] c - u[i+dh/2] s, u'[i+dh/2] = u[i+dh/2] c + u[i] s, with the angle
// p * theta^(-2i/dh) computed in double and rounded to fp32 once into these tables.
#pragma once

#include "core/kokkos_types.hpp"

namespace kmoe {

struct RopeTables {
  View2F cos, sin;  // (T, dh/2)
  RopeTables(int seq_len, int head_dim, double theta);
};

// Rotate the pair (a, b) = (u[i], u[i+dh/2]) forward, or backward (the transpose: gradients).
KOKKOS_INLINE_FUNCTION void rope_rotate(float& a, float& b, float c, float s) {
  const float a2 = a * c - b * s;
  b = b * c + a * s;
  a = a2;
}
KOKKOS_INLINE_FUNCTION void rope_rotate_transpose(float& a, float& b, float c, float s) {
  const float a2 = a * c + b * s;
  b = b * c - a * s;
  a = a2;
}

// QK-norm over the whole projected q and k of one qkv row, then RoPE at position t, by a
// team: store(is_q, h, i, a0, a1) takes head h's rotated pair (i, i + dh/2) of q or k. sq, sk:
// the rows' 1/rms (1 without QK-norm). Shared by attention's forward() and
// decode() (and the test oracle tests/unit/full_attention).
struct NormRope {
  int H, Hkv, dh;
  float eps;
  bool qk_norm;
  const float* gq;
  const float* gk;
  View2F cs, sn;

  template <class Store>
  KOKKOS_INLINE_FUNCTION void operator()(const TeamMember& team, const Mat& qkv, int r, int t,
                                         float& sq, float& sk, const Store& store) const {
    const int qd = H * dh, kd = Hkv * dh, half = dh / 2;
    sq = 1.0f;
    sk = 1.0f;
    if (qk_norm) {
      float ssq = 0.0f, ssk = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, qd),
          [&](int c, float& acc) { acc += qkv(r, c) * qkv(r, c); }, ssq);
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, kd),
          [&](int c, float& acc) { acc += qkv(r, qd + c) * qkv(r, qd + c); }, ssk);
      sq = math::rsqrt(ssq / qd + eps);
      sk = math::rsqrt(ssk / kd + eps);
    }
    const float q_scale = sq, k_scale = sk;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (H + Hkv) * half), [&](int j) {
      const bool is_q = j < H * half;
      const int jj = is_q ? j : j - H * half, h = jj / half, i = jj % half;
      const int w0 = h * dh + i;  // column within q or k
      const int c0 = (is_q ? 0 : qd) + w0;
      const float rs = is_q ? q_scale : k_scale;
      float a0 = qkv(r, c0) * rs, a1 = qkv(r, c0 + half) * rs;
      if (qk_norm) {
        a0 *= is_q ? gq[w0] : gk[w0];
        a1 *= is_q ? gq[w0 + half] : gk[w0 + half];
      }
      rope_rotate(a0, a1, cs(t, i), sn(t, i));
      store(is_q, h, i, a0, a1);
    });
  }
};

}  // namespace kmoe
