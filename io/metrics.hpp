// Training output (RUNTIME.md section 5): one console line per logged step on rank 0 and the
// same row in <output.dir>/metrics.csv, with val_loss on the steps that evaluate.
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
  double mem_hwm_mib = 0;     // max over ranks
  std::optional<double> val_loss;
  // Model-specific columns after val_loss, e.g. per MoE layer (name, value), in a fixed order.
  std::vector<std::pair<std::string, double>> extra;
};

class MetricsWriter {
 public:
  // Opens (truncating, or appending when `append`) <dir>/metrics.csv; creates `dir`.
  // `extra_columns` names StepMetrics::extra, in order.
  MetricsWriter(const std::string& dir, bool append,
                const std::vector<std::string>& extra_columns = {});
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const StepMetrics& m);             // csv row, flushed
  static std::string console_line(const StepMetrics& m);
  static const char* csv_header();

 private:
  std::FILE* csv_ = nullptr;
};

}  // namespace kmoe
