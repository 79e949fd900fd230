#include "core/doc_starts.hpp"

namespace kmoe {

void document_starts(ConstIVec tokens, int nseq, int T, int eod, View1I start) {
  // One thread per sequence walks its T ids: an O(N) pass once per micro-batch, shared by
  // every block of the stage.
  Kokkos::parallel_for(
      "doc_starts", Range(0, nseq), KOKKOS_LAMBDA(int s) {
        const std::int64_t base = std::int64_t(s) * T;
        walk_documents([&](int t) { return tokens(base + t); }, T, eod,
                       [&](int t, int first) { start(base + t) = first; });
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

}  // namespace kmoe
