// kmoe-train -i DECK [--dry-run | --print-grid] [--section.key=value ...]
//   1. MPI + Kokkos (driver_main.hpp), 2. deck, 3. process grid, 4. data + model, 5. train.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/fault_injection.hpp"
#include "core/stop_signal.hpp"
#include "drivers/driver_main.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"
#include "io/token_data.hpp"
#include "modules/attention/attention_core.hpp"
#include "modules/model/model_size.hpp"
#include "parallel/process_grid.hpp"
#include "train/memory_check.hpp"
#include "train/planner.hpp"
#include "train/trainer.hpp"

namespace {

struct Args {
  std::string deck;
  bool dry_run = false;
  bool print_grid = false;
  int plan = 0;                // --plan N: list the layouts of N ranks
  int ranks = 0;               // --ranks N: --print-grid/--dry-run for N ranks (0: the launch's)
  double memory_gib = 0;       // --memory-per-rank GiB (0: no limit)
  std::vector<std::string> overrides;
};

const char* kUsage =
    "usage: kmoe-train -i DECK [--dry-run | --plan N [--memory-per-rank GiB] | --print-grid]\n"
    "                  [--ranks N] [--section.key=value ...]\n"
    "  -i, --input DECK   input deck (INI); keys may be overridden on the command line\n"
    "  --dry-run          resolve the deck, print sizes and each stage's memory per rank,\n"
    "                     check the grid and data, exit (one process plans any grid)\n"
    "  --plan N           list the grids of N ranks the deck accepts (one process), their\n"
    "                     memory per rank and bytes sent per step, best first by the cost\n"
    "                     model it prints; --memory-per-rank GiB keeps those that fit\n"
    "  --print-grid       print the deck's grid as 'pp P dp D ep E ranks N', then\n"
    "                     'max_steps S checkpoint_dir DIR', and exit (any number of ranks;\n"
    "                     batch scripts check their allocation and the finished run with it)\n"
    "  --ranks N          --print-grid and --dry-run: resolve parallel.dp = auto for a job of\n"
    "                     N ranks (default: this launch's)\n"
    "  -h, --help         this text and every deck key\n";

// The value of option `name` at argv[i] ("--name V" or "--name=V"), as a number.
double option_number(int argc, char** argv, int& i, const std::string& name) {
  const std::string s = argv[i];
  std::string v;
  if (s == name) {
    KMOE_REQUIRE(i + 1 < argc, name << " needs a value\n" << kUsage);
    v = argv[++i];
  } else {
    v = s.substr(name.size() + 1);
  }
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  KMOE_REQUIRE(used == v.size() && !v.empty() && x > 0,
               name << " " << v << ": expected a positive number");
  return x;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--plan" || s.rfind("--plan=", 0) == 0) {
      const double n = option_number(argc, argv, i, "--plan");
      KMOE_REQUIRE(n <= double(1 << 30) && n == std::floor(n),
                   "--plan " << n << ": expected a rank count");
      a.plan = static_cast<int>(n);
    } else if (s == "--ranks" || s.rfind("--ranks=", 0) == 0) {
      const double n = option_number(argc, argv, i, "--ranks");
      KMOE_REQUIRE(n <= double(1 << 30) && n == std::floor(n),
                   "--ranks " << n << ": expected a rank count");
      a.ranks = static_cast<int>(n);
    } else if (s == "--memory-per-rank" || s.rfind("--memory-per-rank=", 0) == 0) {
      a.memory_gib = option_number(argc, argv, i, "--memory-per-rank");
    } else if (s == "-i" || s == "--input") {
      KMOE_REQUIRE(i + 1 < argc, s << " needs a deck file\n" << kUsage);
      a.deck = argv[++i];
    } else if (s.rfind("--input=", 0) == 0) {
      a.deck = s.substr(8);
    } else if (s == "--dry-run") {
      a.dry_run = true;
    } else if (s == "--print-grid") {
      a.print_grid = true;
    } else if (s.rfind("--", 0) == 0 && s.find('.') != std::string::npos) {
      a.overrides.push_back(s);
    } else {
      KMOE_FAIL("unknown argument '" << s << "'\n" << kUsage);
    }
  }
  KMOE_REQUIRE(!a.deck.empty(), "no input deck\n" << kUsage);
  KMOE_REQUIRE(a.memory_gib == 0 || a.plan > 0, "--memory-per-rank is a --plan option");
  KMOE_REQUIRE(a.ranks == 0 || a.dry_run || a.print_grid,
               "--ranks is a --print-grid and --dry-run option (a run has its launch's ranks)");
  KMOE_REQUIRE(!(a.plan > 0 && (a.dry_run || a.print_grid)),
               "--plan, --dry-run and --print-grid are separate modes: choose one");
  return a;
}

