#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "core/device_sync.hpp"
#include "core/fault_injection.hpp"
#include "core/gemm.hpp"
#include "core/memory.hpp"
#include "core/process_phase.hpp"
#include "core/stop_signal.hpp"
#include "core/timer.hpp"
#include "io/run_lock.hpp"
#include "io/tokenizer.hpp"
#include "parallel/layer_comms.hpp"
#include "parallel/placement.hpp"
#include "train/memory_check.hpp"
#include "train/optimizer.hpp"

namespace kmoe {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void require_finite(const StepMetrics& m) {
  if (std::isfinite(m.loss) && std::isfinite(m.grad_norm)) return;
  std::ostringstream os;
  os << "non-finite " << (std::isfinite(m.loss) ? "gradient norm" : "loss") << " at step " << m.step
     << " (loss " << m.loss << ", gradient norm " << m.grad_norm
     << "); stopping without a checkpoint";
  throw NonFiniteError(os.str());
}
}  // namespace

Trainer::Trainer(const Config& cfg, ProcessGrid& grid, const RunContext& ctx)
    : cfg_(cfg),
      grid_(grid),
      size_(model_size(cfg.model, cfg.moe, cfg.train.micro_batch, cfg.train.seq_len, cfg.engram)) {
  const auto& t = cfg.train;
  lock_ = std::make_unique<RunLock>(cfg.checkpoint, grid.world);  // this run owns the directory
  train_data_ = std::make_unique<TokenDataset>(cfg.data.paths, cfg.data.dtype, t.seq_len,
                                               cfg.model.vocab_size, "data.paths");
  KMOE_REQUIRE(train_data_->num_instances() >= t.global_batch,
               "data.paths: " << train_data_->num_instances() << " instances of train.seq_len "
                              << t.seq_len << " tokens, fewer than one train.global_batch ("
                              << t.global_batch << ")");
  if (!cfg.data.val_paths.empty())
    val_data_ = std::make_unique<TokenDataset>(cfg.data.val_paths, cfg.data.dtype, t.seq_len,
                                               cfg.model.vocab_size, "data.val_paths");
  check_deck_tokenizer(cfg.data, cfg.model.vocab_size);  // the checkpoints will name it
  stream_ = std::make_unique<InstanceStream>(train_data_->num_instances(), t.seed);
  if (val_data_) validator_ = std::make_unique<Validator>(cfg, *val_data_);
  checkpointer_ = std::make_unique<Checkpointer>(cfg, grid);

  // This rank's micro-batches per step and the pipeline schedule over them; one Stage instance
  // per micro-batch the schedule keeps in flight, all on the same parameters.
  pipeline_ = std::make_unique<PipelineRunner>(
      grid, cfg.parallel.schedule, micro_batches() / grid.replicas(), t.micro_batch,
      std::int64_t(t.micro_batch) * t.seq_len * cfg.model.d_model);
  check_memory(cfg, grid, pipeline_->instances(), ctx);
  const StagePlan plan = StagePlan::of(grid);
  const LayerComms comms = layer_comms(cfg, grid);
  // The instances share one workspace; under recompute every block of every instance takes its
  // saved buffers from the pool too.
  pool_ = std::make_unique<ActivationPool>(/*blocks_share=*/t.recompute == Recompute::Block);
  ctx_ = ctx;
  ctx_.pool = pool_.get();
  for (int i = 0; i < pipeline_->instances(); ++i) {
    stages_.push_back(std::make_unique<Stage>(ctx_, cfg.model, cfg.moe, t.micro_batch, t.seq_len,
                                              table_, cfg.engram, plan, comms, &stats_));
    if (i == 0) {  // later instances share the first one's tensors
      // The buckets, and with optimizer.shard the moments this rank keeps, from the tensors.
      // bf16 runs keep the gemm_only tensors as bf16 compute copies, rounded once per step
      // (sharded: with sharded fp32 masters, the copies all-gathered).
      const bool shard = cfg.optimizer.shard == OptimizerShard::Replicas;
      const bool copies = t.precision == Precision::Bf16;
      reducer_ = std::make_unique<GradReducer>(table_, grid, cfg.parallel.bucket_mb,
                                               cfg.model.tie_embeddings, shard, shard && copies);
      table_.allocate(shard ? &reducer_->moment_slices() : nullptr, copies);
      table_.initialize(t.seed);
    }
  }
  owned_.resize(table_.size());
  for (int i = 0; i < table_.size(); ++i) owned_[i] = owns(table_.entry(i).spec, grid);
  optimizer_ = std::make_unique<FlatOptimizer>(table_, &owned_);
  host_tokens_ = decltype(host_tokens_)(Kokkos::view_alloc("trainer::host_tokens"),
                                        std::size_t(t.global_batch) * t.seq_len);

  const std::string from = resume_file(cfg.checkpoint);
  prepare_run_directories(cfg, !from.empty(), lock_->requeued_own(), grid.world);
  if (!from.empty()) {
    std::string changes;
    const auto t0 = std::chrono::steady_clock::now();
    state_ = load_checkpoint(from, cfg, grid, table_, /*with_optimizer=*/true, &changes);
    grid_.world.barrier();
    const double secs = seconds_since(t0);
    resumed_ = true;
    if (grid_.is_root()) {
      const double mib = std::filesystem::file_size(from) / (1024.0 * 1024.0);
      std::printf(
          "resuming from %s after step %d (data position %lld); loaded %.1f MiB in "
          "%.3f s (%.1f MiB/s)\n",
          from.c_str(), state_.step, static_cast<long long>(state_.next_position), mib, secs,
          mib / secs);
      if (!changes.empty()) std::printf("deck changes since the checkpoint:%s\n", changes.c_str());
    }
  }
  grid_.world.on_root([&] {
    metrics_ = std::make_unique<MetricsWriter>(cfg.output.dir, /*append=*/resumed_, stats_.names(),
                                               state_.step);
    const std::string deck = cfg.output.dir + "/deck.resolved";
    std::ofstream out(deck);
    out << cfg.resolved_text;
    out.close();
    KMOE_REQUIRE(!out.fail(), "output.dir: cannot write " << deck << " (is the file system full?)");
  });
}

