// Training output (RUNTIME.md section 5): one console line per logged step on rank 0 and a row
// in <output.dir>/metrics.csv: the fixed columns through val_loss, then the layers' columns
// (StepStats, in declaration order), then comm_s.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kmoe {

struct StepMetrics {
  int step = 0;
  double loss = 0, ce = 0, aux = 0, lr = 0, grad_norm = 0;
  double tokens_per_s = 0, tokens_per_s_per_rank = 0;
  double model_flops_per_s = 0;
  std::optional<double> mfu;  // absent when output.peak_flops is 0
  double step_time_s = 0;
  double mem_hwm_mib = 0;  // max over ranks
  std::optional<double> val_loss;
  // The layers' columns (name, value) in their fixed order, e.g. per MoE layer, and the
  // console's one summary per kind of layer (label, value).
  std::vector<std::pair<std::string, double>> layer_stats, summaries;
  double comm_s = 0;  // seconds rank 0 waited on communication in the step
};

class MetricsWriter {
 public:
  // Opens (truncating, or appending when `append`) <dir>/metrics.csv; creates `dir`.
  // `layer_columns` names StepMetrics::layer_stats, in order. Appending (a resume from step
  // `resumed_step`) first drops a last row cut short (a full disk, a kill) and the rows of
  // steps after the resumed one: the run writes them again.
  MetricsWriter(const std::string& dir, bool append,
                const std::vector<std::string>& layer_columns = {}, int resumed_step = -1);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // The csv row, flushed; a failed write (a full disk) throws kmoe::Error naming the file.
  // `step` only feeds the test-only KMOE_FAULT=metrics_fails:<step>.
  void write(const StepMetrics& m, int step = -1);
  // The console line (RUNTIME.md section 5): loss, CE, aux, lr, gradient norm, throughput,
  // model FLOP/s, MFU when known, seconds per step, memory, val_loss when evaluated, then one
  // summary per kind of layer instead of the layers' columns (those are in metrics.csv).
  static std::string console_line(const StepMetrics& m);
  // Whether step `step` of a run ending at `last_step` is logged on its own account (every
  // output.log_every steps and the last one; evaluations and stops are logged too).
  static bool due(int log_every, int step, int last_step) {
    return step % log_every == 0 || step == last_step;
  }
  static const char* csv_header();

 private:
  void flush_or_throw(const std::string& what);

  std::string path_;
  std::FILE* csv_ = nullptr;
};

}  // namespace kmoe