// A dry run reads at most this many tokens of the instances the run will use.
constexpr std::int64_t kDryRunTokens = std::int64_t(1) << 25;

// Reads instances (token ids checked against the vocabulary) while the budget lasts; returns
// how many were read.
template <class Next>
std::int64_t check_tokens(const kmoe::TokenDataset& data, std::int64_t count, Next next,
                          std::int64_t& budget) {
  std::vector<std::int32_t> tokens(data.seq_len());
  std::int64_t i = 0;
  for (; i < count && budget >= data.seq_len(); ++i, budget -= data.seq_len())
    data.read_instance(next(i), tokens.data());
  return i;
}

// Everything a run would check before its first step, without allocating the model: sizes, the
// grid, each pipeline stage's memory per rank, the data (token ids of the instances the run will
// use), the checkpoint it would resume from. Needs no ranks: world rank 0 of any launch plans the
// deck's grid (one process on a login node plans a 512-rank job); memory is estimated for that
// grid, not checked against this machine.
void print_dry_run(const kmoe::Config& cfg) {
  using namespace kmoe;
  int rank = 0, launched = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &launched);
  if (rank != 0) return;
  const ModelSize s =
      model_size(cfg.model, cfg.moe, cfg.train.micro_batch, cfg.train.seq_len, cfg.engram);
  const auto& t = cfg.train;
  const ParallelCfg& p = cfg.parallel;
  const std::vector<int> bounds = stage_bounds(p, cfg.model.n_layers);
  // One row per pipeline stage: its dp*ep ranks hold the same shares.
  std::vector<std::pair<int, RankMemory>> stages;
  RankMemory most;
  for (int stage = 0; stage < p.pp; ++stage) {
    int in_flight = 0;
    const RankMemory m = stage_memory(cfg, stage, &in_flight);
    stages.emplace_back(in_flight, m);
    if (m.total() > most.total()) most = m;
  }
  TrainState from;
  std::string resume = resume_file(cfg.checkpoint), changes;
  if (!resume.empty()) from = check_checkpoint(resume, cfg, &changes);
  TokenDataset train(cfg.data.paths, cfg.data.dtype, t.seq_len, cfg.model.vocab_size,
                     "data.paths");
  KMOE_REQUIRE(train.num_instances() >= t.global_batch,
               "data.paths: " << train.num_instances() << " instances, fewer than one "
                              << "train.global_batch (" << t.global_batch << ")");
  InstanceStream stream(train.num_instances(), t.seed);
  const std::int64_t used =
      std::max<std::int64_t>(0, std::int64_t(t.max_steps - from.step)) * t.global_batch;
  std::int64_t budget = kDryRunTokens;
  const std::int64_t read = check_tokens(
      train, used, [&](std::int64_t i) { return stream.instance_at(from.next_position + i); },
      budget);
  std::int64_t val = 0, val_read = 0;
  if (!cfg.data.val_paths.empty()) {
    TokenDataset v(cfg.data.val_paths, cfg.data.dtype, t.seq_len, cfg.model.vocab_size,
                   "data.val_paths");
    val = v.num_instances();
    const std::int64_t evaluated =
        t.eval_instances > 0 ? std::min<std::int64_t>(val, t.eval_instances) : val;
    val_read = check_tokens(
        v, evaluated, [](std::int64_t i) { return i; }, budget);
  }
  const double mib = 1024.0 * 1024.0;
  std::printf("dry run: grid pp %d x dp %d x ep %d = %d ranks (planned on one process; this "
              "launch has %d)\n",
              p.pp, p.dp, p.ep, p.world(), launched);
  std::printf("  parameters: total %lld, active %lld (embedding %lld)\n",
              (long long)s.total_params, (long long)s.active_params,
              (long long)s.embedding_params);
  const double tokens = double(t.global_batch) * t.seq_len;
  std::printf("  model FLOPs per token: %.4g (forward + backward); per step %.4g (%.0f tokens)\n",
              s.flops_per_token, s.flops_per_token * tokens, tokens);
  std::printf(
      "  memory per rank (estimate, %s activations, recompute %s, AdamW moments sharded %s; "
      "every dp and ep rank of a stage alike; the expert side, part of the activations, at "
      "twice a balanced share of the rows):\n"
      "    stage  blocks   tensor elements  params+grads MiB  AdamW MiB  in flight  "
      "activations MiB  (expert side)  runtime MiB  total MiB\n",
      choice_name(t.precision), choice_name(t.recompute), choice_name(cfg.optimizer.shard));
  for (int stage = 0; stage < p.pp; ++stage) {
    const auto& [in_flight, m] = stages[stage];
    std::printf("    %5d  %3d-%-3d  %15lld  %16.1f  %9.1f  %9d  %15.1f  %13.1f  %11.1f  %9.1f\n",
                stage, bounds[stage], bounds[stage + 1] - 1, (long long)m.elements,
                (m.param_bytes + 4.0 * m.elements) / mib, 8.0 * m.moment_elements / mib, in_flight,
                m.activation_bytes / mib, m.expert_side_bytes / mib, kRuntimeBytes / mib,
                (m.total() + kRuntimeBytes) / mib);
  }
  std::printf(
      "  sent per rank and step (MiB; ring all-reduces, a balanced all-to-all, %s rows):\n"
      "    stage  gradients/stage  gradients/dp  all-to-all  pipeline     total\n",
      choice_name(t.precision));
  for (int stage = 0; stage < p.pp; ++stage) {
    const StepTraffic x = step_traffic(cfg, stage);
    std::printf("    %5d  %15.1f  %12.1f  %10.1f  %8.1f  %8.1f\n", stage, x.stage_grads / mib,
                x.dp_grads / mib, x.all_to_all / mib, x.pipeline / mib, x.total() / mib);
  }
  if (cfg.engram.host_tables()) {
    // Where the tables went, and what keeping them on the device would take.
    Config on_device = cfg;
    on_device.engram.offload = EngramOffload::None;
    std::printf(
        "  engram.offload = host, per rank (MiB):\n"
        "    stage  table elements  host (tables+grads+moments, staging)  device row caches  "
        "device without offload  device freed  per step to device  from device (at most)\n");
    for (int stage = 0; stage < p.pp; ++stage) {
      const RankMemory& m = stages[stage].second;
      const RankMemory d = stage_memory(on_device, stage);
      const StepTraffic x = step_traffic(cfg, stage);
      std::printf("    %5d  %14lld  %36.1f  %17.1f  %22.1f  %12.1f  %18.1f  %21.1f\n", stage,
                  (long long)m.host_elements, m.host_bytes / mib, m.row_cache_bytes / mib,
                  (d.total() + kRuntimeBytes) / mib, (d.total() - m.total()) / mib,
                  x.to_device / mib, x.from_device / mib);
    }
    std::printf(
        "  memory per rank (estimate, the largest share, %s activations): %.1f MiB state + "
        "%.1f MiB activations = %.1f MiB on the device, + %.1f MiB in host memory (Engram "
        "tables) = %.1f MiB, %.1f MiB with the runtime\n",
        choice_name(t.precision), most.state_bytes / mib, most.activation_bytes / mib,
        most.total() / mib, most.host_bytes / mib, (most.total() + most.host_bytes) / mib,
        (most.total() + most.host_bytes + kRuntimeBytes) / mib);
  } else {
    std::printf(
        "  memory per rank (estimate, the largest share, %s activations): %.1f MiB state + "
        "%.1f MiB activations = %.1f MiB, %.1f MiB with the runtime\n",
        choice_name(t.precision), most.state_bytes / mib, most.activation_bytes / mib,
        most.total() / mib, (most.total() + kRuntimeBytes) / mib);
  }
  std::printf(
      "  data: %lld training instances of %d tokens (%d steps use %lld), %lld "
      "validation\n",
      (long long)train.num_instances(), t.seq_len, t.max_steps,
      (long long)t.max_steps * t.global_batch, (long long)val);
  std::printf(
      "  token ids checked: %lld of the %lld training instances the run reads and %lld "
      "validation instances (a dry run reads at most %lld tokens)\n",
      (long long)read, (long long)used, (long long)val_read, (long long)kDryRunTokens);
  if (resume.empty())
    std::printf("  a fresh run: nothing to resume in checkpoint.dir = %s\n",
                cfg.checkpoint.dir.c_str());
  else
    std::printf("  resumes %s after step %d%s%s\n", resume.c_str(), from.step,
                changes.empty() ? "" : "; deck changes since:", changes.c_str());
}

