// kmoe-train -i DECK [--dry-run | --print-grid] [--section.key=value ...]
//   1. MPI + Kokkos (driver_main.hpp), 2. deck, 3. process grid, 4. data + model, 5. train.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "core/stop_signal.hpp"
#include "drivers/driver_main.hpp"
#include "io/deck.hpp"
#include "io/token_data.hpp"
#include "modules/model/model_size.hpp"
#include "parallel/process_grid.hpp"
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

void print_dry_run(const kmoe::Config& cfg, const kmoe::ProcessGrid& grid) {
  using namespace kmoe;
  const ModelSize s =
      model_size(cfg.model, cfg.moe, cfg.train.micro_batch, cfg.train.seq_len, cfg.engram);
  TokenDataset train(cfg.data.paths, cfg.data.dtype, cfg.train.seq_len, cfg.model.vocab_size,
                     "data.paths");
  KMOE_REQUIRE(train.num_instances() >= cfg.train.global_batch,
               "data.paths: " << train.num_instances() << " instances, fewer than one "
                              << "train.global_batch (" << cfg.train.global_batch << ")");
  std::int64_t val = 0;
  if (!cfg.data.val_paths.empty())
    val = TokenDataset(cfg.data.val_paths, cfg.data.dtype, cfg.train.seq_len, cfg.model.vocab_size,
                       "data.val_paths")
              .num_instances();
  if (!grid.is_root()) return;
  const double mib = 1024.0 * 1024.0;
  std::printf("dry run: grid pp %d x dp %d x ep %d = %d ranks\n", grid.pp, grid.dp, grid.ep,
              grid.world.size());
  std::printf("  parameters: total %lld, active %lld (embedding %lld)\n", (long long)s.total_params,
              (long long)s.active_params, (long long)s.embedding_params);
  std::printf("  model FLOPs per token: %.4g (forward + backward)\n", s.flops_per_token);
  std::printf("  memory per rank (estimate): %.1f MiB state + %.1f MiB activations = %.1f MiB\n",
              s.state_bytes / mib, s.activation_bytes / mib,
              (s.state_bytes + s.activation_bytes) / mib);
  std::printf("  data: %lld training instances of %d tokens (%d steps use %lld), %lld validation\n",
              (long long)train.num_instances(), cfg.train.seq_len, cfg.train.max_steps,
              (long long)cfg.train.max_steps * cfg.train.global_batch, (long long)val);
}

}  // namespace

int main(int argc, char** argv) {
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
