#include "train/planner.hpp"

#include <algorithm>
#include <sstream>
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
  out.seconds =
      flops / (double(o.ranks) * o.flops_per_rank) * (1.0 + bubble) + out.sent / o.link_bytes_per_s;
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

Config resolve_auto_dp(const std::function<Config(const std::vector<std::string>&)>& read,
                       const std::vector<std::string>& overrides, int ranks, std::string* note) {
  Config cfg = read(overrides);
  if (note) note->clear();
  if (!cfg.parallel.dp_auto) return cfg;
  const ParallelCfg& p = cfg.parallel;
  const std::string origin = cfg.deck_path.empty() ? std::string("the deck") : cfg.deck_path;
  const std::int64_t unit = std::int64_t(p.pp) * p.ep;  // (each at least 1, checked)
  KMOE_REQUIRE(ranks >= 1 && ranks % unit == 0,
               origin << ": parallel.dp = auto: this launch's " << ranks
                      << " rank(s) are not a multiple of parallel.pp * parallel.ep = " << p.pp
                      << " * " << p.ep << "; launch a multiple of " << unit
                      << " ranks (--print-grid, --dry-run: --ranks N) or set parallel.dp");
  const int dp = static_cast<int>(ranks / unit);
  std::vector<std::string> over = overrides;
  over.push_back("--parallel.dp=" + std::to_string(dp));
  Config resolved;
  try {
    resolved = read(over);
  } catch (const Error& e) {
    KMOE_FAIL(origin << ": parallel.dp = auto chose dp " << dp << " for " << ranks
                     << " rank(s) (pp " << p.pp << ", ep " << p.ep
                     << "), and the deck refuses it: " << e.what());
  }
  resolved.parallel.dp_auto = true;
  if (note) {
    std::ostringstream os;
    os << "parallel.dp = auto: dp " << dp << " for " << ranks << " rank(s) (pp " << p.pp
       << " x dp " << dp << " x ep " << p.ep << ")";
    *note = os.str();
  }
  return resolved;
}

Config launch_layout(const std::function<Config(const std::vector<std::string>&)>& read,
                     const std::vector<std::string>& overrides, int ranks, std::string* note) {
  Config cfg = read(overrides);
  if (note) note->clear();
  auto grid_given = [&] {  // the command line sets a grid key: its grid (or its error) stands
    for (const std::string& o : overrides)
      for (const char* key :
           {"--parallel.pp=", "--parallel.dp=", "--parallel.ep=", "--parallel.pp_layers="})
        if (o.rfind(key, 0) == 0) return true;
    return false;
  };
  if (cfg.parallel.dp_auto) {
    // The deck's pp and ep with dp = auto; a launch they do not fit takes a layout below.
    try {
      return resolve_auto_dp(read, overrides, ranks, note);
    } catch (const Error&) {
      if (grid_given()) throw;
      if (note) note->clear();
    }
  }
  if (grid_given()) return cfg;
  if (cfg.parallel.world() == ranks) return cfg;
  auto with = [&](int pp, int dp, int ep) {
    const TrainCfg& t = cfg.train;
    const int unit = t.micro_batch * dp * ep;
    std::vector<std::string> over = overrides;
    over.push_back("--parallel.pp=" + std::to_string(pp));
    over.push_back("--parallel.dp=" + std::to_string(dp));
    over.push_back("--parallel.ep=" + std::to_string(ep));
    over.push_back("--parallel.pp_layers=");
    over.push_back("--train.global_batch=" +
                   std::to_string((t.global_batch + unit - 1) / unit * unit));
    return read(over);
  };
  int ep = 1;
  if (cfg.moe.enabled())
    for (int d = 1; d <= ranks; ++d)
      if (ranks % d == 0 && cfg.moe.experts % d == 0) ep = d;
  std::ostringstream why;
  why << "the deck's grid pp " << cfg.parallel.pp << " x dp "
      << (cfg.parallel.dp_auto ? std::string("auto") : std::to_string(cfg.parallel.dp)) << " x ep "
      << cfg.parallel.ep << " is not this launch's " << ranks << " rank(s) and no parallel.pp, "
      << "parallel.dp, parallel.ep or parallel.pp_layers was given: running on ";
  Config chosen;
  bool widest = true;  // the first choice; else the accepted layout with the least memory
  try {
    chosen = with(1, ranks / ep, ep);
  } catch (const Error&) {
    widest = false;
    PlanOptions o;
    o.ranks = ranks;
    LayoutSearch s = plan_layouts(with, o);
    std::sort(s.fit.begin(), s.fit.end(),
              [](const LayoutPlan& a, const LayoutPlan& b) { return a.memory < b.memory; });
    if (s.fit.empty()) {
      std::ostringstream e;
      e << "the deck accepts no layout of " << ranks << " ranks";
      for (std::size_t i = 0; i < s.rejected.size() && i < 4; ++i)
        e << (i ? "; " : ": ") << s.rejected[i];
      KMOE_FAIL(e.str() << "; give parallel.pp, parallel.dp and parallel.ep");
    }
    chosen = with(s.fit[0].pp, s.fit[0].dp, s.fit[0].ep);
  }
  const ParallelCfg& p = chosen.parallel;
  why << "pp " << p.pp << " x dp " << p.dp << " x ep " << p.ep
      << (widest ? " (experts split as far as the ranks allow, the rest data-parallel)"
                 : " (the accepted layout with the least memory per rank)");
  if (note) *note = why.str();
  return chosen;
}

}  // namespace kmoe
