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

}  // namespace kmoe
