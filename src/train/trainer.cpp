#include "train/trainer.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/memory.hpp"
#include "core/timer.hpp"
#include "train/optimizer.hpp"

namespace kmoe {

namespace {

// Deck keys declared for the full runtime whose machinery this build does not have yet: asking
// for them is an error, never a silent no-op.
void require_available(const Config& cfg) {
  const auto& c = cfg.checkpoint;
  KMOE_REQUIRE(c.every == 0 && !c.save_initial && (c.resume == "auto" || c.resume == "none"),
               "checkpointing (checkpoint.every, checkpoint.save_initial, checkpoint.resume = "
               "<file>) is not available in this build yet");
  KMOE_REQUIRE(cfg.output.dump_step.empty(),
               "output.dump_step is not available in this build yet");
}

}  // namespace

Trainer::Trainer(const Config& cfg, ProcessGrid& grid)
    : cfg_(cfg), grid_(grid), size_(model_size(cfg.model, cfg.train.micro_batch, cfg.train.seq_len)) {
  require_available(cfg);
  const auto& t = cfg.train;
  train_data_ = std::make_unique<TokenDataset>(cfg.data.paths, cfg.data.dtype, t.seq_len,
                                               cfg.model.vocab_size, "data.paths");
  KMOE_REQUIRE(train_data_->num_instances() >= t.global_batch,
               "data.paths: " << train_data_->num_instances() << " instances of train.seq_len "
                              << t.seq_len << " tokens, fewer than one train.global_batch ("
                              << t.global_batch << ")");
  if (!cfg.data.val_paths.empty())
    val_data_ = std::make_unique<TokenDataset>(cfg.data.val_paths, cfg.data.dtype, t.seq_len,
                                               cfg.model.vocab_size, "data.val_paths");
  stream_ = std::make_unique<InstanceStream>(train_data_->num_instances(), t.seed);

  stage_ = std::make_unique<Stage>(cfg.model, t.micro_batch, t.seq_len, table_);
  table_.allocate();
  table_.initialize(t.seed);
  host_tokens_.resize(std::size_t(t.micro_batch) * t.seq_len);

  if (grid_.is_root()) {
    metrics_ = std::make_unique<MetricsWriter>(cfg.output.dir, /*append=*/false);
    std::ofstream(cfg.output.dir + "/deck.resolved") << cfg.resolved_text;
  }
}

void Trainer::load_sequences(const TokenDataset& data, const std::vector<std::int64_t>& instances) {
  const int T = cfg_.train.seq_len;
  for (std::size_t i = 0; i < instances.size(); ++i)
    data.read_instance(instances[i], host_tokens_.data() + i * T);
}

StepMetrics Trainer::train_step(int step) {
  const auto& t = cfg_.train;
  const int b = t.micro_batch, T = t.seq_len, n_micro = t.global_batch / b;
  const int R = grid_.replicas(), me = grid_.replica();
  const double targets_per_micro = double(b) * (T - 1);
  const float grad_scale = static_cast<float>(1.0 / (n_micro * targets_per_micro));
  const auto t_step = std::chrono::steady_clock::now();
  PhaseTimer timer;

  Kokkos::deep_copy(table_.grads, 0.0f);
  double sums[2] = {0.0, 0.0};  // CE and z sums over this rank's micro-batches
  std::vector<std::int64_t> ids(b);
  timer.start();
  for (int j = me; j < n_micro; j += R) {  // micro-batch j of the step goes to replica j mod R
    for (int i = 0; i < b; ++i) ids[i] = stream_->instance_at(next_position_ + std::int64_t(j) * b + i);
    load_sequences(*train_data_, ids);
    timer.stop(phases_.data);
    const LossSums s = stage_->forward(table_, host_tokens_.data(), b, grad_scale);
    timer.stop(phases_.forward);
    stage_->backward(table_);
    timer.stop(phases_.backward);
    sums[0] += s.ce;
    sums[1] += s.z;
  }
  next_position_ += t.global_batch;

  grid_.stage.allreduce_sum(table_.grads.data(), table_.total_elements());
  grid_.stage.allreduce_sum(sums, 2);
  timer.stop(phases_.comm);

  const double total_targets = n_micro * targets_per_micro;
  StepMetrics m;
  m.step = step;
  m.ce = sums[0] / total_targets;
  m.aux = cfg_.model.output_z_coef * sums[1] / total_targets;
  m.loss = m.ce + m.aux;
  m.grad_norm = std::sqrt(grad_sq_sum(table_));
  if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
    std::ostringstream os;
    os << "non-finite " << (std::isfinite(m.loss) ? "gradient norm" : "loss") << " at step "
       << step << " (loss " << m.loss << ", gradient norm " << m.grad_norm
       << "); stopping without a checkpoint";
    throw NonFiniteError(os.str());
  }
  const double clip = cfg_.optimizer.clip;
  const double clip_scale = clip > 0 ? std::min(1.0, clip / (m.grad_norm + 1e-6)) : 1.0;
  m.lr = learning_rate(cfg_.optimizer, t.max_steps, step);
  adamw_step(cfg_.optimizer, table_, step, m.lr, clip_scale);
  timer.stop(phases_.optimizer);

