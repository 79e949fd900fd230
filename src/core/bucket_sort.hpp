// Deterministic grouping of items by an integer key: the basis of every floating-point
// scatter-add in kmoe (embedding and expert gradients, Engram rows). Float atomics have no fixed
// order on OpenMP or GPUs; instead items are grouped by key in increasing item order, then each
// key's sum runs sequentially over its group.
//
// The grouping is a least-significant-digit radix sort of the keys (8-bit digits, as many
// passes as the key range needs), each pass a stable scatter: blocks of kBlock consecutive items
// count their digits, one scan over (digit, block) gives every block its first slot per digit,
// and each block places its items in item order. Only integer counts and a stable order per
// block, so the result is the same on every backend and thread count, and the work is
// O(items x passes) with items / kBlock independent blocks, however the keys are distributed.
// A block is one team: on CPUs its thread walks the items in order; on GPUs (device paths) its
// threads take an item each, ranked among the block's items of its digit before it
// (O(kBlock) per item in team scratch), so no launch runs on one thread.
#pragma once

#include "core/kokkos_types.hpp"

namespace kmoe {

class KeyBuckets {
 public:
  static constexpr int kDigitBits = 8;
  static constexpr int kDigits = 1 << kDigitBits;
  static constexpr int kBlock = 256;

  KeyBuckets() = default;
  KeyBuckets(int max_items, int num_keys);

  // keys: (n) in [0, num_keys). Afterwards the items with key k are
  // order(offsets(k)) .. order(offsets(k+1)-1), increasing.
  void build(ConstIVec keys);

  View1I offsets;  // (num_keys + 1)
  View1I order;    // (max_items)

 private:
  View1I sorted_keys_[2];  // (max_items) ping-pong key buffers of the passes
  View1I items_[2];        // (max_items) ping-pong item buffers; the last pass writes order
  View1I block_counts_;    // (kDigits * blocks) digit-major counts, then first slots
  View1I key_counts_;      // (num_keys)
  int num_keys_ = 0;
  int passes_ = 0;
};

}  // namespace kmoe
