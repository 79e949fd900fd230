// An activation a forward pass keeps for its backward (MODEL.md section 8): in bf16 runs it is
// kept as bf16, half the bytes, otherwise as fp32. The precision is the one set
// (GemmPrecisionScope) when the owner is built. Operands only products read are kept as the
// products would round them anyway (no number changes); values an element-wise backward reads
// too (attention probabilities, SwiGLU pre-activations) are read back rounded, forward and
// backward alike.
//
// The kernel that produces the values writes them through out().set(i, v); products read them
// as matrix() / strided() operands, element-wise kernels through in().get(i). Values a product
// produces go to product_target(staging): the kept buffer itself in fp32 runs, a caller's fp32
// staging buffer in bf16 runs, from which the next kernel rounds them in.
#pragma once

#include <cstdint>
#include <string>

#include "core/bf16.hpp"
#include "core/gemm.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

// Where a producing kernel writes a kept operand's values: fp32, or rounded to bf16.
struct KeptOut {
  float* f32 = nullptr;
  std::uint16_t* b16 = nullptr;
  KOKKOS_INLINE_FUNCTION void set(std::int64_t i, float v) const {
    if (b16)
      b16[i] = bf16_bits(v);
    else
      f32[i] = v;
  }
};

// A kept value as fp32, from either storage: kernels whose inner loops should vectorize choose
// the storage once (KeptIn::b16) and run the loop on the typed pointer.
KOKKOS_INLINE_FUNCTION float kept_load(const float* p, std::int64_t i) { return p[i]; }
KOKKOS_INLINE_FUNCTION float kept_load(const std::uint16_t* p, std::int64_t i) {
  return bf16_to_float(p[i]);
}

// Where a kernel reads a kept operand's values back, as fp32.
struct KeptIn {
  const float* f32 = nullptr;
  const std::uint16_t* b16 = nullptr;
  KOKKOS_INLINE_FUNCTION float get(std::int64_t i) const {
    return b16 ? bf16_to_float(b16[i]) : f32[i];
  }
};

class KeptOperand {
 public:
  KeptOperand() = default;
  // fp32 whatever the precision when `may_be_bf16` is false (a buffer other code reads as fp32).
  KeptOperand(const std::string& label, std::int64_t n, bool may_be_bf16 = true);
  // Grows to at least n values (ensure_size: a quarter of headroom); contents not kept.
  void ensure(std::int64_t n);

  // Where the producing kernel writes, from element `offset` on.
  KeptOut out(std::int64_t offset = 0) const {
    return {bf16_ ? nullptr : f32_.data() + offset, bf16_ ? b16_.data() + offset : nullptr};
  }
  KeptIn in(std::int64_t offset = 0) const {
    return {bf16_ ? nullptr : f32_.data() + offset, bf16_ ? b16_.data() + offset : nullptr};
  }
  // Where a product writes the values this operand will keep, from element `offset` on: the
  // fp32 buffer itself, or (bf16) `staging`, which the producing kernel rounds in from.
  float* product_target(float* staging, std::int64_t offset = 0) const {
    return bf16_ ? staging : f32_.data() + offset;
  }
  // The (rows, cols) matrix at element `offset`.
  Operand matrix(int rows, int cols, std::int64_t offset = 0) const {
    return {bf16_ ? nullptr : f32_.data() + offset, bf16_ ? b16_.data() + offset : nullptr, rows,
            cols};
  }
  // A strided batch of (rows, cols) matrices `stride` elements apart.
  Strided strided(int rows, int cols, std::int64_t stride) const {
    return {bf16_ ? nullptr : f32_.data(), rows, cols, stride, bf16_ ? b16_.data() : nullptr};
  }
  bool is_bf16() const { return bf16_; }
  // The fp32 values of a buffer built with may_be_bf16 = false (or in a run without bf16).
  float* f32() const;
  // The bf16 values of a buffer kept as bf16.
  std::uint16_t* b16() const;

 private:
  std::string label_;
  bool bf16_ = false;
  View1F f32_;
  Kokkos::View<std::uint16_t*, Layout, MemSpace> b16_;
};

}  // namespace kmoe
