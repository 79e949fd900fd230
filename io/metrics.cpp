#include "io/metrics.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.hpp"

namespace kmoe {

const char* MetricsWriter::csv_header() {
  return "step,loss,ce,aux,lr,grad_norm,tokens_per_s,tokens_per_s_per_rank,model_flops_per_s,"
         "mfu,step_time_s,mem_hwm_mib,val_loss";
}

MetricsWriter::MetricsWriter(const std::string& dir, bool append,
                             const std::vector<std::string>& layer_columns) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  KMOE_REQUIRE(!ec, "output.dir = " << dir << ": cannot create directory: " << ec.message());
  path_ = dir + "/metrics.csv";
  const bool fresh = !append || !std::filesystem::exists(path_);
  csv_ = std::fopen(path_.c_str(), fresh ? "w" : "a");
  KMOE_REQUIRE(
      csv_, "output.dir: cannot open " << path_ << " for writing (" << std::strerror(errno) << ")");
  if (fresh) {
    std::fprintf(csv_, "%s", csv_header());
    for (const auto& c : layer_columns) std::fprintf(csv_, ",%s", c.c_str());
    std::fprintf(csv_, ",comm_s\n");
    flush_or_throw("its header");
  }
}

void MetricsWriter::flush_or_throw(const std::string& what) {
  errno = 0;
  if (std::fflush(csv_) == 0 && !std::ferror(csv_)) return;
  KMOE_FAIL("output.dir: cannot write " << what << " to " << path_ << " ("
                                        << (errno ? std::strerror(errno) : "write error")
                                        << "; is the file system full?)");
}

MetricsWriter::~MetricsWriter() {
  if (csv_) std::fclose(csv_);
}

void MetricsWriter::write(const StepMetrics& m) {
  std::fprintf(csv_, "%d,%.17g,%.17g,%.17g,%.9g,%.17g,%.6g,%.6g,%.6g,", m.step, m.loss, m.ce, m.aux,
               m.lr, m.grad_norm, m.tokens_per_s, m.tokens_per_s_per_rank, m.model_flops_per_s);
  if (m.mfu) std::fprintf(csv_, "%.6g", *m.mfu);
  std::fprintf(csv_, ",%.6g,%.6g,", m.step_time_s, m.mem_hwm_mib);
  if (m.val_loss) std::fprintf(csv_, "%.17g", *m.val_loss);
  for (const auto& [name, value] : m.layer_stats) std::fprintf(csv_, ",%.9g", value);
  std::fprintf(csv_, ",%.9g\n", m.comm_s);
  flush_or_throw("the row of step " + std::to_string(m.step));
}

std::string MetricsWriter::console_line(const StepMetrics& m) {
  char buf[512];
  int n = std::snprintf(buf, sizeof buf,
                        "step %6d | loss %.4f ce %.4f aux %.4f | lr %.3e | gnorm %.3f | "
                        "%.0f tok/s (%.0f/rank) | %.2f GFLOP/s",
                        m.step, m.loss, m.ce, m.aux, m.lr, m.grad_norm, m.tokens_per_s,
                        m.tokens_per_s_per_rank, m.model_flops_per_s / 1e9);
  std::string line(buf, n);
  if (m.mfu) {
    n = std::snprintf(buf, sizeof buf, " mfu %.1f%%", 100.0 * *m.mfu);
    line.append(buf, n);
  }
  n = std::snprintf(buf, sizeof buf, " | %.3f s/step | mem %.0f MiB", m.step_time_s, m.mem_hwm_mib);
  line.append(buf, n);
  if (m.val_loss) {
    n = std::snprintf(buf, sizeof buf, " | val_loss %.4f", *m.val_loss);
    line.append(buf, n);
  }
  for (const auto& [label, value] : m.summaries) {
    n = std::snprintf(buf, sizeof buf, " | %s %.3f", label.c_str(), value);
    line.append(buf, n);
  }
  return line;
}

}  // namespace kmoe
