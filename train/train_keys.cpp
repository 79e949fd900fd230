#include "train/train_keys.hpp"

#include <cstdint>

#include "core/error.hpp"

namespace kmoe {

namespace {

void check_train(const TrainCfg& t, const deck::Locate& locate) {
  KMOE_DECK_REQUIRE(t.seq_len >= 2, "train.seq_len",
                    "train.seq_len must be at least 2 (T tokens give T-1 targets)");
  KMOE_DECK_REQUIRE(t.global_batch >= 1, "train.global_batch",
                    "train.global_batch must be at least 1");
  KMOE_DECK_REQUIRE(t.micro_batch >= 1, "train.micro_batch",
                    "train.micro_batch must be at least 1");
  KMOE_DECK_REQUIRE(t.max_steps >= 1, "train.max_steps", "train.max_steps must be at least 1");
  KMOE_DECK_REQUIRE(t.eval_every >= 0, "train.eval_every", "train.eval_every must be >= 0");
  KMOE_DECK_REQUIRE(t.eval_instances >= 0, "train.eval_instances",
                    "train.eval_instances must be >= 0");
}

void declare_train(deck::Schema& s, Config& c) {
  s.required(c.train.seq_len, "seq_len", "tokens per sequence T (T-1 targets)");
  s.required(c.train.global_batch, "global_batch",
             "sequences per step G; divisible by micro_batch * dp * ep");
  s.required(c.train.micro_batch, "micro_batch", "sequences per micro-batch b");
  s.required(c.train.max_steps, "max_steps", "optimizer steps of the run");
  s.key(c.train.seed, "seed", std::uint64_t{0}, "seed of the weight init and data order");
  s.key(c.train.eval_every, "eval_every", 0,
        "steps between validation passes; 0 = at the end only");
  s.key(c.train.eval_instances, "eval_instances", 0, "validation sequences per pass; 0 = all");
  s.key(c.train.check_memory, "check_memory", true,
        "before allocating, check that the node's memory (or the device's) holds its ranks");
  s.key(c.train.precision, "precision", Precision::Fp32,
        "GEMM inputs (MODEL.md section 8): fp32 | tf32 (TF32 tensor cores through cuBLAS; GPUs "
        "only) | bf16 (inputs rounded to bf16, fp32 sums, fp32 weights and optimizer; on CPUs "
        "emulated with the same numbers); the router stays fp32");
  s.key(c.train.recompute, "recompute", Recompute::None,
        "activation recompute: none | block (a block keeps only its input and runs its forward "
        "again just before its backward; bit-identical results, the blocks share one set of "
        "activation buffers)");
  s.key(c.train.attention, "attention", AttentionKernel::Auto,
        "the attention core: auto (tiled) | tiled (blocked GEMMs over the causal band, the "
        "probabilities kept) | fused (one Kokkos kernel streaming key blocks with an online "
        "softmax: no score matrix in memory, the log-sum-exp kept; backward recomputes the "
        "probabilities); the start-up log names the one taken");
  s.key(c.train.document_mask, "document_mask", false,
        "a position reads only earlier positions of its own document (documents end at "
        "data.eod_id, which belongs to the document it ends): attention, Engram's n-grams and its "
        "convolution stop at the boundary; RoPE positions keep counting from the sequence start");
}

void check_optimizer(const OptimizerCfg& o, int max_steps, const deck::Locate& locate) {
  KMOE_DECK_REQUIRE(o.lr > 0, "optimizer.lr", "optimizer.lr must be positive");
  KMOE_DECK_REQUIRE(o.beta1 >= 0 && o.beta1 < 1, "optimizer.beta1",
                    "optimizer.beta1 must be in [0, 1)");
  KMOE_DECK_REQUIRE(o.beta2 >= 0 && o.beta2 < 1, "optimizer.beta2",
                    "optimizer.beta2 must be in [0, 1)");
  KMOE_DECK_REQUIRE(o.eps > 0, "optimizer.eps", "optimizer.eps must be positive");
  KMOE_DECK_REQUIRE(o.weight_decay >= 0, "optimizer.weight_decay",
                    "optimizer.weight_decay must be non-negative");
  KMOE_DECK_REQUIRE(o.clip >= 0, "optimizer.clip", "optimizer.clip must be non-negative (0 = off)");
  // A warmup longer than the run is allowed (a shortened run never reaches the peak lr).
  KMOE_DECK_REQUIRE(o.warmup_steps >= 0, "optimizer.warmup_steps",
                    "optimizer.warmup_steps must be >= 0");
  KMOE_DECK_REQUIRE(o.final_lr_ratio >= 0 && o.final_lr_ratio <= 1, "optimizer.final_lr_ratio",
                    "optimizer.final_lr_ratio must be in [0, 1]");
  KMOE_DECK_REQUIRE(o.decay_steps >= 0, "optimizer.decay_steps",
                    "optimizer.decay_steps must be >= 0");
  if (o.schedule == LrSchedule::Wsd) {
    KMOE_DECK_REQUIRE(o.decay_steps >= 1 && o.decay_steps <= max_steps, "optimizer.decay_steps",
                      "optimizer.schedule = wsd needs optimizer.decay_steps in [1, "
                      "train.max_steps = "
                          << max_steps << "]");
  }
}

void declare_optimizer(deck::Schema& s, Config& c) {
  s.required(c.optimizer.lr, "lr", "peak learning rate");
  s.key(c.optimizer.beta1, "beta1", 0.9, "AdamW first-moment decay");
  s.key(c.optimizer.beta2, "beta2", 0.95, "AdamW second-moment decay");
  s.key(c.optimizer.eps, "eps", 1e-8, "AdamW epsilon");
  s.key(c.optimizer.weight_decay, "weight_decay", 0.1, "decoupled weight decay");
  s.key(c.optimizer.clip, "clip", 1.0, "global gradient-norm clip; 0 = off");
  s.key(c.optimizer.schedule, "schedule", LrSchedule::Cosine,
        "cosine | constant | wsd (warmup-stable-decay)");
  s.key(c.optimizer.warmup_steps, "warmup_steps", 0, "linear warmup steps");
  s.key(c.optimizer.final_lr_ratio, "final_lr_ratio", 0.1, "final lr as a fraction of lr");
  s.key(c.optimizer.decay_steps, "decay_steps", 0, "wsd: length of the final linear decay");
  s.key(c.optimizer.shard, "shard", OptimizerShard::None,
        "AdamW moments: none (every replica keeps all) | replicas (ZeRO-1: split over the ranks "
        "that hold the tensor; gradients reduce-scattered, parameters all-gathered; in bf16 runs "
        "the fp32 master weights of the product weights split too, bf16 copies gathered)");
}

void check_parallel(const Config& c, const deck::Locate& locate) {
  const ParallelCfg& p = c.parallel;
  KMOE_DECK_REQUIRE(p.pp >= 1, "parallel.pp", "parallel.pp must be at least 1");
  KMOE_DECK_REQUIRE(p.dp >= 1 || (p.dp_auto && p.dp == 0), "parallel.dp",
                    "parallel.dp must be at least 1 (or auto)");
  KMOE_DECK_REQUIRE(p.ep >= 1, "parallel.ep", "parallel.ep must be at least 1");
  // (dp = auto counts as 1 until resolved: pp * ep alone must fit then.)
  const std::int64_t ranks = std::int64_t(p.pp) * (p.dp_auto ? 1 : p.dp) * p.ep;
  KMOE_DECK_REQUIRE(ranks <= (std::int64_t(1) << 30), "parallel.dp",
                    "parallel.pp * parallel.dp * parallel.ep = " << ranks
                                                                 << " ranks is beyond any MPI job");
  KMOE_DECK_REQUIRE(p.pp <= c.model.n_layers, "parallel.pp",
                    "parallel.pp (" << p.pp << ") exceeds model.n_layers (" << c.model.n_layers
                                    << "): every stage needs a block");
  if (!p.pp_layers.empty()) {
    KMOE_DECK_REQUIRE(static_cast<int>(p.pp_layers.size()) == p.pp, "parallel.pp_layers",
                      "parallel.pp_layers has " << p.pp_layers.size() << " entries; parallel.pp = "
                                                << p.pp << " needs one per stage");
    std::int64_t sum = 0;
    for (std::size_t s = 0; s < p.pp_layers.size(); ++s) {
      KMOE_DECK_REQUIRE(p.pp_layers[s] >= 1, "parallel.pp_layers",
                        "parallel.pp_layers gives stage " << s << " " << p.pp_layers[s]
                                                          << " blocks; every stage needs one");
      sum += p.pp_layers[s];
    }
    KMOE_DECK_REQUIRE(
        sum == c.model.n_layers, "parallel.pp_layers",
        "parallel.pp_layers sums to " << sum << ", model.n_layers is " << c.model.n_layers);
  }
  KMOE_DECK_REQUIRE(p.watchdog_seconds >= 1, "parallel.watchdog_seconds",
                    "parallel.watchdog_seconds must be at least 1");
  KMOE_DECK_REQUIRE(p.spin_microseconds >= -1, "parallel.spin_microseconds",
                    "parallel.spin_microseconds must be -1 (never sleep) or at least 0");
  KMOE_DECK_REQUIRE(p.bucket_mb > 0, "parallel.bucket_mb", "parallel.bucket_mb must be positive");
#ifndef KMOE_HAVE_NCCL
  KMOE_DECK_REQUIRE(p.backend != CommBackend::Nccl, "parallel.backend",
                    "parallel.backend = nccl, but this build of kmoe lacks NCCL: configure it "
                    "with -DKMOE_ENABLE_NCCL=ON (and a CUDA Kokkos), or use "
                    "parallel.backend = mpi");
#endif
  // Every one of the dp*ep ranks of a stage takes whole micro-batches (RUNTIME.md section 2);
  // with dp = auto, checked once the launch's rank count has resolved it.
  if (p.dp == 0) return;
  const std::int64_t b = c.train.micro_batch;
  const std::int64_t unit = b * p.dp * p.ep;
  KMOE_DECK_REQUIRE(c.train.global_batch % unit == 0, "train.global_batch",
                    "train.global_batch (" << c.train.global_batch
                                           << ") must be divisible by train.micro_batch * "
                                              "parallel.dp * parallel.ep = "
                                           << b << " * " << p.dp << " * " << p.ep << " = " << unit);
}

void declare_parallel(deck::Schema& s, Config& c) {
  s.key(c.parallel.pp, "pp", 1, "pipeline stages");
  s.count_or_auto(c.parallel.dp, c.parallel.dp_auto, "dp", 1,
                  "data-parallel replicas; auto = the launch's ranks / (pp * ep)");
  s.key(c.parallel.ep, "ep", 1, "expert-parallel ranks");
  s.key(c.parallel.schedule, "schedule", PipeSchedule::OneFOneB, "pipeline schedule: 1f1b | gpipe");
  s.key(c.parallel.pp_layers, "pp_layers", std::vector<int>{},
        "blocks per stage, comma-separated (pp entries); empty = even split");
  s.key(c.parallel.engram_shard, "engram_shard", EngramShardGroup::None,
        "Engram tables: none (replicated) | ep | stage (row-block sharded)");
  s.key(c.parallel.watchdog_seconds, "watchdog_seconds", 300,
        "abort a rank stuck this long in a collective");
  s.key(c.parallel.spin_microseconds, "spin_microseconds", 200,
        "a rank waiting on an MPI transfer polls it this long, then sleeps 50 us between "
        "polls, leaving the core to ranks and threads that work (-1: never sleeps)");
  s.key(c.parallel.bucket_mb, "bucket_mb", 25.0,
        "gradient all-reduce bucket size (MiB); buckets start during the last backward");
  s.key(c.parallel.backend, "backend", CommBackend::Mpi, "data plane of the axes: mpi | nccl");
  s.key(c.parallel.cuda_aware_mpi, "cuda_aware_mpi", CudaAwareMpi::Auto,
        "MPI takes device pointers in every operation, nonblocking collectives included: "
        "true (refused with Open MPI, whose CUDA support has no nonblocking collectives) | "
        "false or auto (stage through pinned host memory)");
}

}  // namespace

deck::DeckSection train_deck_section() {
  return {"train", "sequence length, batch and steps", declare_train,
          [](const Config& c, const deck::Locate& l) { check_train(c.train, l); }, 3};
}

deck::DeckSection optimizer_deck_section() {
  return {"optimizer", "AdamW and the learning-rate schedule", declare_optimizer,
          [](const Config& c, const deck::Locate& l) {
            check_optimizer(c.optimizer, c.train.max_steps, l);
          },
          4};
}

deck::DeckSection parallel_deck_section() {
  return {"parallel", "process grid: world = pp * dp * ep ranks", declare_parallel, check_parallel,
          6};
}

}  // namespace kmoe