void Trainer::load_positions(std::int64_t first, int count, int at) {
  const int T = cfg_.train.seq_len;
  for (int i = 0; i < count; ++i)
    train_data_->read_instance(stream_->instance_at(first + i),
                               host_tokens_.data() + std::size_t(at + i) * T);
}

StepMetrics Trainer::train_step(int step) {
  ProfileRegion region("kmoe::step");
  set_phase("step", step);
  stall_if_requested(grid_.world.rank(), step);
  pause_if_requested(grid_.world.rank(), step);
  crash_if_requested(grid_.world.rank(), step);
  const auto t_step = std::chrono::steady_clock::now();
  const double comm_at_start = comm_wait_seconds();
  PhaseTimer timer(cfg_.output.phase_timing);
  begin_step();
  const auto& dumps = cfg_.output.dump_step;
  std::optional<StepDump> dump;
  if (std::find(dumps.begin(), dumps.end(), step) != dumps.end())
    dump = StepDump{step, 0, 0, 0, 0, 0, {}, cfg_.train.global_batch, cfg_.train.seq_len, {},
                    cfg_.moe.top_k};

  // This rank's micro-batches through the pipeline schedule; the gradient buckets start
  // reducing as the step's last backward completes them.
  StepFeed feed;
  feed.tokens = [this](int micro) { return micro_batch_tokens(micro); };
  if (dump)
    feed.after_forward = [&](const Stage& stage, int micro) {
      record_routes(stage, *dump, first_token(micro));
    };
  feed.gradients_ready = [this](int k) { reducer_->ready_from(k); };
  timer.start();
  pipeline_->run(stages_, table_, grad_scale(), loss_sums_, feed, timer, phases_);

  // Gradients, loss terms and the layers' statistics summed; the global gradient norm.
  StepMetrics m = reduce_step(step);
  timer.stop(phases_.reduce);
  m.grad_norm = global_grad_norm();
  m.lr = learning_rate(cfg_.optimizer, cfg_.train.max_steps, step);
  require_finite(m);
  if (dump) {
    write_dump(*dump, m);
    timer.stop(phases_.checkpoint);
  }

  // Clip, AdamW, and what follows the update.
  const double clip = cfg_.optimizer.clip;
  const double clip_scale = clip > 0 ? std::min(1.0, clip / (m.grad_norm + 1e-6)) : 1.0;
  optimizer_->adamw_step(cfg_.optimizer, table_, step, m.lr, clip_scale);
  reducer_->gather_params();  // sharded: every replica's updated rows to all
  stages_[0]->after_optimizer_step(table_, stats_);
  timer.stop(phases_.optimizer);

  advance_state(step);
  // The slowest rank's step time (its wait counts as communication), then the rest.
  m.step_time_s = grid_.world.allreduce_max(seconds_since(t_step));
  m.comm_s = comm_wait_seconds() - comm_at_start;
  phases_.comm_wait += m.comm_s;
  add_throughput(m);
  return m;
}

