// Deterministic grouping of items by an integer key: the basis of every floating-point
// scatter-add in kmoe (embedding and expert gradients, Engram rows). Float atomics have no fixed
// order on OpenMP or GPUs; instead items are grouped by key in increasing item order, then each
// key's sum runs sequentially over its group. Integer atomics only count and place.
#pragma once

#include "core/kokkos_types.hpp"

namespace kmoe {

class KeyBuckets {
 public:
  KeyBuckets() = default;
  KeyBuckets(int max_items, int num_keys);

  // keys: (n) in [0, num_keys). Afterwards the items with key k are
  // order(offsets(k)) .. order(offsets(k+1)-1), increasing.
  void build(ConstIVec keys);

  View1I offsets;  // (num_keys + 1)
  View1I order;    // (max_items)

 private:
  View1I cursor_;  // (num_keys)
  int num_keys_ = 0;
};

}  // namespace kmoe
