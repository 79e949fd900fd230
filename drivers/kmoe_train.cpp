// kmoe-train -i DECK [--dry-run | --print-grid] [--section.key=value ...]
//   1. MPI + Kokkos (driver_main.hpp), 2. deck, 3. process grid, 4. data + model, 5. train.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "core/stop_signal.hpp"
#include "drivers/driver_main.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"
#include "io/token_data.hpp"
#include "modules/model/model_size.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "parallel/process_grid.hpp"
#include "train/memory_check.hpp"
#include "train/trainer.hpp"

namespace {

struct Args {
  std::string deck;
  bool dry_run = false;
  bool print_grid = false;
  std::vector<std::string> overrides;
};

const char* kUsage =
    "usage: kmoe-train -i DECK [--dry-run | --print-grid] [--section.key=value ...]\n"
    "  -i, --input DECK   input deck (INI); keys may be overridden on the command line\n"
    "  --dry-run          resolve the deck, print sizes, check the grid and data, exit\n"
    "  --print-grid       print the deck's grid as 'pp P dp D ep E ranks N', then\n"
    "                     'max_steps S checkpoint_dir DIR', and exit (any number of ranks;\n"
    "                     batch scripts check their allocation and the finished run with it)\n"
    "  -h, --help         this text and every deck key\n";

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "-i" || s == "--input") {
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

// Everything a run would check before its first step, on rank 0, without allocating the model:
// sizes, the grid, the data (token ids of the instances the run will use), the checkpoint it
// would resume from. Memory is estimated for the grid, not checked against this machine.
void print_dry_run(const kmoe::Config& cfg, const kmoe::ProcessGrid& grid) {
  using namespace kmoe;
  grid.world.on_root([&] {
    const ModelSize s =
        model_size(cfg.model, cfg.moe, cfg.train.micro_batch, cfg.train.seq_len, cfg.engram);
    const auto& t = cfg.train;
    // The largest share of any rank: the stages differ, the replicas of a stage do not.
    RankMemory most;
    for (int stage = 0; stage < grid.pp; ++stage) {
      RankShare r = rank_share(cfg, grid, 1);
      r.first_block = grid.first_block(stage);
      r.last_block = grid.first_block(stage + 1);
      r.embed = stage == 0;
      r.head = stage == grid.pp - 1;
      r.in_flight = max_in_flight(pipeline_schedule(
          cfg.parallel.schedule, grid.pp, stage, t.global_batch / t.micro_batch / grid.replicas()));
      const RankMemory m = rank_memory(cfg.model, cfg.moe, cfg.engram, t.micro_batch, t.seq_len, r);
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
    std::printf("dry run: grid pp %d x dp %d x ep %d = %d ranks\n", grid.pp, grid.dp, grid.ep,
                grid.world.size());
    std::printf("  parameters: total %lld, active %lld (embedding %lld)\n",
                (long long)s.total_params, (long long)s.active_params,
                (long long)s.embedding_params);
    std::printf("  model FLOPs per token: %.4g (forward + backward)\n", s.flops_per_token);
    std::printf(
        "  memory per rank (estimate, the largest share): %.1f MiB state + %.1f MiB "
        "activations = %.1f MiB\n",
        most.state_bytes / mib, most.activation_bytes / mib, most.total() / mib);
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
  });
}

}  // namespace

int main(int argc, char** argv) {
  kmoe::install_stop_handlers();  // before MPI starts: a signal during start-up is kept
  return kmoe::run_driver(
      argc, argv, "kmoe-train", std::string(kUsage) + "\n" + kmoe::deck_help(),
      [](int argc, char** argv) {
        kmoe::install_stop_handlers();
        const Args args = parse_args(argc, argv);
        const kmoe::Config cfg = kmoe::read_deck(args.deck, args.overrides);
        if (args.print_grid) {
          int rank = 0;
          MPI_Comm_rank(MPI_COMM_WORLD, &rank);
          const auto& p = cfg.parallel;
          if (rank == 0)
            std::printf("pp %d dp %d ep %d ranks %d\nmax_steps %d checkpoint_dir %s\n", p.pp, p.dp,
                        p.ep, p.world(), cfg.train.max_steps, cfg.checkpoint.dir.c_str());
          return;
        }
        kmoe::ProcessGrid grid(cfg.parallel, cfg.model.n_layers, MPI_COMM_WORLD);
        if (args.dry_run) {
          print_dry_run(cfg, grid);
          return;
        }
        if (grid.is_root()) std::cout << cfg.resolved_text << std::endl;
        kmoe::Trainer trainer(cfg, grid);
        trainer.run();
      });
}
