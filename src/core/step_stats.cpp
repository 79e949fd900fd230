#include "core/step_stats.hpp"

#include <algorithm>

#include "core/device_sync.hpp"
#include "core/error.hpp"

namespace kmoe {

int StepStats::find(const std::string& name) const {
  for (int i = 0; i < size(); ++i)
    if (columns_[i].name == name) return i;
  return -1;
}

int StepStats::add(const StatColumn& c) {
  if (const int i = find(c.name); i >= 0) {
    KMOE_REQUIRE(columns_[i] == c,
                 "StepStats: column " << c.name << " declared twice, differently");
    return i;
  }
  KMOE_REQUIRE(c.values >= 1, "StepStats: column " << c.name << " needs an accumulator");
  KMOE_REQUIRE(c.finish != StatFinish::FractionOf || find(c.of) >= 0,
               "StepStats: column " << c.name << " divides by undeclared column '" << c.of << "'");
  columns_.push_back(c);
  offsets_.push_back(static_cast<std::int64_t>(host_.size()));
  host_.resize(host_.size() + c.values, 0.0);
  if (device_.extent(0) > 0) {  // keep the device copy the same size, its values kept
    View1D grown("stats::device", host_.size());
    Kokkos::deep_copy(Kokkos::subview(grown, std::make_pair(std::size_t(0), device_.extent(0))),
                      device_);
    device_ = grown;
  }
  counters_.emplace_back();
  host_flags_.emplace_back();
  return size() - 1;
}

std::vector<std::string> StepStats::names() const {
  std::vector<std::string> out;
  for (const auto& c : columns_) out.push_back(c.name);
  return out;
}

void StepStats::begin_step() {
  std::fill(host_.begin(), host_.end(), 0.0);
  if (device_.extent(0) > 0) Kokkos::deep_copy(device_, 0.0);
  for (auto& c : counters_)
    if (c.extent(0) > 0) Kokkos::deep_copy(c, 0);
  for (auto& f : host_flags_) std::fill(f.begin(), f.end(), 0.0f);
}

std::vector<float>& StepStats::host_flags(int i, std::int64_t n) {
  std::vector<float>& f = host_flags_[i];
  if (f.empty()) f.assign(n, 0.0f);
  KMOE_REQUIRE(std::int64_t(f.size()) == n, "StepStats: column " << columns_[i].name << " has "
                                                                  << f.size()
                                                                  << " host flags, asked for "
                                                                  << n);
  return f;
}

Kokkos::View<double*, Layout, MemSpace, Unmanaged> StepStats::device(int i) {
  if (device_.extent(0) == 0) device_ = View1D("stats::device", host_.size());
  return Kokkos::View<double*, Layout, MemSpace, Unmanaged>(device_.data() + offsets_[i],
                                                            columns_[i].values);
}

IVec StepStats::counters(int i, std::int64_t n) {
  View1I& c = counters_[i];
  if (c.extent(0) == 0) c = View1I("stats::" + columns_[i].name, n);
  KMOE_REQUIRE(std::int64_t(c.extent(0)) == n, "StepStats: column "
                                                   << columns_[i].name << " has " << c.extent(0)
                                                   << " counters, asked for " << n);
  return IVec(c.data(), n);
}

void StepStats::gather_device() {
  if (device_.extent(0) == 0) return;
  // Read before any reset: on a host backend the mirror is the view itself.
  auto h = read_to_host("step statistics", device_);
  for (std::size_t k = 0; k < host_.size(); ++k) host_[k] += h(k);
}

std::vector<std::pair<std::string, double>> StepStats::finish(int micro_batches) const {
  auto total_of = [this](int i) {
    double total = 0.0;
    for (int v = 0; v < columns_[i].values; ++v) total += host(i)[v];
    return total;
  };
  std::vector<std::pair<std::string, double>> out;
  for (int i = 0; i < size(); ++i) {
    const StatColumn& c = columns_[i];
    const double* a = host(i);
    double value = 0.0;
    switch (c.finish) {
      case StatFinish::MeanPerMicroBatch:
        value = a[0] / micro_batches;
        break;
      case StatFinish::MaxOverMean: {
        double most = 0.0;
        for (int v = 0; v < c.values; ++v) most = std::max(most, a[v]);
        const double total = total_of(i);
        value = total > 0 ? most / (total / c.values) : 0.0;
        break;
      }
      case StatFinish::FractionOf: {
        const double total = total_of(find(c.of));
        value = total > 0 ? a[0] / total : 0.0;
        break;
      }
      case StatFinish::Sum:
        value = a[0];
        break;
    }
    out.emplace_back(c.name, value);
  }
  return out;
}

std::vector<std::pair<std::string, double>> StepStats::summaries(
    const std::vector<std::pair<std::string, double>>& finished) const {
  std::vector<std::pair<std::string, double>> out;
  std::vector<int> joined;
  for (int i = 0; i < size(); ++i) {
    const StatColumn& c = columns_[i];
    if (c.summary_kind == StatSummary::None) continue;
    const double v = finished[i].second;
    auto it =
        std::find_if(out.begin(), out.end(), [&](const auto& s) { return s.first == c.summary; });
    if (it == out.end()) {
      out.emplace_back(c.summary, v);
      joined.push_back(1);
      continue;
    }
    const std::size_t k = it - out.begin();
    it->second = c.summary_kind == StatSummary::Max ? std::max(it->second, v) : it->second + v;
    ++joined[k];
  }
  for (std::size_t k = 0; k < out.size(); ++k) {
    // A Mean label averages its columns; a Max label already holds its maximum.
    int i = 0;
    while (columns_[i].summary != out[k].first) ++i;
    if (columns_[i].summary_kind == StatSummary::Mean) out[k].second /= joined[k];
  }
  return out;
}

}  // namespace kmoe
