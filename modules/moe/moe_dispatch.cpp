#include "modules/moe/moe_dispatch.hpp"

#include <algorithm>

#include "core/buffers.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/segments.hpp"

namespace kmoe {

ExpertDispatch::ExpertDispatch(const Communicator& ep, const DataComm& ep_data, int experts,
                               int d_model, std::int64_t expected_rows)
    : exchange_(ep, ep_data, "moe::dispatch"),
      P_(ep.size()),
      E_(experts),
      El_(experts / ep.size()),
      D_(d_model),
      local_off_(El_ + 1, 0),
      blocks_("moe::dispatch_blocks", 2 * P_ * El_ + 1),
      blocks_host_(host_mirror("moe dispatch blocks", blocks_)),
      perm_("moe::dispatch_perm", std::max<std::int64_t>(1, expected_rows)) {
  KMOE_REQUIRE(E_ % P_ == 0,
               "moe.experts (" << E_ << ") must be divisible by parallel.ep (" << P_ << ")");
}

void ExpertDispatch::plan(const std::vector<int>& offsets) {
  const int P = P_, El = El_;
  // Kept rows per global expert: member q's block b is its local expert b.
  std::vector<std::int64_t> counts(E_);
  for (int e = 0; e < E_; ++e) counts[e] = offsets[e + 1] - offsets[e];
  exchange_.plan_grouped(counts, El);
  const std::vector<std::int64_t>& recv = exchange_.received_blocks();  // (P*El) source-major
  // Received rows are source-major (rank p: its rows for local expert 0, 1, ...); the experts
  // want them expert-major (expert le: source 0, 1, ...). perm(expert-major row) = received row.
  std::fill(local_off_.begin(), local_off_.end(), 0);
  for (int le = 0; le < El; ++le) {
    std::int64_t n = 0;
    for (int p = 0; p < P; ++p) n += recv[std::size_t(p) * El + le];
    local_off_[le + 1] = local_off_[le] + static_cast<int>(n);
  }
  const int Rx = local_off_[El];
  ensure_size(perm_, Rx, "moe::dispatch_perm");
  // Block b = p*El + le (source p's rows for local expert le) starts at src(b) in the received
  // rows and at dst(b) expert-major; the host fills these P*El bounds, a kernel the rows.
  const int B = P * El;
  auto bounds = blocks_host_;  // src(0..B), then dst(0..B-1)
  std::vector<int> fill(local_off_.begin(), local_off_.end() - 1);
  bounds(0) = 0;
  for (int b = 0; b < B; ++b) {
    const int n = static_cast<int>(recv[b]);
    bounds(b + 1) = bounds(b) + n;
    bounds(B + 1 + b) = fill[b % El];
    fill[b % El] += n;
  }
  mark_host_sync("expert dispatch bounds");
  Kokkos::deep_copy(blocks_, bounds);
  auto blocks = blocks_;
  auto perm = perm_;
  Kokkos::parallel_for(
      "moe::dispatch_plan", Range(0, Rx), KOKKOS_LAMBDA(int i) {
        const int lo = segment_of(blocks, B, i);  // the (non-empty) block holding i
        perm(blocks(B + 1 + lo) + i - blocks(lo)) = i;
      });
}

namespace {
// Received rows (Rx, D) into expert-major order: to[r] = from[perm[r]] (fp32 or bf16 values).
template <class T>
void regroup(const View1I& perm, const T* from, T* to, int Rx, int D) {
  Kokkos::parallel_for(
      "moe::dispatch_regroup", row_policy(Rx), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank(), src = perm(r);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, D), [&](int d) {
          to[std::int64_t(r) * D + d] = from[std::int64_t(src) * D + d];
        });
      });
}
}  // namespace

void ExpertDispatch::dispatch(const float* rows, float* ex, Workspace& ws) {
  Workspace::Frame frame(ws);
  float* xfer = frame.floats(std::int64_t(local_rows()) * D_);
  exchange_.forward(rows, xfer, D_);
  regroup(perm_, static_cast<const float*>(xfer), ex, local_rows(), D_);
}

void ExpertDispatch::dispatch(const std::uint16_t* rows, std::uint16_t* ex, Workspace& ws) {
  Workspace::Frame frame(ws);
  std::uint16_t* xfer = frame.words(std::int64_t(local_rows()) * D_);
  exchange_.forward(rows, xfer, D_);
  regroup(perm_, static_cast<const std::uint16_t*>(xfer), ex, local_rows(), D_);
}

void ExpertDispatch::combine(const float* ex, float* rows, Workspace& ws) {
  const int D = D_, Rx = local_rows();
  Workspace::Frame frame(ws);
  float* xfer = frame.floats(std::int64_t(Rx) * D);
  auto perm = perm_;
  auto from = ConstMat(ex, Rx, D);
  auto to = Mat(xfer, Rx, D);
  Kokkos::parallel_for(
      "moe::dispatch_ungroup", row_policy(Rx), KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank(), dst = perm(r);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, D),
                             [&](int d) { to(dst, d) = from(r, d); });
      });
  exchange_.reverse(xfer, rows, D);
}

}  // namespace kmoe
