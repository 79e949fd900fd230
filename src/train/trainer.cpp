#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/memory.hpp"
#include "core/timer.hpp"
#include "io/dump.hpp"
#include "modules/moe/moe.hpp"
#include "train/optimizer.hpp"

namespace kmoe {

Trainer::Trainer(const Config& cfg, ProcessGrid& grid)
    : cfg_(cfg), grid_(grid), size_(model_size(cfg.model, cfg.moe, cfg.train.micro_batch, cfg.train.seq_len, cfg.engram)) {
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

  stage_ = std::make_unique<Stage>(cfg.model, cfg.moe, t.micro_batch, t.seq_len, table_,
                                   cfg.engram);
  table_.allocate();
  table_.initialize(t.seed);
  host_tokens_.resize(std::size_t(t.global_batch) * t.seq_len);

  const std::string from = resume_file(cfg.checkpoint);
  if (!from.empty()) {
    std::string changes;
    state_ = load_checkpoint(from, cfg, grid, table_, /*with_optimizer=*/true, &changes);
    resumed_ = true;
    if (grid_.is_root()) {
      std::printf("resuming from %s after step %d (data position %lld)\n", from.c_str(),
                  state_.step, static_cast<long long>(state_.next_position));
      if (!changes.empty()) std::printf("deck changes since the checkpoint:%s\n", changes.c_str());
    }
  }
  for (int l = 0; l < cfg.model.n_layers; ++l) {
    if (!cfg.moe.is_moe_layer(l)) continue;
    moe_layers_.push_back(l);
    const std::string p = "moe" + std::to_string(l) + "_";
    for (const char* c : {"lb", "rz", "load_max_mean"}) moe_columns_.push_back(p + c);
    if (cfg.moe.capacity_factor > 0) moe_columns_.push_back(p + "drop");
  }
  for (int l = 0; l < cfg.model.n_layers; ++l)  // block order, as the stage reports them
    if (std::find(cfg.engram.layers.begin(), cfg.engram.layers.end(), l) != cfg.engram.layers.end())
      for (const char* c : {"_gate", "_rows_touched"})
        moe_columns_.push_back("engram" + std::to_string(l) + c);
  if (grid_.is_root()) {
    metrics_ = std::make_unique<MetricsWriter>(cfg.output.dir, /*append=*/resumed_, moe_columns_);
    std::ofstream(cfg.output.dir + "/deck.resolved") << cfg.resolved_text;
  }
}

void Trainer::load_positions(std::int64_t first, int count) {
  const int T = cfg_.train.seq_len;
  for (int i = 0; i < count; ++i)
    train_data_->read_instance(stream_->instance_at(first + i), host_tokens_.data() + std::size_t(i) * T);
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
  const auto& dumps = cfg_.output.dump_step;
  const bool dump = std::find(dumps.begin(), dumps.end(), step) != dumps.end();
  StepDump d{step, 0, 0, 0, 0, 0, {}, t.global_batch, T, {}, cfg_.moe.top_k};
  double sums[3] = {0.0, 0.0, 0.0};  // CE, z and MoE aux sums over this rank's micro-batches
  // Per MoE layer: LB sum, RZ sum, dropped, then E loads (summed over micro-batches).
  const int E = cfg_.moe.experts, per_layer = 3 + E;
  std::vector<double> moe_sums(moe_layers_.size() * per_layer, 0.0);
  const auto engrams = stage_->engram_layers();
  std::vector<double> engram_gate(engrams.size(), 0.0);  // summed over micro-batches
  for (const auto& [block, layer] : engrams) layer->reset_touched();
  timer.start();
  for (int j = me; j < n_micro; j += R) {  // micro-batch j of the step goes to replica j mod R
    load_positions(state_.next_position + std::int64_t(j) * b, b);
    timer.stop(phases_.data);
    const LossSums s = stage_->forward(table_, host_tokens_.data(), b, grad_scale);
    timer.stop(phases_.forward);
    stage_->backward(table_);
    timer.stop(phases_.backward);
    if (dump) record_routes(d, j * b * T);
    sums[0] += s.ce;
    sums[1] += s.z;
    sums[2] += s.moe_aux;
    for (std::size_t i = 0; i < engram_gate.size(); ++i)
      engram_gate[i] += engrams[i].second->mean_gate();
    for (std::size_t i = 0; i < s.moe.size(); ++i) {
      const MoeStats& st = s.moe[i].second;
      double* acc = moe_sums.data() + i * per_layer;
      acc[0] += st.lb;
      acc[1] += st.rz;
      acc[2] += st.dropped;
      for (int e = 0; e < E; ++e) acc[3 + e] += st.load[e];
    }
  }
  grid_.stage.allreduce_sum(table_.grads.data(), table_.total_elements());
  grid_.stage.allreduce_sum(sums, 3);
  grid_.stage.allreduce_sum(moe_sums.data(), moe_sums.size());
  grid_.stage.allreduce_sum(engram_gate.data(), engram_gate.size());
  timer.stop(phases_.comm);

  const double total_targets = n_micro * targets_per_micro;
  StepMetrics m;
  m.step = step;
  m.ce = sums[0] / total_targets;
  // Step loss = mean over micro-batches of CE_mb + zc Z_mb + MoE aux_mb (MODEL.md section 2).
  m.aux = cfg_.model.output_z_coef * sums[1] / total_targets + sums[2] / n_micro;
  m.loss = m.ce + m.aux;
  for (std::size_t i = 0; i < moe_layers_.size(); ++i) {
    const double* acc = moe_sums.data() + i * per_layer;
    double max_load = 0.0, total = 0.0;
    for (int e = 0; e < E; ++e) {
      max_load = std::max(max_load, acc[3 + e]);
      total += acc[3 + e];
    }
    const std::string p = "moe" + std::to_string(moe_layers_[i]) + "_";
    m.extra.emplace_back(p + "lb", acc[0] / n_micro);
    m.extra.emplace_back(p + "rz", acc[1] / n_micro);
    m.extra.emplace_back(p + "load_max_mean", total > 0 ? max_load / (total / E) : 0.0);
    if (cfg_.moe.capacity_factor > 0) m.extra.emplace_back(p + "drop", acc[2] / total);
  }
  for (std::size_t i = 0; i < engrams.size(); ++i) {
    // Distinct rows looked up by the whole global batch: lookup counts summed over the stage.
    auto counts = Kokkos::create_mirror_view_and_copy(HostSpace(), engrams[i].second->touched());
    grid_.stage.allreduce_sum(counts.data(), counts.size());
    std::int64_t used = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) used += counts(r) > 0;
    const std::string p = "engram" + std::to_string(engrams[i].first);
    m.extra.emplace_back(p + "_gate", engram_gate[i] / n_micro);
    m.extra.emplace_back(p + "_rows_touched", double(used) / counts.size());
  }
  m.grad_norm = std::sqrt(grad_sq_sum(table_));
  m.lr = learning_rate(cfg_.optimizer, t.max_steps, step);
  if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
    std::ostringstream os;
    os << "non-finite " << (std::isfinite(m.loss) ? "gradient norm" : "loss") << " at step "
       << step << " (loss " << m.loss << ", gradient norm " << m.grad_norm
       << "); stopping without a checkpoint";
    throw NonFiniteError(os.str());
  }
  if (dump) {
    d.loss = m.loss;
    d.ce = m.ce;
    d.aux = m.aux;
    d.grad_norm = m.grad_norm;
    d.lr = m.lr;
    for (auto& route : d.routes) grid_.stage.allreduce_sum(route.second.data(), route.second.size());
    load_positions(state_.next_position, t.global_batch);
    d.tokens.assign(host_tokens_.begin(), host_tokens_.end());
    write_step_dump(cfg_, grid_, table_, d);
    timer.stop(phases_.checkpoint);
  }
  const double clip = cfg_.optimizer.clip;
  const double clip_scale = clip > 0 ? std::min(1.0, clip / (m.grad_norm + 1e-6)) : 1.0;
  adamw_step(cfg_.optimizer, table_, step, m.lr, clip_scale);
  if (cfg_.moe.bias_update_rate > 0) {
    // Every rank holds the same global counts, so the replicated biases stay identical.
    for (std::size_t i = 0; i < moe_layers_.size(); ++i) {
      const double* acc = moe_sums.data() + i * per_layer + 3;
      const int idx = table_.find("blocks." + std::to_string(moe_layers_[i]) + ".moe.router_bias");
      update_router_bias(table_, idx, std::vector<double>(acc, acc + E), cfg_.moe.bias_update_rate);
    }
  }
  timer.stop(phases_.optimizer);

  state_.step = step;
  state_.next_position += t.global_batch;
  state_.tokens_seen += std::int64_t(t.global_batch) * T;

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

