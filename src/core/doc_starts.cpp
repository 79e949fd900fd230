#include "core/doc_starts.hpp"

namespace kmoe {

void document_starts(ConstIVec tokens, int nseq, int T, int eod, View1I start) {
  // One team per sequence, its threads over chunks of kChunk positions: each chunk's last
  // `eod` into team scratch, then each chunk takes its first document start from the nearest
  // earlier chunk that has one and walks its own positions. An integer maximum in effect: the
  // same result in any order. Once per micro-batch, shared by every block of the stage.
  constexpr int kChunk = 64;
  const int chunks = (T + kChunk - 1) / kChunk;
  using Scratch = Kokkos::View<int*, ExecSpace::scratch_memory_space, Unmanaged>;
  Kokkos::parallel_for(
      "doc_starts", team_policy(nseq).set_scratch_size(0, Kokkos::PerTeam(Scratch::shmem_size(chunks))),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const std::int64_t base = std::int64_t(tm.league_rank()) * T;
        const Scratch last(tm.team_scratch(0), chunks);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, chunks), [&](int c) {
          const int t1 = (c + 1) * kChunk < T ? (c + 1) * kChunk : T;
          int at = -1;
          for (int t = c * kChunk; t < t1; ++t)
            if (tokens(base + t) == eod) at = t;
          last(c) = at;
        });
        tm.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, chunks), [&](int c) {
          int first = 0;
          for (int b = c - 1; b >= 0; --b)
            if (last(b) >= 0) {
              first = last(b) + 1;
              break;
            }
          const int t1 = (c + 1) * kChunk < T ? (c + 1) * kChunk : T;
          for (int t = c * kChunk; t < t1; ++t) {
            start(base + t) = first;
            if (tokens(base + t) == eod) first = t + 1;
          }
        });
      });
}

void document_tile_starts(const std::int32_t* tokens, int nseq, int T, int eod, int tile_rows,
                          std::vector<int>& out) {
  const int tiles = (T + tile_rows - 1) / tile_rows;
  out.assign(std::size_t(nseq) * tiles, 0);
  for (int s = 0; s < nseq; ++s) {
    // Host and device lambdas (walk_documents is a host and device function), capturing
    // pointers by value.
    const std::int32_t* ids = tokens + std::int64_t(s) * T;
    int* row = out.data() + std::size_t(s) * tiles;
    walk_documents(
        KOKKOS_LAMBDA(int t) { return int(ids[t]); }, T, eod, KOKKOS_LAMBDA(int t, int first) {
          if (t % tile_rows == 0) row[t / tile_rows] = first;
        });
  }
}

void document_starts_host(const std::int32_t* tokens, int nseq, int T, int eod, int* start) {
  for (int s = 0; s < nseq; ++s) {
    const std::int32_t* ids = tokens + std::int64_t(s) * T;
    int* row = start + std::int64_t(s) * T;
    walk_documents(
        KOKKOS_LAMBDA(int t) { return int(ids[t]); }, T, eod,
        KOKKOS_LAMBDA(int t, int first) { row[t] = first; });
  }
}

}  // namespace kmoe
