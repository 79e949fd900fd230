#include "train/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/bf16.hpp"
#include "core/device_sync.hpp"

namespace kmoe {

double learning_rate(const OptimizerCfg& o, int max_steps, int s) {
  const double lr = o.lr, lr_min = o.lr * o.final_lr_ratio;
  const int W = o.warmup_steps;
  if (s <= W) return lr * s / W;
  if (o.schedule == LrSchedule::Constant) return lr;
  if (o.schedule == LrSchedule::Wsd) {
    if (s > max_steps - o.decay_steps)
      return lr_min + (lr - lr_min) * double(max_steps - s) / o.decay_steps;
    return lr;
  }
  const double pi = 3.14159265358979323846;
  return lr_min + (lr - lr_min) * 0.5 * (1.0 + std::cos(pi * (s - W) / double(max_steps - W)));
}

namespace {
enum ChunkFlag { kCounted = 1, kTrainable = 2, kDecay = 4, kHost = 8 };

// Squares of g[b0, b1) in double: blocks of 8 consecutive elements, each summed as a fixed
// pairwise tree (the dependent chain of additions is one per block, not one per element).
template <class Grad>
KOKKOS_INLINE_FUNCTION double block_squares(const Grad& g, std::int64_t b0, std::int64_t b1,
                                            std::int64_t j) {
  double q[8];
  const std::int64_t i0 = b0 + 8 * j;
  for (int l = 0; l < 8; ++l) {
    const double x = i0 + l < b1 ? double(g[i0 + l]) : 0.0;
    q[l] = x * x;
  }
  return ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
}

// One element's AdamW update, the same on the device and on the host.
struct AdamwCoeffs {
  float b1, b2, eps, bc1, bc2, gs;
};
KOKKOS_INLINE_FUNCTION void adamw_element(const AdamwCoeffs& a, float lr_g, float wd, float g,
                                          float& m, float& v, float& p) {
  const float gi = a.gs * g;
  m = a.b1 * m + (1.0f - a.b1) * gi;
  v = a.b2 * v + (1.0f - a.b2) * gi * gi;
  const float mh = m / a.bc1, vh = v / a.bc2;
  p -= lr_g * (wd * p + mh / (math::sqrt(vh) + a.eps));
}

#if defined(KOKKOS_ENABLE_SERIAL)
constexpr bool kSerialDefault = std::is_same<ExecSpace, Kokkos::Serial>::value;
#else
constexpr bool kSerialDefault = false;
#endif
}  // namespace

FlatOptimizer::FlatOptimizer(const TensorTable& table, const std::vector<char>* counted) {
  std::vector<std::int64_t> begin, end, moment, param, copy;
  std::vector<double> lr_mult;
  std::vector<int> flags;
  for (int t = 0; t < table.size(); ++t) {
    const TensorEntry& e = table.entry(t);
    const MomentSlice& s = table.moments(t);
    // A split slice is this rank's alone: it counts here; a whole tensor where `counted` says.
    const int f = ((s.split || !counted || (*counted)[t]) ? kCounted : 0) |
                  (e.spec.trainable ? kTrainable : 0) | (e.spec.weight_decay ? kDecay : 0) |
                  (e.spec.host_resident ? kHost : 0);
    const std::int64_t first = table.moment_begin(t), n = s.rows * e.spec.row_elements();
    // The slice's first fp32 value (its master rows start at master_first) and bf16 copy.
    const std::int64_t p0 =
        table.param_offset(t) + (s.first - table.master_first(t)) * e.spec.row_elements();
    const std::int64_t c0 = table.has_copy(t)
                                ? table.copy_offset(t) + s.first * e.spec.row_elements()
                                : std::int64_t(-1);
    const std::int64_t step = kSerialDefault ? std::max<std::int64_t>(n, 1) : kChunk;
    for (std::int64_t a = 0; a < n; a += step) {
      if (e.spec.host_resident)  // the host's chunks: same cut, same place in the sum order
        host_.push_back({static_cast<int>(begin.size()), first + a, first + std::min(n, a + step),
                         s.offset + a, p0 + a, e.spec.lr_mult, f});
      begin.push_back(first + a);
      end.push_back(first + std::min(n, a + step));
      moment.push_back(s.offset + a);
      param.push_back(p0 + a);
      copy.push_back(c0 < 0 ? -1 : c0 + a);
      lr_mult.push_back(e.spec.lr_mult);
      flags.push_back(f);
    }
  }
  chunks_ = static_cast<int>(begin.size());
  begin_ = Kokkos::View<std::int64_t*, Layout, MemSpace>("optim::chunk_begin", chunks_);
  end_ = Kokkos::View<std::int64_t*, Layout, MemSpace>("optim::chunk_end", chunks_);
  moment_ = Kokkos::View<std::int64_t*, Layout, MemSpace>("optim::chunk_moment", chunks_);
  param_ = Kokkos::View<std::int64_t*, Layout, MemSpace>("optim::chunk_param", chunks_);
  copy_ = Kokkos::View<std::int64_t*, Layout, MemSpace>("optim::chunk_copy", chunks_);
  lr_mult_ = View1D("optim::chunk_lr_mult", chunks_);
  flags_ = View1I("optim::chunk_flags", chunks_);
  // The chunks' sums, the total, then the sums of groups of kGroup chunks.
  partial_ = View1D("optim::chunk_sums", chunks_ + 1 + (chunks_ + kGroup - 1) / kGroup);
  if (!host_.empty()) {
    host_sums_ = View1D("optim::host_chunk_sums", chunks_);
    host_sums_h_ = Kokkos::View<double*, Layout, PinnedSpace>("optim::host_chunk_sums (host)",
                                                              chunks_);
  }
  auto up = [](const auto& host, const auto& dev) {
    using T = typename std::decay_t<decltype(dev)>::value_type;
    mark_host_sync("optimizer setup");
    Kokkos::deep_copy(dev, Kokkos::View<const T*, HostSpace, Unmanaged>(host.data(), host.size()));
  };
  up(begin, begin_);
  up(end, end_);
  up(moment, moment_);
  up(param, param_);
  up(copy, copy_);
  up(lr_mult, lr_mult_);
  up(flags, flags_);
}

double FlatOptimizer::grad_sq_sum(const TensorTable& table) const {
  auto g = table.grads;
  auto begin = begin_, end = end_;
  auto flags = flags_;
  auto partial = partial_;
  const int C = chunks_;
  // The host tensors' chunk sums, by host threads in the device's order (blocks of 8, in
  // order), to the device where their chunks' sums go.
  if (!host_.empty()) {
    const float* hg = table.host_grads.data();
    const HostChunk* hc = host_.data();
    double* out = host_sums_h_.data();
    Kokkos::parallel_for(
        "optim::grad_sq_host", Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(
                                   0, static_cast<int>(host_.size())),
        [=](int k) {
          const HostChunk& h = hc[k];
          double sum = 0.0;
          if (h.flags & kCounted)
            for (std::int64_t j = 0, nb = (h.end - h.begin + 7) / 8; j < nb; ++j)
              sum += block_squares(hg, h.begin, h.end, j);
          out[h.chunk] = sum;
        });
    Kokkos::deep_copy(ExecSpace(), host_sums_, host_sums_h_);
  }
  auto host_sums = host_sums_;
  Kokkos::parallel_for(
      "optim::grad_sq_chunks", team_policy(C), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int c = tm.league_rank();
        double sum = 0.0;
        const std::int64_t b0 = begin(c), b1 = end(c), nb = (b1 - b0 + 7) / 8;
        if (flags(c) & kHost)
          sum = host_sums(c);
        else if (flags(c) & kCounted)
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(tm, std::int64_t(0), nb),
              [&](std::int64_t j, double& acc) { acc += block_squares(g, b0, b1, j); }, sum);
        Kokkos::single(Kokkos::PerTeam(tm), [&]() { partial(c) = sum; });
      });
  // The total in one fixed order: groups of kGroup chunks in order (a thread each of one
  // team), then the groups in order.
  const int groups = (C + kGroup - 1) / kGroup;
  Kokkos::parallel_for(
      "optim::grad_sq_total", team_policy(1), KOKKOS_LAMBDA(const TeamMember& tm) {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, groups), [&](int g) {
          double sum = 0.0;
          for (int c = g * kGroup; c < C && c < (g + 1) * kGroup; ++c) sum += partial(c);
          partial(C + 1 + g) = sum;
        });
        tm.team_barrier();
        Kokkos::single(Kokkos::PerTeam(tm), [&]() {
          double total = 0.0;
          for (int g = 0; g < groups; ++g) total += partial(C + 1 + g);
          partial(C) = total;
        });
      });
  auto h = read_to_host("gradient norm", Kokkos::subview(partial_, std::make_pair(C, C + 1)));
  return h(0);
}

