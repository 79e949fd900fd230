// The metrics counterpart of the TensorTable (RUNTIME.md section 5): the model's layers declare
// their step statistics here, as metrics.csv columns with the rule that finishes each; they add
// into flat accumulators while the step runs (from the host, or from kernels into the device
// copy); the trainer sums the accumulators over the world in one reduction and reads the
// finished values. The driver loop knows no layer.
//
// Every rank declares every column of the model (a Stage declares all blocks' columns, not
// only its own), so the accumulators and their reduction have the same size on every rank; a
// rank adds only for the layers it holds and leaves the rest 0.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/kokkos_types.hpp"

namespace kmoe {

// How a column's summed accumulators become its value.
enum class StatFinish {
  MeanPerMicroBatch,  // one value added per micro-batch: / micro-batches in the step
  MaxOverMean,        // n values (e.g. per-expert assignments): max / mean, 0 when all are 0
  FractionOf,         // one value: / the sum of another column's values
  Sum,                // one value, as summed (e.g. a fraction that one rank writes)
};

// The console line's one summary per kind: the max or the mean of a value over the columns
// that name the same summary.
enum class StatSummary { None, Max, Mean };

// A column's declaration, through the named finishes:
//   StatColumn::mean_per_micro_batch("moe3_lb")
//   StatColumn::max_over_mean("moe3_load_max_mean", E).summarized("load max/mean", Max)
//   StatColumn::fraction_of("moe3_drop", "moe3_load_max_mean")
//   StatColumn::sum("engram1_rows_touched")
struct StatColumn {
  std::string name;  // the metrics.csv column, e.g. "moe3_lb"
  StatFinish finish = StatFinish::MeanPerMicroBatch;
  int values = 1;       // accumulators
  std::string of;       // FractionOf: the dividing column
  std::string summary;  // console label this column joins, e.g. "load max/mean"
  StatSummary summary_kind = StatSummary::None;

  static StatColumn mean_per_micro_batch(std::string name) {
    return make(std::move(name), StatFinish::MeanPerMicroBatch, 1);
  }
  static StatColumn max_over_mean(std::string name, int values) {
    return make(std::move(name), StatFinish::MaxOverMean, values);
  }
  static StatColumn fraction_of(std::string name, std::string of) {
    StatColumn c = make(std::move(name), StatFinish::FractionOf, 1);
    c.of = std::move(of);
    return c;
  }
  static StatColumn sum(std::string name) { return make(std::move(name), StatFinish::Sum, 1); }
  StatColumn summarized(std::string label, StatSummary kind) const {
    StatColumn c = *this;
    c.summary = std::move(label);
    c.summary_kind = kind;
    return c;
  }

  bool operator==(const StatColumn& o) const {
    return name == o.name && finish == o.finish && values == o.values && of == o.of &&
           summary == o.summary && summary_kind == o.summary_kind;
  }

 private:
  static StatColumn make(std::string name, StatFinish finish, int values) {
    StatColumn c;
    c.name = std::move(name);
    c.finish = finish;
    c.values = values;
    return c;
  }
};

class StepStats {
 public:
  // Declares a column, or returns the index of the one already declared under that name (the
  // same declaration required): every in-flight instance of a layer adds into one column.
  int add(const StatColumn& column);
  int size() const { return static_cast<int>(columns_.size()); }
  const StatColumn& column(int i) const { return columns_[i]; }
  std::vector<std::string> names() const;

  // Zeroes every accumulator and counter: the start of a step.
  void begin_step();

  // Column i's accumulators on the host (column(i).values doubles), to add to.
  double* host(int i) { return host_.data() + offsets_[i]; }
  const double* host(int i) const { return host_.data() + offsets_[i]; }
  // Column i's accumulators on the device, for kernels to add to (summed into the host ones by
  // gather_device()). Ask again for each use: declaring a column moves the device copy.
  Kokkos::View<double*, Layout, MemSpace, Unmanaged> device(int i);
  // Column i's integer counters (n of them, e.g. lookups per table row), shared by every layer
  // instance that asks with the same n; zeroed by begin_step().
  IVec counters(int i, std::int64_t n);
  // The same in host memory, as 0/1 flags (a table kept in host memory marks its rows there),
  // shared the same way; zeroed by begin_step().
  std::vector<float>& host_flags(int i, std::int64_t n);

  // The flat host accumulators of every column, for the reduction over the world (one fixed
  // size on every rank), after gather_device().
  void gather_device();
  double* sums() { return host_.data(); }
  std::int64_t num_sums() const { return static_cast<std::int64_t>(host_.size()); }

  // The finished value of every column, in declaration order; micro_batches: in the step.
  std::vector<std::pair<std::string, double>> finish(int micro_batches) const;
  // The console summaries of finished values, one per label, in order of first appearance.
  std::vector<std::pair<std::string, double>> summaries(
      const std::vector<std::pair<std::string, double>>& finished) const;

 private:
  int find(const std::string& name) const;

  std::vector<StatColumn> columns_;
  std::vector<std::int64_t> offsets_;  // into host_ / device_
  std::vector<double> host_;
  View1D device_;                 // allocated (zeroed) on first use
  std::vector<View1I> counters_;  // per column; empty when not asked for
  std::vector<std::vector<float>> host_flags_;  // per column; empty when not asked for
};

}  // namespace kmoe
