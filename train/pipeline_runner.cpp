#include "train/pipeline_runner.hpp"

namespace kmoe {

PipelineRunner::PipelineRunner(const ProcessGrid& grid, PipeSchedule kind, int micro, int seqs,
                               std::int64_t activation_floats)
    : grid_(grid),
      pipe_(grid.data_plane(grid.pipe)),
      ops_(pipeline_schedule(kind, grid.pp, grid.pp_rank, micro)),
      seqs_(seqs),
      floats_(activation_floats) {}

void PipelineRunner::send_held() {
  if (!held_.data) return;
  sends_[held_.instance] = pipe_.start_send(held_.data, floats_, held_.peer);
  held_ = Held();
}

void PipelineRunner::receive(float* into, int from) {
  if (!held_.data) return pipe_.recv(into, floats_, from);
  sends_[held_.instance] =
      pipe_.start_send_recv(held_.data, floats_, held_.peer, into, floats_, from);
  held_ = Held();
}

void PipelineRunner::run(const std::vector<std::unique_ptr<Stage>>& stages, TensorTable& table,
                         float grad_scale, View1D loss_sums, const StepFeed& feed,
                         PhaseTimer& timer, PhaseTotals& phases) {
  const int S = static_cast<int>(stages.size());
  sends_.clear();
  sends_.resize(S);
  held_ = Held();
  for (std::size_t k = 0; k < ops_.size(); ++k) {
    const PipeOp op = ops_[k];
    const int instance = op.micro % S;
    Stage& stage = *stages[instance];
    const bool receives = op.forward ? !grid_.first_stage() : !grid_.last_stage();
    if (!receives) send_held();
    if (op.forward) {
      const std::int32_t* tokens = feed.tokens(op.micro);
      timer.stop(phases.data);
      if (receives) {
        receive(stage.input_buffer(), grid_.pp_rank - 1);
        timer.stop(phases.pipeline);
      }
      pipe_.complete(sends_[instance]);  // the instance's last send: its output is rewritten next
      stage.forward(table, tokens, seqs_, grad_scale, loss_sums);
      if (!grid_.last_stage()) held_ = Held{stage.output(), grid_.pp_rank + 1, instance};
      timer.stop(phases.forward);
      if (feed.after_forward) feed.after_forward(stage, op.micro);
    } else {
      if (receives) {
        receive(stage.output_grad_buffer(), grid_.pp_rank + 1);
        timer.stop(phases.pipeline);
      }
      // The step's last backward finalizes the gradients: the owner hears as they complete.
      const bool last = k + 1 == ops_.size();
      const float* dx =
          stage.backward(table, last ? feed.gradients_ready : std::function<void(int)>());
      if (!grid_.first_stage()) {
        pipe_.complete(sends_[instance]);  // a middle stage's activation send (long received)
        held_ = Held{dx, grid_.pp_rank - 1, instance};
      }
      timer.stop(phases.backward);
    }
  }
  send_held();
  for (auto& p : sends_) pipe_.complete(p);
}

}  // namespace kmoe
