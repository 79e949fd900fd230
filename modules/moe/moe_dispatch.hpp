// Expert parallelism's row traffic (RUNTIME.md section 1): ep rank r holds experts
// [r*El, (r+1)*El). The kept rows of a micro-batch, already grouped per global expert, go to
// the ranks holding their experts (a RowExchange planned from the per-expert counts); there
// they are regrouped expert-major, source rank order within an expert, so each local expert's
// rows form one contiguous block for its GEMMs. The results (forward outputs, backward input
// gradients) travel back the same way.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/workspace.hpp"
#include "parallel/row_exchange.hpp"

namespace kmoe {

class ExpertDispatch {
 public:
  // ep: the expert-parallel group (counts), ep_data: its data plane (rows); rows are D wide.
  // expected_rows: the local rows its buffers are sized for (grown in a step only beyond).
  ExpertDispatch(const Communicator& ep, const DataComm& ep_data, int experts, int d_model,
                 std::int64_t expected_rows);

  // offsets: (E+1) row bounds of each global expert's block of this rank's kept rows.
  // Collective over the group: exchanges the per-expert counts, plans the regrouping.
  void plan(const std::vector<int>& offsets);
  // After plan(): (El+1) row bounds of each local expert's block of the rows received.
  const std::vector<int>& local_offsets() const { return local_off_; }
  int local_rows() const { return local_off_.back(); }

  // rows: (kept rows, D), expert-major -> ex: (local_rows(), D), the local experts' rows. The
  // rows arrive source-major in a (local_rows(), D) transfer buffer taken from `ws`.
  void dispatch(const float* rows, float* ex, Workspace& ws);
  // The same for bf16 rows (D even): half the bytes, bit for bit.
  void dispatch(const std::uint16_t* rows, std::uint16_t* ex, Workspace& ws);
  // ex -> rows: the inverse of dispatch.
  void combine(const float* ex, float* rows, Workspace& ws);

 private:
  RowExchange exchange_;
  int P_, E_, El_, D_;
  std::vector<int> local_off_;
  View1I blocks_;  // (2*P*El + 1): received block starts, then their expert-major starts
  Kokkos::View<int*, Layout, HostSpace> blocks_host_;  // filled on the host (host_mirror)
  View1I perm_;  // (local rows): expert-major row -> received row
};

}  // namespace kmoe
