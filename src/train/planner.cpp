#include "train/planner.hpp"

#include <algorithm>
#include <tuple>

#include "core/error.hpp"
#include "modules/model/model_size.hpp"
#include "train/memory_check.hpp"

namespace kmoe {

namespace {

// The plan of one accepted layout.
LayoutPlan plan_one(const Config& cfg, const PlanOptions& o) {
  const ParallelCfg& p = cfg.parallel;
  const TrainCfg& t = cfg.train;
  LayoutPlan out;
  out.pp = p.pp;
  out.dp = p.dp;
  out.ep = p.ep;
  for (int stage = 0; stage < p.pp; ++stage) {
    out.memory = std::max(out.memory, double(stage_memory(cfg, stage).total() + kRuntimeBytes));
    out.sent = std::max(out.sent, step_traffic(cfg, stage).total());
  }
  const ModelSize s = model_size(cfg.model, cfg.moe, t.micro_batch, t.seq_len, cfg.engram);
  const double flops = s.flops_per_token * double(t.global_batch) * t.seq_len;
  const double bubble = double(p.pp - 1) / micro_batches_per_replica(cfg);
  out.seconds = flops / (double(o.ranks) * o.flops_per_rank) * (1.0 + bubble) +
                out.sent / o.link_bytes_per_s;
  return out;
}

}  // namespace

LayoutSearch plan_layouts(const std::function<Config(int pp, int dp, int ep)>& config_for,
                          const PlanOptions& o) {
  KMOE_REQUIRE(o.ranks >= 1, "--plan " << o.ranks << ": the rank count must be at least 1");
  KMOE_REQUIRE(o.memory_per_rank >= 0,
               "--memory-per-rank must be positive (GiB), not " << o.memory_per_rank / (1 << 30));
  LayoutSearch out;
  const int n = o.ranks;
  for (int pp = 1; pp <= n; ++pp) {
    if (n % pp) continue;
    for (int ep = 1; ep <= n / pp; ++ep) {
      if ((n / pp) % ep) continue;
      const int dp = n / pp / ep;
      Config cfg;
      try {
        cfg = config_for(pp, dp, ep);
      } catch (const Error& e) {
        out.rejected.push_back("pp " + std::to_string(pp) + " dp " + std::to_string(dp) + " ep " +
                               std::to_string(ep) + ": " + e.what());
        continue;
      }
      const LayoutPlan plan = plan_one(cfg, o);
      if (o.memory_per_rank > 0 && plan.memory > o.memory_per_rank)
        out.too_large.push_back(plan);
      else
        out.fit.push_back(plan);
    }
  }
  auto faster = [](const LayoutPlan& a, const LayoutPlan& b) {
    return std::tie(a.seconds, a.memory, a.pp, a.ep) < std::tie(b.seconds, b.memory, b.pp, b.ep);
  };
  std::sort(out.fit.begin(), out.fit.end(), faster);
  std::sort(out.too_large.begin(), out.too_large.end(),
            [](const LayoutPlan& a, const LayoutPlan& b) { return a.memory < b.memory; });
  return out;
}

}  // namespace kmoe
