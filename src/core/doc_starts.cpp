#include "core/doc_starts.hpp"

namespace kmoe {

void document_starts(ConstIVec tokens, int nseq, int T, int eod, View1I start) {
  // One thread per sequence walks its T ids: an O(N) pass once per micro-batch, shared by
  // every block of the stage.
  Kokkos::parallel_for(
      "doc_starts", Range(0, nseq), KOKKOS_LAMBDA(int s) {
        const std::int64_t base = std::int64_t(s) * T;
        int first = 0;
        for (int t = 0; t < T; ++t) {
          start(base + t) = first;
          if (tokens(base + t) == eod) first = t + 1;
        }
      });
}

}  // namespace kmoe