void Trainer::begin_step() {
  table_.zero_grads();
  Kokkos::deep_copy(ExecSpace(), loss_sums_, 0.0);
  stats_.begin_step();
}

double Trainer::targets_per_micro() const {
  return double(cfg_.train.micro_batch) * (cfg_.train.seq_len - 1);
}

int Trainer::micro_batches() const { return cfg_.train.global_batch / cfg_.train.micro_batch; }

float Trainer::grad_scale() const {
  return static_cast<float>(1.0 / (micro_batches() * targets_per_micro()));
}

std::int64_t Trainer::first_sequence(int micro) const {
  // The rank's micro-batches i = 0..M-1 are the step's micro-batches j = me + i*R (RUNTIME.md
  // section 2).
  const int j = grid_.replica() + micro * grid_.replicas();
  return std::int64_t(j) * cfg_.train.micro_batch;
}

std::int64_t Trainer::first_token(int micro) const {
  return first_sequence(micro) * cfg_.train.seq_len;
}

const std::int32_t* Trainer::micro_batch_tokens(int micro) {
  const int b = cfg_.train.micro_batch;
  // The micro-batch's own region: an earlier upload may still be reading another.
  load_positions(state_.next_position + first_sequence(micro), b, micro * b);
  return host_tokens_.data() + std::size_t(micro) * b * cfg_.train.seq_len;
}

StepMetrics Trainer::reduce_step(int step) {
  reducer_->finish();
  double sums[3] = {0.0, 0.0, 0.0};  // CE, z and MoE sums over this rank's micro-batches
  if (grid_.last_stage() || stages_[0]->has_moe()) {  // CE and z on the last stage, MoE on any
    auto h = read_to_host("loss sums", loss_sums_);
    for (int i = 0; i < 3; ++i) sums[i] = h(i);
  }
  // Loss terms and the layers' statistics: each rank holds its own micro-batches' share of the
  // layers on its stage; a sum over the world assembles the global batch.
  grid_.world.allreduce_sum(sums, 3);
  stages_[0]->finish_step(stats_, grid_);  // on the device, before the gather
  stats_.gather_device();
  grid_.world.allreduce_sum(stats_.sums(), stats_.num_sums());

  StepMetrics m;
  m.step = step;
  const int n_micro = micro_batches();
  const double total_targets = n_micro * targets_per_micro();
  m.ce = sums[0] / total_targets;
  // Step loss = mean over micro-batches of CE_mb + zc Z_mb + MoE aux_mb (MODEL.md section 2).
  m.aux = cfg_.model.output_z_coef * sums[1] / total_targets + sums[2] / n_micro;
  m.loss = m.ce + m.aux;
  m.layer_stats = stats_.finish(n_micro);
  m.summaries = stats_.summaries(m.layer_stats);
  return m;
}

