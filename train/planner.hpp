// The layout planner of `kmoe-train --plan N` (docs/OPERATIONS.md "Planning a run"): every grid
// of N ranks the deck accepts, its memory per rank (the dry run's estimate for its largest
// stage, runtime included) and the bytes its busiest rank sends per step, ranked by a stated cost model:
//   step time = model FLOPs per step / (N * flops_per_rank) * (1 + (pp - 1) / M)
//             + the busiest rank's bytes per step / link_bytes_per_s,
// M the micro-batches per replica and step: compute balanced over the ranks, the pipeline's
// bubble on top, communication not overlapped. Runs on one process; nothing is allocated.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace kmoe {

struct PlanOptions {
  int ranks = 1;
  double memory_per_rank = 0;      // bytes a rank may hold; 0: no limit
  double flops_per_rank = 1e14;    // sustained model FLOP/s of one rank
  double link_bytes_per_s = 25e9;  // what one rank sends per second on any axis
};

struct LayoutPlan {
  int pp = 1, dp = 1, ep = 1;
  double memory = 0;   // bytes per rank, the largest stage's, runtime included
  double sent = 0;     // bytes per step, the busiest rank's
  double seconds = 0;  // the cost model's step time
};

struct LayoutSearch {
  std::vector<LayoutPlan> fit;        // best first
  std::vector<LayoutPlan> too_large;  // accepted by the deck, above the memory limit
  std::vector<std::string> rejected;  // "pp a dp b ep c: <the deck's error>"
};

// config_for(pp, dp, ep): the deck with those parallel keys (throws kmoe::Error when the deck
// does not accept them, e.g. experts not divisible by ep).
LayoutSearch plan_layouts(const std::function<Config(int pp, int dp, int ep)>& config_for,
                          const PlanOptions& options);

// `parallel.dp = auto` (RUNTIME.md section 5): the deck read again with dp = ranks / (pp * ep),
// so every check sees the grid this launch runs (a global batch that dp * ep * micro_batch does
// not divide is refused then, naming dp = auto and the rank count). A deck with a number comes
// back as read. `note` says what auto chose (empty otherwise). read(overrides) reads the deck.
Config resolve_auto_dp(const std::function<Config(const std::vector<std::string>&)>& read,
                       const std::vector<std::string>& overrides, int ranks, std::string* note);

// The deck a tool that only loads a checkpoint (kmoe-eval) runs on `ranks` launched ranks
// (RUNTIME.md section 5): the deck's own grid when it has that many ranks or the command line
// sets a parallel.pp, parallel.dp, parallel.ep or parallel.pp_layers key (a mismatch then
// stays the grid's error); otherwise pp 1, ep the largest divisor of `ranks` that divides
// moe.experts (1 for a dense model), dp the rest, and train.global_batch raised to a multiple of
// micro_batch * dp * ep (evaluation reads no training batch); when the deck refuses that, the
// accepted layout with the least memory per rank. `note` says which layout was chosen and why
// (empty: the deck's). read(overrides) reads the deck with these command-line overrides. A deck
// with parallel.dp = auto takes its pp and ep and resolve_auto_dp's dp.
Config launch_layout(const std::function<Config(const std::vector<std::string>&)>& read,
                     const std::vector<std::string>& overrides, int ranks, std::string* note);

}  // namespace kmoe
