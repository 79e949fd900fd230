// bfloat16: the upper 16 bits of an IEEE fp32 value (sign, 8 exponent bits, 7 mantissa bits),
// the storage and GEMM-input type of train.precision = bf16 (MODEL.md section 8). Conversions
// round to nearest, ties to even, on every backend; NaN stays NaN (quiet), infinities stay,
// values above the largest bf16 round to infinity as IEEE rounding does.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/kokkos_types.hpp"

namespace kmoe {

KOKKOS_INLINE_FUNCTION std::uint16_t bf16_bits(float x) {
  std::uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0)
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // NaN: keep it quiet
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

KOKKOS_INLINE_FUNCTION float bf16_to_float(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t(b) << 16;
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// x rounded to the nearest bf16 value, as fp32 (exact: every bf16 value is an fp32 value).
KOKKOS_INLINE_FUNCTION float round_bf16(float x) { return bf16_to_float(bf16_bits(x)); }

}  // namespace kmoe