void Trainer::record_routes(StepDump& d, std::int64_t first_token) {
  // Each replica fills its own micro-batches' rows; the others stay 0, so a sum over the stage
  // assembles the global batch exactly.
  const auto routes = stage_->moe_routes();
  if (d.routes.empty())
    for (const auto& r : routes)
      d.routes.emplace_back(r.first, std::vector<std::int32_t>(std::size_t(d.global_batch) *
                                                               d.seq_len * d.top_k, 0));
  for (std::size_t i = 0; i < routes.size(); ++i) {
    auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), routes[i].second);
    std::copy(h.data(), h.data() + h.size(), d.routes[i].second.begin() + first_token * d.top_k);
  }
}

void Trainer::run() {
  const auto& t = cfg_.train;
  const auto& c = cfg_.checkpoint;
  PhaseTimer timer;
  if (!resumed_ && c.save_initial) {
    save_checkpoint(cfg_, grid_, table_, state_);
    timer.stop(phases_.checkpoint);
  }
  if (state_.step >= t.max_steps && grid_.is_root())
    std::printf("nothing to do: the checkpoint is at step %d, train.max_steps = %d\n",
                state_.step, t.max_steps);
  for (int step = state_.step + 1; step <= t.max_steps; ++step) {
    StepMetrics m = train_step(step);
    timer.start();
    const bool eval_now = val_data_ && ((t.eval_every > 0 && step % t.eval_every == 0) ||
                                        step == t.max_steps);
    if (eval_now) {
      m.val_loss = evaluate(*stage_, table_, *val_data_, grid_, t.micro_batch, t.eval_instances).loss;
      timer.stop(phases_.eval);
    }
    if ((c.every > 0 && step % c.every == 0) || step == t.max_steps) {
      save_checkpoint(cfg_, grid_, table_, state_);
      timer.stop(phases_.checkpoint);
    }
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
                "optimizer %.2f eval %.2f checkpoint %.2f\n",
                p.data, p.forward, p.backward, p.comm, p.optimizer, p.eval, p.checkpoint);
  }
}

}  // namespace kmoe