  m.step_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
  m.step_time_s = grid_.world.allreduce_max(m.step_time_s);
  const double tokens = double(t.global_batch) * T;
  m.tokens_per_s = tokens / m.step_time_s;
  m.tokens_per_s_per_rank = m.tokens_per_s / grid_.world.size();
  m.model_flops_per_s = m.tokens_per_s * size_.flops_per_token;
  if (cfg_.output.peak_flops > 0)
    m.mfu = m.model_flops_per_s / (cfg_.output.peak_flops * grid_.world.size());
  m.mem_hwm_mib = grid_.world.allreduce_max(peak_rss_mib());
  return m;
}

EvalResult Trainer::evaluate() {
  KMOE_REQUIRE(val_data_, "evaluation needs data.val_paths");
  const int b = cfg_.train.micro_batch, T = cfg_.train.seq_len;
  std::int64_t n = val_data_->num_instances();
  if (cfg_.train.eval_instances > 0) n = std::min<std::int64_t>(n, cfg_.train.eval_instances);
  // Batches of b instances in file order, batch c on replica c mod R; per-instance sums are
  // combined exactly (every other replica contributes 0) and added in instance order.
  std::vector<double> per_instance(n, 0.0);
  std::vector<std::int64_t> ids;
  const std::int64_t n_batches = (n + b - 1) / b;
  for (std::int64_t c = grid_.replica(); c < n_batches; c += grid_.replicas()) {
    ids.clear();
    for (std::int64_t i = c * b; i < std::min(n, (c + 1) * b); ++i) ids.push_back(i);
    load_sequences(*val_data_, ids);
    const LossSums s = stage_->forward(table_, host_tokens_.data(), ids.size(), 0.0f);
    for (std::size_t i = 0; i < ids.size(); ++i) per_instance[ids[i]] = s.seq_ce[i];
  }
  grid_.stage.allreduce_sum(per_instance.data(), n);
  double sum = 0.0;
  for (double v : per_instance) sum += v;
  EvalResult r;
  r.tokens = n * (T - 1);
  r.loss = sum / r.tokens;
  return r;
}

void Trainer::run() {
  const auto& t = cfg_.train;
  for (int step = first_step_; step <= t.max_steps; ++step) {
    StepMetrics m = train_step(step);
    const bool eval_now = val_data_ && ((t.eval_every > 0 && step % t.eval_every == 0) ||
                                        step == t.max_steps);
    if (eval_now) {
      PhaseTimer timer;
      m.val_loss = evaluate().loss;
      timer.stop(phases_.eval);
    }
    history_.push_back(m);
    const bool log_now = step % cfg_.output.log_every == 0 || step == t.max_steps || eval_now;
    if (grid_.is_root() && log_now) {
      std::printf("%s\n", MetricsWriter::console_line(m).c_str());
      std::fflush(stdout);
      metrics_->write(m);
    }
  }
  if (grid_.is_root()) {
    const auto& p = phases_;
    std::printf("time per phase (rank 0, s): data %.2f forward %.2f backward %.2f comm %.2f "
                "optimizer %.2f eval %.2f\n",
                p.data, p.forward, p.backward, p.comm, p.optimizer, p.eval);
  }
}

}  // namespace kmoe
