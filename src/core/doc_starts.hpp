// Document boundaries inside the sequences of a micro-batch (train.document_mask, MODEL.md
// section 1): for each row, the position within its sequence where its document starts. A
// position reads no earlier position than that one, in attention and in Engram.
#pragma once

#include "core/kokkos_types.hpp"

namespace kmoe {

struct DocStarts {
  ConstIVec start;  // (rows) positions within the sequence; empty: every document is the sequence
  int shift = 0;    // subtracted (at least 0 remains): rows that begin `shift` positions late

  bool empty() const { return start.data() == nullptr; }
  KOKKOS_INLINE_FUNCTION int operator()(int row) const {
    if (start.data() == nullptr) return 0;
    const int s = start(row) - shift;
    return s > 0 ? s : 0;
  }
  // Rows [first, first + n) as a sequence that begins at row `first`.
  DocStarts window(int first, int n) const {
    if (empty()) return DocStarts();
    return DocStarts{ConstIVec(start.data() + first, n), shift + first};
  }
};

// start(s * T + t) = the position within sequence s of the first token of t's document: 0, or
// one past the last `eod` at a position before t. nseq sequences of T ids.
void document_starts(ConstIVec tokens, int nseq, int T, int eod, View1I start);

}  // namespace kmoe
