// Document boundaries inside the sequences of a micro-batch (train.document_mask, MODEL.md
// section 1): for each row, the position within its sequence where its document starts. A
// position reads no earlier position than that one, in attention and in Engram.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kokkos_types.hpp"

namespace kmoe {

struct DocStarts {
  ConstIVec start;  // (rows) positions within the sequence; empty: every document is the sequence
  int shift = 0;    // subtracted (at least 0 remains): rows that begin `shift` positions late
  // Host memory, for planning on the host what the device will compute (blocked attention skips
  // the keys before a query tile's document): tile_start[s * tiles + i] = start(s * T + i *
  // tile_rows), `tiles` tiles of `tile_rows` per sequence, no shift. nullptr: not planned.
  const int* tile_start = nullptr;
  int tile_rows = 0, tiles = 0;

  bool empty() const { return start.data() == nullptr; }
  KOKKOS_INLINE_FUNCTION int operator()(int row) const {
    if (start.data() == nullptr) return 0;
    const int s = start(row) - shift;
    return s > 0 ? s : 0;
  }
  // Rows [first, first + n) as a sequence that begins at row `first`.
  DocStarts window(int first, int n) const {
    if (empty()) return DocStarts();
    return DocStarts{ConstIVec(start.data() + first, n), shift + first};  // no tile plan
  }
};

// Walks one sequence of T ids: emit(t, start of t's document), t = 0 .. T-1, where a document
// starts at 0 or one past an `eod`. The device kernel and the host plan share it.
template <class Ids, class Emit>
KOKKOS_INLINE_FUNCTION void walk_documents(const Ids& ids, int T, int eod, const Emit& emit) {
  int first = 0;
  for (int t = 0; t < T; ++t) {
    emit(t, first);
    if (ids(t) == eod) first = t + 1;
  }
}

// start(s * T + t) = the position within sequence s of the first token of t's document: 0, or
// one past the last `eod` at a position before t. nseq sequences of T ids.
void document_starts(ConstIVec tokens, int nseq, int T, int eod, View1I start);

// The same on the host ids, into host memory: start[s * T + t] (engram.offload = host).
void document_starts_host(const std::int32_t* tokens, int nseq, int T, int eod, int* start);

// The same on the host ids, kept only at the first row of each tile of `tile_rows` positions:
// out[s * tiles + i] = start(s * T + i * tile_rows), tiles = ceil(T / tile_rows).
void document_tile_starts(const std::int32_t* tokens, int nseq, int T, int eod, int tile_rows,
                          std::vector<int>& out);

}  // namespace kmoe
