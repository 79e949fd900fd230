// A row-sharded Engram table (parallel.engram_shard = ep | stage; RUNTIME.md section 1): member
// q of the shard group holds rows [q*B, (q+1)*B) of the R-row table, B = ceil(R / members). A
// lookup's requests (one per token and head) go to their rows' holders as row ids, the holders
// answer with the rows; in backward each request's row gradient goes back to the holder, which
// sums it into its rows over the requests in arrival order (source member, then request): a
// fixed order, no float atomics. Both directions are one RowExchange. With the table in host
// memory (engram.offload = host) a holder reads the requested row ids back to the host, serves
// the requests from its row cache, and sums the returned gradients there in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/bucket_sort.hpp"
#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"
#include "modules/engram/row_cache.hpp"
#include "parallel/row_exchange.hpp"

namespace kmoe {

// How a layer's table is spread: kind (None: replicated), the group (counts) and its data
// plane (row ids, rows and row gradients).
struct EngramSharding {
  Shard kind = Shard::None;
  const Communicator* comm = nullptr;
  const DataComm* data = nullptr;
};

class EngramShard {
 public:
  // rows: R, the table's global rows; width: dh, the floats per row; max_requests: per lookup.
  // host_table: the local block lives in host memory (TensorSpec::host_resident).
  EngramShard(const EngramSharding& sharding, std::int64_t rows, int width, int max_requests,
              bool host_table = false);

  std::int64_t first_row() const { return row0_; }
  std::int64_t local_rows() const { return local_rows_; }

  // rows: (n) global row ids, one per request -> mem: (n, width), each request's row, read
  // from table tensor `tab` on its holder. Collective over the shard group.
  void fetch(const TensorTable& table, int tab, ConstIVec rows, int n, float* mem);
  // d_mem: (n, width) the gradients of the last fetch's requests -> added to the gradient of
  // the holders' rows. Collective over the shard group.
  void return_gradients(TensorTable& table, int tab, const float* d_mem, int n);

 private:
  RowExchange exchange_;
  int width_;
  std::int64_t block_, row0_, local_rows_;
  View1I owner_;             // (requests): the holder of each request
  View1I req_in_;            // (requests received): their global row ids
  View1I local_;             // (requests received): their rows in the local block
  View1F served_;            // (requests received, width): answers, then row gradients
  KeyBuckets by_local_row_;  // received requests grouped by local row, arrival order
  // A host table: the rows of the received requests, and whether the device has read them.
  std::unique_ptr<EngramRowCache> cache_;
  std::vector<int> local_h_;
  bool settled_ = true;
};

}  // namespace kmoe
