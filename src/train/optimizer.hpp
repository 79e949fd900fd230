// AdamW with per-tensor groups and the learning-rate schedules of MODEL.md section 6.
#pragma once

#include <vector>

#include "core/config.hpp"
#include "core/tensor_table.hpp"

namespace kmoe {

// lr(s) for step s in 1..max_steps: linear warmup, then cosine | constant | wsd.
double learning_rate(const OptimizerCfg& o, int max_steps, int step);

// Sum of squared gradients over the table's tensors (those with counted[i] != 0 when given:
// the ones this rank owns, so a sum over the grid counts each parameter once), in double.
double grad_sq_sum(const TensorTable& table, const std::vector<char>* counted = nullptr);

// One AdamW update with AdamW step t (1-based), schedule value lr and clip scale:
//   g = clip_scale * grad; m, v moments; theta -= lr*lr_mult*(wd*theta + m^/(sqrt(v^)+eps)).
void adamw_step(const OptimizerCfg& o, TensorTable& table, int t, double lr, double clip_scale);

}  // namespace kmoe
