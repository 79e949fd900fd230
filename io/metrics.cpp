#include "io/metrics.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.hpp"
#include "core/fault_injection.hpp"

namespace kmoe {

const char* MetricsWriter::csv_header() {
  return "step,loss,ce,aux,lr,grad_norm,tokens_per_s,tokens_per_s_per_rank,model_flops_per_s,"
         "mfu,step_time_s,mem_hwm_mib,val_loss";
}

namespace {
// Keeps the header and the complete rows of steps <= last_step of an existing metrics.csv.
void keep_rows_through(const std::string& path, int last_step) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  std::string kept;
  std::size_t at = 0;
  bool header = true;
  while (at < text.size()) {
    const std::size_t end = text.find('\n', at);
    if (end == std::string::npos) break;  // cut short: dropped
    const std::string line = text.substr(at, end + 1 - at);
    at = end + 1;
    if (!header && std::atoi(line.c_str()) > last_step) continue;
    kept += line;
    header = false;
  }
  if (kept.size() == text.size()) return;
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary);
  out << kept;
  out.close();
  KMOE_REQUIRE(!out.fail(), "output.dir: cannot rewrite " << path << " (is the file system full?)");
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KMOE_REQUIRE(!ec, "output.dir: cannot replace " << path << ": " << ec.message());
}
}  // namespace

MetricsWriter::MetricsWriter(const std::string& dir, bool append,
                             const std::vector<std::string>& layer_columns, int resumed_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  KMOE_REQUIRE(!ec, "output.dir = " << dir << ": cannot create directory: " << ec.message());
  path_ = dir + "/metrics.csv";
  const bool fresh = !append || !std::filesystem::exists(path_);
  if (!fresh && resumed_step >= 0) keep_rows_through(path_, resumed_step);
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

void MetricsWriter::write(const StepMetrics& m, int step) {
  KMOE_REQUIRE(!metrics_fault_here(step), "output.dir: cannot write the row of step "
                                              << step << " to " << path_
                                              << " (No space left on device, KMOE_FAULT)");
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
