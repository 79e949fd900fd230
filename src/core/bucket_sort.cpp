#include "core/bucket_sort.hpp"

#include "core/error.hpp"

namespace kmoe {

KeyBuckets::KeyBuckets(int max_items, int num_keys)
    : offsets("buckets::offsets", num_keys + 1),
      order("buckets::order", max_items),
      block_counts_("buckets::block_counts",
                    static_cast<size_t>(kDigits) * ((max_items + kBlock - 1) / kBlock)),
      key_counts_("buckets::key_counts", num_keys),
      num_keys_(num_keys) {
  for (int largest = num_keys - 1; largest > 0; largest >>= kDigitBits) ++passes_;
  for (int b = 0; b < 2; ++b) {
    sorted_keys_[b] = View1I("buckets::sorted_keys", passes_ > 1 ? max_items : 0);
    items_[b] = View1I("buckets::items", passes_ > 1 ? max_items : 0);
  }
}

void KeyBuckets::build(ConstIVec keys) {
  const int n = keys.extent(0), K = num_keys_;
  KMOE_REQUIRE(n <= static_cast<int>(order.extent(0)), "KeyBuckets: " << n << " items > capacity");

  // Offsets: a count per key (integer atomics: exact on every backend) and one scan.
  auto off = offsets, cnt = key_counts_;
  Kokkos::deep_copy(ExecSpace(), cnt, 0);
  Kokkos::parallel_for(
      "buckets::count", Range(0, n),
      KOKKOS_LAMBDA(int i) { Kokkos::atomic_add(&cnt(keys(i)), 1); });
  Kokkos::parallel_scan(
      "buckets::offsets", Range(0, K + 1), KOKKOS_LAMBDA(int k, int& partial, bool final) {
        const int c = k < K ? cnt(k) : 0;
        if (final) off(k) = partial;
        partial += c;
      });

  // One key (or none): every item in item order.
  auto ord = order;
  if (passes_ == 0) {
    Kokkos::parallel_for(
        "buckets::identity", Range(0, n), KOKKOS_LAMBDA(int i) { ord(i) = i; });
    return;
  }

  const int blocks = (n + kBlock - 1) / kBlock;
  auto counts = block_counts_;
  for (int pass = 0; pass < passes_; ++pass) {
    const int shift = pass * kDigitBits;
    const bool first = pass == 0, last = pass == passes_ - 1;
    // Pass input: the keys themselves and items 0..n-1, or the previous pass's output.
    const ConstIVec in_keys = first ? keys : ConstIVec(sorted_keys_[(pass + 1) % 2].data(), n);
    const ConstIVec in_items = first ? ConstIVec() : ConstIVec(items_[(pass + 1) % 2].data(), n);
    const IVec out_keys(last ? nullptr : sorted_keys_[pass % 2].data(), last ? 0 : n);
    const IVec out_items(last ? ord.data() : items_[pass % 2].data(), n);

    // Digit counts per block, digit-major so one scan orders slots by (digit, block).
    Kokkos::parallel_for(
        "buckets::block_counts", Range(0, blocks), KOKKOS_LAMBDA(int b) {
          int local[kDigits];
          for (int d = 0; d < kDigits; ++d) local[d] = 0;
          const int end = (b + 1) * kBlock < n ? (b + 1) * kBlock : n;
          for (int i = b * kBlock; i < end; ++i) ++local[(in_keys(i) >> shift) & (kDigits - 1)];
          for (int d = 0; d < kDigits; ++d) counts(static_cast<size_t>(d) * blocks + b) = local[d];
        });
    Kokkos::parallel_scan(
        "buckets::block_slots", Range(0, kDigits * blocks),
        KOKKOS_LAMBDA(int j, int& partial, bool final) {
          const int c = counts(j);
          if (final) counts(j) = partial;
          partial += c;
        });
    // Stable scatter: each block walks its items in order from its first slot per digit.
    Kokkos::parallel_for(
        "buckets::scatter", Range(0, blocks), KOKKOS_LAMBDA(int b) {
          int slot[kDigits];
          for (int d = 0; d < kDigits; ++d) slot[d] = counts(static_cast<size_t>(d) * blocks + b);
          const int end = (b + 1) * kBlock < n ? (b + 1) * kBlock : n;
          for (int i = b * kBlock; i < end; ++i) {
            const int key = in_keys(i);
            const int s = slot[(key >> shift) & (kDigits - 1)]++;
            out_items(s) = first ? i : in_items(i);
            if (!last) out_keys(s) = key;
          }
        });
  }
}

}  // namespace kmoe
