#include "modules/engram/engram_shard.hpp"

#include <algorithm>

#include "core/buffers.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {
const EngramSharding& checked(const EngramSharding& sh) {
  KMOE_REQUIRE(sh.comm && sh.data,
               "EngramShard: a sharded table needs its group and its data communicator");
  return sh;
}
}  // namespace

EngramShard::EngramShard(const EngramSharding& sh, std::int64_t rows, int width, int max_requests,
                         bool host_table)
    : exchange_(*checked(sh).comm, *sh.data, "engram::shard"), width_(width) {
  const int P = sh.comm->size();
  block_ = (rows + P - 1) / P;
  row0_ = std::min<std::int64_t>(rows, block_ * sh.comm->rank());
  local_rows_ = std::min<std::int64_t>(block_, rows - row0_);
  owner_ = View1I("engram::owner", max_requests);
  if (host_table) {  // nothing the size of the block on the device
    // Room for twice a balanced share of the group's requests (grown if a step needs more).
    const int planned = std::min(max_requests * P, 2 * max_requests);
    cache_ = std::make_unique<EngramRowCache>(width, planned);
    local_h_.reserve(planned);
  } else {
    by_local_row_ =
        KeyBuckets(max_requests * P, static_cast<int>(std::max<std::int64_t>(1, local_rows_)));
  }
}

void EngramShard::fetch(const TensorTable& table, int tab_index, ConstIVec rows, int n,
                        float* mem) {
  const int dh = width_;
  const std::int64_t block = block_, row0 = row0_;
  auto owner = owner_;
  Kokkos::parallel_for(
      "engram::owner", Range(0, n),
      KOKKOS_LAMBDA(int a) { owner(a) = static_cast<int>(rows(a) / block); });
  exchange_.plan(ConstIVec(owner_.data(), n), n);
  const int n_in = static_cast<int>(exchange_.rows_received());
  ensure_size(req_in_, n_in, "engram::req_in");
  exchange_.forward(rows.data(), req_in_.data(), 1);

  // Serve: the requested rows of the local block, in the order asked.
  ensure_size(served_, std::int64_t(n_in) * dh, "engram::served");
  auto served = Mat(served_.data(), n_in, dh);
  if (cache_) {  // from host memory: the requests' rows staged, then read from the cache
    const auto req = read_to_host("engram offload requests", ConstIVec(req_in_.data(), n_in));
    local_h_.resize(n_in);
    for (int a = 0; a < n_in; ++a) local_h_[a] = static_cast<int>(req(a) - row0);
    cache_->stage(table, tab_index, local_h_.data(), n_in, settled_);
    settled_ = false;
    cache_->wait();
    const ConstMat cache = cache_->cache();
    const ConstIVec slot = cache_->slots();
    Kokkos::parallel_for(
        "engram::serve_cached_rows", Range2({0, 0}, {n_in, dh}),
        KOKKOS_LAMBDA(int a, int i) { served(a, i) = cache(slot(a), i); });
    exchange_.reverse(served_.data(), mem, dh);
    return;
  }
  auto tab = ConstMat(table.param(tab_index), local_rows_, dh);
  auto req_in = req_in_;
  Kokkos::parallel_for(
      "engram::serve_rows", Range2({0, 0}, {n_in, dh}),
      KOKKOS_LAMBDA(int a, int i) { served(a, i) = tab(req_in(a) - row0, i); });
  exchange_.reverse(served_.data(), mem, dh);
}

void EngramShard::return_gradients(TensorTable& table, int tab_index, const float* d_mem, int n) {
  const int dh = width_, n_in = static_cast<int>(exchange_.rows_received());
  KMOE_REQUIRE(n == exchange_.rows_sent(), "EngramShard: gradients of " << n
                                                                        << " requests, the "
                                                                           "last fetch had "
                                                                        << exchange_.rows_sent());
  exchange_.forward(d_mem, served_.data(), dh);
  if (cache_) {  // summed on the host, per row in arrival order, into the host gradient
    cache_->add_gradients(table, tab_index, served_.data());
    settled_ = true;
    return;
  }
  // Summed per local row over the received requests in arrival order (member, then request).
  const std::int64_t row0 = row0_;
  ensure_size(local_, n_in, "engram::local_rows");
  auto req_in = req_in_;
  auto local = local_;
  Kokkos::parallel_for(
      "engram::local_rows", Range(0, n_in),
      KOKKOS_LAMBDA(int a) { local(a) = static_cast<int>(req_in(a) - row0); });
  by_local_row_.build(ConstIVec(local_.data(), n_in));
  auto loff = by_local_row_.offsets;
  auto lord = by_local_row_.order;
  auto in = ConstMat(served_.data(), n_in, dh);
  auto dtab = Mat(table.grad(tab_index), local_rows_, dh);
  Kokkos::parallel_for(
      "engram::table_grad_sharded", Range2({0, 0}, {int(local_rows_), dh}),
      KOKKOS_LAMBDA(int row, int i) {
        if (loff(row + 1) == loff(row)) return;
        float acc = 0.0f;
        for (int a = loff(row); a < loff(row + 1); ++a) acc += in(lord(a), i);
        dtab(row, i) += acc;
      });
}

}  // namespace kmoe