void FlatOptimizer::adamw_step(const OptimizerCfg& o, TensorTable& table, int t, double lr,
                               double clip_scale) const {
  const AdamwCoeffs a{static_cast<float>(o.beta1),
                      static_cast<float>(o.beta2),
                      static_cast<float>(o.eps),
                      static_cast<float>(1.0 - std::pow(o.beta1, t)),
                      static_cast<float>(1.0 - std::pow(o.beta2, t)),
                      static_cast<float>(clip_scale)};
  const float wd_all = o.weight_decay;
  const double lr_d = lr;
  auto p = table.params, g = table.grads, m = table.exp_avg, v = table.exp_avg_sq;
  auto w = table.weights_b16;
  auto begin = begin_, end = end_, moment = moment_, param = param_, copy = copy_;
  auto flags = flags_;
  auto lr_mult = lr_mult_;
  Kokkos::parallel_for(
      "optim::adamw", team_policy(chunks_), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int c = tm.league_rank();
        if (!(flags(c) & kTrainable) || (flags(c) & kHost)) return;
        // The group rate and decay exactly as the per-tensor update formed them.
        const float lr_g = lr_d * lr_mult(c);
        const float wd = (flags(c) & kDecay) ? wd_all : 0.0f;
        // Gradient element i -> its moments (j), fp32 value (k) and bf16 copy.
        const std::int64_t shift = moment(c) - begin(c), to_param = param(c) - begin(c);
        const std::int64_t to_copy = copy(c) - begin(c);
        const bool has_copy = copy(c) >= 0;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, begin(c), end(c)), [&](std::int64_t i) {
          const std::int64_t j = i + shift, k = i + to_param;
          adamw_element(a, lr_g, wd, g(i), m(j), v(j), p(k));
          if (has_copy) w(i + to_copy) = bf16_bits(p(k));
        });
      });
  // The host tensors' chunks: the same update by host threads (one chunk each at a time),
  // while the device runs the rest.
  if (!host_.empty()) {
    float *hp = table.host_params.data(), *hg = table.host_grads.data();
    float *hm = table.host_exp_avg.data(), *hv = table.host_exp_avg_sq.data();
    const HostChunk* hc = host_.data();
    Kokkos::parallel_for(
        "optim::adamw_host", Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(
                                 0, static_cast<int>(host_.size())),
        [=](int k) {
          const HostChunk& h = hc[k];
          if (!(h.flags & kTrainable)) return;
          const float lr_g = lr_d * h.lr_mult;
          const float wd = (h.flags & kDecay) ? wd_all : 0.0f;
          const std::int64_t shift = h.moment - h.begin, to_param = h.param - h.begin;
          for (std::int64_t i = h.begin; i < h.end; ++i)
            adamw_element(a, lr_g, wd, hg[i], hm[i + shift], hv[i + shift], hp[i + to_param]);
        });
  }
}

double grad_sq_sum(const TensorTable& table, const std::vector<char>* counted) {
  return FlatOptimizer(table, counted).grad_sq_sum(table);
}

void adamw_step(const OptimizerCfg& o, TensorTable& table, int t, double lr, double clip_scale) {
  FlatOptimizer(table).adamw_step(o, table, t, lr, clip_scale);
}

}  // namespace kmoe