double Trainer::global_grad_norm() const {
  // Every parameter once: each rank sums the squares of what it owns.
  double sq = optimizer_->grad_sq_sum(table_);
  grid_.world.allreduce_sum(&sq, 1);
  return std::sqrt(sq);
}

void Trainer::advance_state(int step) {
  state_.step = step;
  state_.next_position += cfg_.train.global_batch;
  state_.tokens_seen += std::int64_t(cfg_.train.global_batch) * cfg_.train.seq_len;
}

void Trainer::add_throughput(StepMetrics& m) const {
  const double tokens = double(cfg_.train.global_batch) * cfg_.train.seq_len;
  m.tokens_per_s = tokens / m.step_time_s;
  m.tokens_per_s_per_rank = m.tokens_per_s / grid_.world.size();
  m.model_flops_per_s = m.tokens_per_s * size_.flops_per_token;
  if (cfg_.output.peak_flops > 0)
    m.mfu = m.model_flops_per_s / (cfg_.output.peak_flops * grid_.world.size());
  m.mem_hwm_mib = grid_.world.allreduce_max(peak_rss_mib());
}

void Trainer::write_dump(StepDump& d, const StepMetrics& m) {
  d.loss = m.loss;
  d.ce = m.ce;
  d.aux = m.aux;
  d.grad_norm = m.grad_norm;
  d.lr = m.lr;
  for (auto& route : d.routes) grid_.world.allreduce_sum(route.second.data(), route.second.size());
  load_positions(state_.next_position, cfg_.train.global_batch);
  d.tokens.assign(host_tokens_.data(), host_tokens_.data() + host_tokens_.extent(0));
  write_step_dump(cfg_, grid_, table_, d);
}

void Trainer::record_routes(const Stage& stage, StepDump& d, std::int64_t first_token) const {
  // Each rank fills its own micro-batches' rows of its stage's MoE layers; the others stay 0,
  // so a sum over the world assembles the global batch exactly.
  if (d.routes.empty())
    for (int l = 0; l < cfg_.model.n_layers; ++l)
      if (cfg_.moe.is_moe_layer(l))
        d.routes.emplace_back(
            l, std::vector<std::int32_t>(std::size_t(d.global_batch) * d.seq_len * d.top_k, 0));
  for (const auto& [block, route] : stage.moe_routes()) {
    auto h = read_to_host("route dump", route);
    for (auto& r : d.routes)
      if (r.first == block)
        std::copy(h.data(), h.data() + h.size(), r.second.begin() + first_token * d.top_k);
  }
}

void Trainer::run() {
  install_stop_handlers();
  const int last = cfg_.train.max_steps;
  PhaseTimer timer;
  if (checkpointer_->should_save_initial()) {  // the state the run starts from
    set_phase("the save of step", state_.step);
    checkpointer_->save(table_, state_);
    timer.stop(phases_.checkpoint);
  }
  if (state_.step >= last && grid_.is_root())
    std::printf("nothing to do: the checkpoint is at step %d, train.max_steps = %d\n", state_.step,
                last);
  const int first = state_.step + 1;
  for (int step = first; step <= last; ++step) {
    StepMetrics m = train_step(step);
    timer.start();
    const bool eval_now = validator_ && validator_->should_validate(step);
    if (eval_now) {
      m.val_loss = validator_->validate(*stages_[0], table_, grid_);
      timer.stop(phases_.eval);
    }
    const StopKind stop = agreed_stop();
    const bool stopping = stop != StopKind::None;
    const bool log_now = MetricsWriter::due(cfg_.output.log_every, step, last) || eval_now ||
                         stopping;
    // A metrics row that cannot be written (a full output disk) stops the run too, after a
    // checkpoint.
    const std::string output_error = agreed_output_error(log_now ? write_metrics(m, step) : "",
                                                         step);
    if (checkpointer_->should_save(step, stopping) || !output_error.empty()) {
      save_after_step(step, output_error);
      timer.stop(phases_.checkpoint);
    }
    if (grid_.is_root() && log_now) {
      std::printf("%s\n", MetricsWriter::console_line(m).c_str());
      std::fflush(stdout);
    }
    if (grid_.is_root() && step == first && !grouped_batch_note().empty()) {
      // Decided by the first grouped batch (attention's tiles): how this build ran them.
      std::printf("note: %s\n", grouped_batch_note().c_str());
      std::fflush(stdout);
    }
    if (!output_error.empty())
      throw SharedError(output_error + "; stopped after step " + std::to_string(step) +
                        " with checkpoint " + cfg_.checkpoint.dir + "/" +
                        checkpoint_file_name(step));
    if (stopping && step < last) stop_after(step, stop);
  }
  print_phases();
  if (grid_.is_root()) report_exit_code(0);
}

