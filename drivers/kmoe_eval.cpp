// kmoe-eval -i DECK --checkpoint FILE [--section.key=value ...]
// Validation loss of a checkpoint's weights on data.val_paths (at most train.eval_instances
// instances, file order); the last line is `eval_loss <float> tokens <int>` (exit code 3 when
// it is not finite). On the layout the trainer ran on it reproduces the trainer's val_loss bit
// for bit. Launched on another number of ranks without parallel.pp/dp/ep on the command line,
// it runs on a layout of that many (launch_layout, said on a note line). A checkpoint holding
// NaN or Inf is refused, naming the tensor.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/gemm.hpp"
#include "drivers/driver_main.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"
#include "parallel/layer_comms.hpp"
#include "train/evaluate.hpp"
#include "train/planner.hpp"

namespace {

const char* kUsage =
    "usage: kmoe-eval -i DECK --checkpoint FILE [--section.key=value ...]\n"
    "  prints the validation loss of FILE's weights on the deck's data.val_paths; on as many\n"
    "  ranks as launched (without parallel.pp/dp/ep on the command line it chooses the layout)\n";

}  // namespace

int main(int argc, char** argv) {
  return kmoe::run_driver(argc, argv, "kmoe-eval", kUsage, [](int argc, char** argv, const kmoe::ExecutionPlan& exec) {
    std::string deck, checkpoint;
    std::vector<std::string> overrides;
    for (int i = 1; i < argc; ++i) {
      const std::string s = argv[i];
      if ((s == "-i" || s == "--input" || s == "--checkpoint") && i + 1 < argc) {
        (s == "--checkpoint" ? checkpoint : deck) = argv[++i];
      } else if (s.rfind("--checkpoint=", 0) == 0) {
        checkpoint = s.substr(13);
      } else if (s.rfind("--", 0) == 0 && s.find('.') != std::string::npos) {
        overrides.push_back(s);
      } else {
        KMOE_FAIL("unknown argument '" << s << "'\n" << kUsage);
      }
    }
    KMOE_REQUIRE(!deck.empty() && !checkpoint.empty(), "need a deck and a checkpoint\n" << kUsage);
    // The launch's rank count decides the layout when the deck's grid differs (checkpoints are
    // layout-independent).
    int ranks = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    std::string layout_note;
    const kmoe::Config cfg = kmoe::launch_layout(
        [&](const std::vector<std::string>& over) { return kmoe::read_deck(deck, over); },
        overrides, ranks, &layout_note);
    KMOE_REQUIRE(!cfg.data.val_paths.empty(),
                 deck << ": data.val_paths is empty: nothing to evaluate");
    kmoe::ProcessGrid grid(cfg.parallel, cfg.model.n_layers, MPI_COMM_WORLD);
    if (grid.is_root() && !layout_note.empty()) std::printf("note: %s\n", layout_note.c_str());
    std::string precision_note;  // the run's precision, as its training evaluated
    kmoe::RunContext ctx =
        kmoe::make_run_context(cfg.train.precision, exec.batch_threads, &precision_note);
    ctx.attention = cfg.train.attention;  // the run's attention core, as its training took
    if (grid.is_root() && !precision_note.empty())
      std::printf("note: %s\n", precision_note.c_str());
    kmoe::TokenDataset val(cfg.data.val_paths, cfg.data.dtype, cfg.train.seq_len,
                           cfg.model.vocab_size, "data.val_paths");
    kmoe::TensorTable table;
    kmoe::Stage stage(ctx, cfg.model, cfg.moe, cfg.train.micro_batch, cfg.train.seq_len, table,
                      cfg.engram, kmoe::StagePlan::of(grid), kmoe::layer_comms(cfg, grid));
    table.allocate();
    kmoe::load_checkpoint(checkpoint, cfg, grid, table, /*with_optimizer=*/false, nullptr);
    const kmoe::EvalResult r =
        kmoe::evaluate(stage, table, val, grid, cfg.train.micro_batch, cfg.train.eval_instances,
                       cfg.parallel.engram_shard != kmoe::EngramShardGroup::None);
    if (grid.is_root()) std::printf("eval_loss %.17g tokens %lld\n", r.loss, (long long)r.tokens);
    if (!std::isfinite(r.loss))  // every rank holds the same summed loss
      throw kmoe::NonFiniteError(checkpoint + ": the evaluation loss is not finite (" +
                                 std::to_string(r.loss) + ")");
  });
}