// --plan N: the layouts of N ranks, on world rank 0 of any launch.
void print_plan(const Args& args) {
  using namespace kmoe;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) return;
  PlanOptions o;
  o.ranks = args.plan;
  o.memory_per_rank = args.memory_gib * double(std::int64_t(1) << 30);
  const LayoutSearch found = plan_layouts(
      [&](int pp, int dp, int ep) {
        std::vector<std::string> over = args.overrides;
        over.push_back("--parallel.pp=" + std::to_string(pp));
        over.push_back("--parallel.dp=" + std::to_string(dp));
        over.push_back("--parallel.ep=" + std::to_string(ep));
        return read_deck(args.deck, over);
      },
      o);
  const double gib = double(std::int64_t(1) << 30);
  if (found.fit.empty()) {
    std::ostringstream why;
    if (!found.too_large.empty()) {
      const LayoutPlan& s = found.too_large.front();
      why << "--memory-per-rank " << args.memory_gib << ": none of the "
          << found.too_large.size() << " layouts of " << o.ranks
          << " ranks the deck accepts fits; the smallest, pp " << s.pp << " dp " << s.dp
          << " ep " << s.ep << ", needs " << s.memory / gib << " GiB per rank";
    } else {
      why << "--plan " << o.ranks << ": the deck accepts no layout of " << o.ranks << " ranks";
      for (std::size_t i = 0; i < found.rejected.size() && i < 6; ++i)
        why << (i ? "; " : ": ") << found.rejected[i];
    }
    KMOE_FAIL(why.str());
  }
  std::printf("plan: %d ranks, %zu layouts the deck accepts, %zu fit", o.ranks,
              found.fit.size() + found.too_large.size(), found.fit.size());
  if (o.memory_per_rank > 0) std::printf(" %.1f GiB per rank", args.memory_gib);
  std::printf(
      "\n  cost model: step = model FLOPs / (ranks x %.3g FLOP/s) x (1 + (pp - 1) / "
      "micro-batches per replica) + the busiest rank's bytes sent / %.3g B/s (not overlapped)\n"
      "  %4s %5s %5s  %15s  %13s  %9s\n",
      o.flops_per_rank, o.link_bytes_per_s, "pp", "dp", "ep", "memory/rank GiB",
      "sent/step GiB", "step s");
  for (const LayoutPlan& l : found.fit)
    std::printf("  %4d %5d %5d  %15.2f  %13.3f  %9.4f\n", l.pp, l.dp, l.ep, l.memory / gib,
                l.sent / gib, l.seconds);
  if (!found.too_large.empty())
    std::printf("  %zu more need more memory per rank (the smallest %.2f GiB)\n",
                found.too_large.size(), found.too_large.front().memory / gib);
  if (!found.rejected.empty())
    std::printf("  %zu rejected by the deck, e.g. %s\n", found.rejected.size(),
                found.rejected.front().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  kmoe::install_stop_handlers();  // before MPI starts: a signal during start-up is kept
  kmoe::signal_at_start_if_requested();
  return kmoe::run_driver(
      argc, argv, "kmoe-train", std::string(kUsage) + "\n" + kmoe::deck_help(),
      [](int argc, char** argv, const kmoe::ExecutionPlan& exec) {
        kmoe::install_stop_handlers();
        const Args args = parse_args(argc, argv);
        int rank = 0, launched = 1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &launched);
        if (args.plan > 0) {  // every grid of N ranks: the deck's dp (auto or not) is replaced
          (void)kmoe::read_deck(args.deck, args.overrides);  // the deck's own errors first
          print_plan(args);
          return;
        }
        std::string auto_note;
        const kmoe::Config cfg = kmoe::resolve_auto_dp(
            [&](const std::vector<std::string>& over) { return kmoe::read_deck(args.deck, over); },
            args.overrides, args.ranks > 0 ? args.ranks : launched, &auto_note);
        if (args.print_grid) {
          const auto& p = cfg.parallel;
          if (rank == 0)
            std::printf("pp %d dp %d ep %d ranks %d\nmax_steps %d checkpoint_dir %s\n", p.pp, p.dp,
                        p.ep, p.world(), cfg.train.max_steps, cfg.checkpoint.dir.c_str());
          return;
        }
        if (args.dry_run) {
          if (rank == 0 && !auto_note.empty()) std::printf("note: %s\n", auto_note.c_str());
          print_dry_run(cfg);
          return;
        }
        kmoe::ProcessGrid grid(cfg.parallel, cfg.model.n_layers, MPI_COMM_WORLD);
        if (grid.is_root()) std::cout << cfg.resolved_text << std::endl;
        if (grid.is_root() && !auto_note.empty()) std::printf("note: %s\n", auto_note.c_str());
        std::string precision_note;
        kmoe::RunContext ctx =
            kmoe::make_run_context(cfg.train.precision, exec.batch_threads, &precision_note);
        ctx.attention = cfg.train.attention;
        if (grid.is_root() && !precision_note.empty())
          std::printf("note: %s\n", precision_note.c_str());
        if (grid.is_root()) {
          const kmoe::AttentionChoice attn = kmoe::choose_attention_path(ctx.attention, cfg.model);
          std::printf("attention: %s (%s)\n", kmoe::attention_path_name(attn.path),
                      attn.why.c_str());
        }
        const std::string launcher_note = kmoe::launcher_stop_note();
        if (grid.is_root() && !launcher_note.empty())
          std::printf("note: %s\n", launcher_note.c_str());
        kmoe::Trainer trainer(cfg, grid, ctx);
        trainer.run();
      });
}