// ---- What every rank must agree on after a step -------------------------------------------

StopKind Trainer::agreed_stop() const {
  // A stop signal on any rank: every rank checkpoints this step and stops.
  return static_cast<StopKind>(
      static_cast<int>(grid_.world.allreduce_max(double(static_cast<int>(requested_stop())))));
}

std::string Trainer::write_metrics(const StepMetrics& m, int step) {
  if (!grid_.is_root()) return "";
  try {
    metrics_->write(m, step);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string Trainer::agreed_output_error(const std::string& mine, int step) const {
  // Every rank learns of a failed metrics write and of a lost run lock (another run took the
  // directory over while this one stalled) before the save; a lost lock stops at once.
  double trouble[2] = {mine.empty() ? 0.0 : 1.0, lock_->lost() ? 1.0 : 0.0};
  grid_.world.allreduce_sum(trouble, 2);
  if (trouble[1] > 0)
    throw SharedError(cfg_.checkpoint.dir +
                      "/kmoe.lock was taken over by another run (this "
                      "one made no heartbeat for checkpoint.lock_stale_seconds): stopping "
                      "after step " +
                      std::to_string(step) + " without a checkpoint");
  return trouble[0] > 0 ? grid_.world.first_message(mine) : std::string();
}

void Trainer::save_after_step(int step, const std::string& output_error) {
  set_phase("the save of step", step);
  try {
    checkpointer_->save(table_, state_);
  } catch (const Error& e) {  // the same full disk, most likely: say both
    if (output_error.empty()) throw;
    throw SharedError(output_error + "; and the checkpoint of step " + std::to_string(step) +
                      " could not be saved either: " + e.what());
  }
}

void Trainer::stop_after(int step, StopKind stop) {
  // A cancel that arrived during the save (SIGUSR1, then SIGTERM: a preemption notice followed
  // by a cancel) wins over the requeue.
  if (stop != StopKind::Cancel) stop = std::max(stop, agreed_stop());
  print_phases();
  const bool cancel = stop == StopKind::Cancel;
  const std::string by = *stop_signal_name() ? stop_signal_name() : "a signal to another rank";
  std::ostringstream os;
  os << "stopped by " << by << " after step " << step << " with checkpoint " << cfg_.checkpoint.dir
     << "/" << checkpoint_file_name(step) << "; exit code "
     << (cancel ? "86 (resumable, do not requeue)" : "85 (requeue)");
  if (grid_.is_root()) report_exit_code(cancel ? 86 : 85);
  throw StopRequest(cancel ? 86 : 85, os.str());
}

void Trainer::print_phases() const {
  if (grid_.is_root()) {
    const auto& p = phases_;
    if (cfg_.output.phase_timing)
      std::printf(
          "time per phase (rank 0, s): data %.2f forward %.2f backward %.2f pipeline %.2f "
          "reduce %.2f optimizer %.2f eval %.2f checkpoint %.2f; waiting on "
          "communication in training steps %.2f\n",
          p.data, p.forward, p.backward, p.pipeline, p.reduce, p.optimizer, p.eval, p.checkpoint,
          p.comm_wait);
    else
      std::printf(
          "time per phase (rank 0, s): eval %.2f checkpoint %.2f (the step's phases: "
          "output.phase_timing = true); waiting on communication in training steps %.2f\n",
          p.eval, p.checkpoint, p.comm_wait);
  }
}

}  // namespace kmoe
