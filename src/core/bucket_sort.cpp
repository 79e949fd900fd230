#include "core/bucket_sort.hpp"

#include "core/error.hpp"

namespace kmoe {

KeyBuckets::KeyBuckets(int max_items, int num_keys)
    : offsets("buckets::offsets", num_keys + 1),
      order("buckets::order", max_items),
      cursor_("buckets::cursor", num_keys),
      num_keys_(num_keys) {}

void KeyBuckets::build(ConstIVec keys) {
  const int n = keys.extent(0), K = num_keys_;
  KMOE_REQUIRE(n <= static_cast<int>(order.extent(0)), "KeyBuckets: " << n << " items > capacity");
  auto off = offsets, ord = order, cur = cursor_;
  Kokkos::deep_copy(cur, 0);
  Kokkos::parallel_for(
      "buckets::count", Range(0, n),
      KOKKOS_LAMBDA(int i) { Kokkos::atomic_add(&cur(keys(i)), 1); });
  Kokkos::parallel_scan(
      "buckets::offsets", Range(0, K + 1), KOKKOS_LAMBDA(int k, int& partial, bool final) {
        const int c = k < K ? cur(k) : 0;
        if (final) off(k) = partial;
        partial += c;
      });
  Kokkos::parallel_for(
      "buckets::reset_cursor", Range(0, K), KOKKOS_LAMBDA(int k) { cur(k) = off(k); });
  Kokkos::parallel_for(
      "buckets::place", Range(0, n),
      KOKKOS_LAMBDA(int i) { ord(Kokkos::atomic_fetch_add(&cur(keys(i)), 1)) = i; });
  // Placement order within a key depends on thread timing; sorting each (typically small,
  // nearly sorted) group restores increasing item order on every backend.
  Kokkos::parallel_for(
      "buckets::sort_groups", Range(0, K), KOKKOS_LAMBDA(int k) {
        for (int a = off(k) + 1; a < off(k + 1); ++a) {
          const int v = ord(a);
          int b = a - 1;
          while (b >= off(k) && ord(b) > v) {
            ord(b + 1) = ord(b);
            --b;
          }
          ord(b + 1) = v;
        }
      });
}

}  // namespace kmoe
