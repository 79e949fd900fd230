// Pipeline schedules (RUNTIME.md section 2) over one rank's M micro-batches, for stage s of P:
//   gpipe: every forward, then every backward (micro-batch order); M micro-batches in flight.
//   1f1b:  min(P-s-1, M) warm-up forwards, then one forward and one backward alternately,
//          then the remaining backwards; at most min(P-s, M) micro-batches in flight.
// With P = 1 both are plain gradient accumulation: forward i, backward i.
#pragma once

#include <vector>

#include "core/config.hpp"

namespace kmoe {

struct PipeOp {
  bool forward;
  int micro;  // 0..M-1, the rank's micro-batch
};

std::vector<PipeOp> pipeline_schedule(PipeSchedule kind, int stages, int stage, int micro);

// The most micro-batches forwarded but not yet backwarded: the Stage instances a rank needs
// (each keeps one micro-batch's activations).
int max_in_flight(const std::vector<PipeOp>& ops);

}  // namespace kmoe
