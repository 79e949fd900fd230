// An activation a forward pass keeps for its backward (MODEL.md section 8): in bf16 runs it is
// kept as bf16, half the bytes, otherwise as fp32: the precision of the run context the owner
// is built with. Operands only products read are kept as the
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
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/gemm.hpp"
#include "core/kokkos_types.hpp"
#include "core/run_context.hpp"

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
  // The same storage from element i on.
  KOKKOS_INLINE_FUNCTION KeptOut offset(std::int64_t i) const {
    return {f32 ? f32 + i : nullptr, b16 ? b16 + i : nullptr};
  }
};

// A kept value as fp32, from either storage: kernels whose inner loops should vectorize choose
// the storage once (KeptIn::b16) and run the loop on the typed pointer.
KOKKOS_INLINE_FUNCTION float kept_load(const float* p, std::int64_t i) { return p[i]; }
KOKKOS_INLINE_FUNCTION float kept_load(const std::uint16_t* p, std::int64_t i) {
  return bf16_to_float(p[i]);
}
// Its counterpart for a producing kernel: v stored as fp32, or rounded to bf16.
KOKKOS_INLINE_FUNCTION void kept_store(float* p, std::int64_t i, float v) { p[i] = v; }
KOKKOS_INLINE_FUNCTION void kept_store(std::uint16_t* p, std::int64_t i, float v) {
  p[i] = bf16_bits(v);
}

// Where a kernel reads a kept operand's values back, as fp32.
struct KeptIn {
  const float* f32 = nullptr;
  const std::uint16_t* b16 = nullptr;
  KOKKOS_INLINE_FUNCTION float get(std::int64_t i) const {
    return b16 ? bf16_to_float(b16[i]) : f32[i];
  }
};

// The buffers of one kept operand; shared by the blocks of an ActivationPool.
struct KeptStorage {
  View1F f32;
  Kokkos::View<std::uint16_t*, Layout, MemSpace> b16;
};

// The activation memory a rank's Stage instances share (RunContext::pool): objects every
// instance uses (the blocks' workspace, shared()) and, with `blocks_share` (train.recompute =
// block), what the blocks keep from a forward for its backward. Without that every saved buffer
// is its own allocation. Under recompute a block keeps only its input and runs its forward again
// just before its backward, so the blocks of every Stage instance can share their buffers: a
// Stage calls begin_block() before it builds each block, and saved_floats / saved_ints and every
// KeptOperand built with a context holding the pool then return the pool's buffer for
// (label, i), the block's i-th request with that label, so blocks of the same kind use the same
// memory. A request larger than the pool's buffer grows it (blocks built earlier keep their own,
// so nothing is ever too small); a kept operand's storage is shared, so its growth (ensure) is
// everyone's.
class ActivationPool {
 public:
  explicit ActivationPool(bool blocks_share = true) : blocks_share_(blocks_share) {}
  bool blocks_share() const { return blocks_share_; }

  // The requests that follow are the next block's: its i-th request of a label is the pool's
  // buffer (label, i) again.
  void begin_block() { seen_.clear(); }
  // Bytes the pool's saved buffers hold (shared objects not counted).
  std::int64_t bytes() const;

  std::shared_ptr<KeptStorage> kept(const std::string& label, std::int64_t n, bool bf16);
  // An object every Stage instance built on the pool shares (the blocks' backward scratch):
  // made from `args` by the first request of `key`.
  template <class T, class... A>
  std::shared_ptr<T> shared(const std::string& key, A&&... args) {
    std::shared_ptr<void>& p = objects_[key];
    if (!p) p = std::make_shared<T>(std::forward<A>(args)...);
    return std::static_pointer_cast<T>(p);
  }
  View1F floats(const std::string& label, std::int64_t n);
  View1I ints(const std::string& label, std::int64_t n);

 private:
  std::string key(const std::string& label);
  bool blocks_share_;
  std::map<std::string, int> seen_;  // requests per label in the open block
  std::map<std::string, std::shared_ptr<KeptStorage>> kept_;
  std::map<std::string, View1F> floats_;
  std::map<std::string, View1I> ints_;
  std::map<std::string, std::shared_ptr<void>> objects_;
};

// A block's saved buffer of n values: the pool's when ctx has a pool whose blocks share, else its
// own allocation.
View1F saved_floats(const RunContext& ctx, const std::string& label, std::int64_t n);
View1I saved_ints(const RunContext& ctx, const std::string& label, std::int64_t n);

class KeptOperand {
 public:
  KeptOperand() = default;
  // bf16 when ctx's precision is; fp32 whatever the precision when `may_be_bf16` is false (a
  // buffer other code reads as fp32). Pooled as saved_floats.
  KeptOperand(const RunContext& ctx, const std::string& label, std::int64_t n,
              bool may_be_bf16 = true);
  // Grows to at least n values (ensure_size: a quarter of headroom); contents not kept.
  void ensure(std::int64_t n);

  // Where the producing kernel writes, from element `offset` on.
  KeptOut out(std::int64_t offset = 0) const {
    return {bf16_ ? nullptr : f32p() + offset, bf16_ ? b16p() + offset : nullptr};
  }
  KeptIn in(std::int64_t offset = 0) const {
    return {bf16_ ? nullptr : f32p() + offset, bf16_ ? b16p() + offset : nullptr};
  }
  // Where a product writes the values this operand will keep, from element `offset` on: the
  // fp32 buffer itself, or (bf16) `staging`, which the producing kernel rounds in from.
  float* product_target(float* staging, std::int64_t offset = 0) const {
    return bf16_ ? staging : f32p() + offset;
  }
  // The (rows, cols) matrix at element `offset`.
  Operand matrix(int rows, int cols, std::int64_t offset = 0) const {
    return {bf16_ ? nullptr : f32p() + offset, bf16_ ? b16p() + offset : nullptr, rows, cols};
  }
  // A strided batch of (rows, cols) matrices `stride` elements apart.
  Strided strided(int rows, int cols, std::int64_t stride) const {
    return {bf16_ ? nullptr : f32p(), rows, cols, stride, bf16_ ? b16p() : nullptr};
  }
  bool is_bf16() const { return bf16_; }
  // The fp32 values of a buffer built with may_be_bf16 = false (or in a run without bf16).
  float* f32() const;
  // The bf16 values of a buffer kept as bf16.
  std::uint16_t* b16() const;

 private:
  float* f32p() const { return s_->f32.data(); }
  std::uint16_t* b16p() const { return s_->b16.data(); }
  std::string label_;
  bool bf16_ = false;
  std::shared_ptr<KeptStorage> s_ = std::make_shared<KeptStorage>();
};

}  // namespace kmoe
