#include "core/bucket_sort.hpp"

#include "core/error.hpp"

namespace kmoe {

namespace {
using ScratchI = Kokkos::View<int*, ExecSpace::scratch_memory_space, Unmanaged>;

// A team per block of kBlock items, with `ints` ints of team scratch.
TeamPolicy block_teams(int blocks, int ints) {
  return team_policy(blocks).set_scratch_size(0, Kokkos::PerTeam(ScratchI::shmem_size(ints)));
}
}  // namespace

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
  // A block is a team: on CPUs one thread walks its items in order; with device paths the
  // team's threads take an item each, its slot from the items of its digit before it in the
  // block (the same stable order, so the same result).
  const bool walk = !device_paths();
  for (int pass = 0; pass < passes_; ++pass) {
    const int shift = pass * kDigitBits;
    const bool first = pass == 0, last = pass == passes_ - 1;
    // Pass input: the keys themselves and items 0..n-1, or the previous pass's output.
    const ConstIVec in_keys = first ? keys : ConstIVec(sorted_keys_[(pass + 1) % 2].data(), n);
    const ConstIVec in_items = first ? ConstIVec() : ConstIVec(items_[(pass + 1) % 2].data(), n);
    const IVec out_keys(last ? nullptr : sorted_keys_[pass % 2].data(), last ? 0 : n);
    const IVec out_items(last ? ord.data() : items_[pass % 2].data(), n);

    // Digit counts per block (integer atomics in team scratch: exact), digit-major so one scan
    // orders slots by (digit, block).
    Kokkos::parallel_for(
        "buckets::block_counts", block_teams(blocks, kDigits), KOKKOS_LAMBDA(const TeamMember& tm) {
          const int b = tm.league_rank();
          const int begin = b * kBlock, end = (b + 1) * kBlock < n ? (b + 1) * kBlock : n;
          ScratchI local(tm.team_scratch(0), kDigits);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kDigits), [&](int d) { local(d) = 0; });
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, begin, end), [&](int i) {
            Kokkos::atomic_add(&local((in_keys(i) >> shift) & (kDigits - 1)), 1);
          });
          tm.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kDigits), [&](int d) {
            counts(static_cast<size_t>(d) * blocks + b) = local(d);
          });
        });
    Kokkos::parallel_scan(
        "buckets::block_slots", Range(0, kDigits * blocks),
        KOKKOS_LAMBDA(int j, int& partial, bool final) {
          const int c = counts(j);
          if (final) counts(j) = partial;
          partial += c;
        });
    // Stable scatter: each block's items from its first slot per digit, in item order.
    Kokkos::parallel_for(
        "buckets::scatter", block_teams(blocks, kDigits + kBlock),
        KOKKOS_LAMBDA(const TeamMember& tm) {
          const int b = tm.league_rank();
          const int begin = b * kBlock, end = (b + 1) * kBlock < n ? (b + 1) * kBlock : n;
          ScratchI scratch(tm.team_scratch(0), kDigits + kBlock);  // slots, then digits
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, kDigits), [&](int d) {
            scratch(d) = counts(static_cast<size_t>(d) * blocks + b);
          });
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, begin, end), [&](int i) {
            scratch(kDigits + i - begin) = (in_keys(i) >> shift) & (kDigits - 1);
          });
          tm.team_barrier();
          if (walk) {
            Kokkos::single(Kokkos::PerTeam(tm), [&]() {
              for (int i = begin; i < end; ++i) {
                const int s = scratch(scratch(kDigits + i - begin))++;
                out_items(s) = first ? i : in_items(i);
                if (!last) out_keys(s) = in_keys(i);
              }
            });
            return;
          }
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, begin, end), [&](int i) {
            const int d = scratch(kDigits + i - begin);
            int rank = 0;
            for (int j = kDigits; j < kDigits + i - begin; ++j) rank += scratch(j) == d ? 1 : 0;
            const int s = scratch(d) + rank;
            out_items(s) = first ? i : in_items(i);
            if (!last) out_keys(s) = in_keys(i);
          });
        });
  }
}

}  // namespace kmoe
