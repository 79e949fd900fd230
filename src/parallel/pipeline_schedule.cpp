#include "parallel/pipeline_schedule.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace kmoe {

std::vector<PipeOp> pipeline_schedule(PipeSchedule kind, int P, int s, int M) {
  KMOE_REQUIRE(P >= 1 && s >= 0 && s < P && M >= 1,
               "pipeline_schedule: stage " << s << " of " << P << ", " << M << " micro-batches");
  std::vector<PipeOp> ops;
  if (P == 1) {
    for (int i = 0; i < M; ++i) {
      ops.push_back({true, i});
      ops.push_back({false, i});
    }
  } else if (kind == PipeSchedule::GPipe) {
    for (int i = 0; i < M; ++i) ops.push_back({true, i});
    for (int i = 0; i < M; ++i) ops.push_back({false, i});
  } else {
    const int warmup = std::min(P - s - 1, M);
    for (int i = 0; i < warmup; ++i) ops.push_back({true, i});
    for (int i = 0; i < M - warmup; ++i) {
      ops.push_back({true, warmup + i});
      ops.push_back({false, i});
    }
    for (int i = M - warmup; i < M; ++i) ops.push_back({false, i});
  }
  return ops;
}

int max_in_flight(const std::vector<PipeOp>& ops) {
  int live = 0, most = 0;
  for (const PipeOp& op : ops) {
    live += op.forward ? 1 : -1;
    most = std::max(most, live);
  }
  return most;
}

}  // namespace kmoe
