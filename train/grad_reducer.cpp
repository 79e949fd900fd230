#include "train/grad_reducer.hpp"

#include <algorithm>
#include <map>

#include "parallel/placement.hpp"

namespace kmoe {

GradReducer::GradReducer(TensorTable& table, const ProcessGrid& grid, double bucket_mb, bool tied,
                         bool shard, bool bf16_copies)
    : table_(table), grid_(grid) {
  const std::int64_t limit =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(bucket_mb * 1024 * 1024 / sizeof(float)));
  if (tied && grid.tie.valid()) tied_ = table.find("embed.weight");
  // Every member of a communicator must issue the same reductions: bucket boundaries (and their
  // blocks) depend only on what is the same on every member (table indices, reduction groups,
  // the shapes of tensors reduced over the group), never on tensors outside the group. A row
  // block with no rows here stays in its bucket (it adds nothing) so the members still agree.
  // Sharded, the tied embedding is a bucket of its own, never split.
  int prev = -1;  // the index of the last tensor taken into a bucket
  for (int i = table.size() - 1; i >= 0; --i) {
    const TensorEntry& e = table.entry(i);
    if (!e.spec.trainable) continue;
    const Communicator* axis = gradient_comm(e.spec, grid);
    if (!axis || axis->size() == 1) continue;
    if (e.spec.host_resident) {  // summed in host memory over the group's MPI communicator
      host_.push_back({i, axis});
      continue;
    }
    const DataComm* c = &grid.data_plane(*axis);
    // Declared back to back, so adjacent in the flat buffer: extend the open bucket downwards.
    Bucket* b = buckets_.empty() ? nullptr : &buckets_.back();
    const bool next = prev == i + 1;
    const bool alone = shard && (i == tied_ || (b && b->first_tensor == tied_));
    // Copies and fp32 tensors apart (their parameters live in different buffers).
    const bool kind = !shard || !bf16_copies ||
                      (b && table.entry(b->first_tensor).spec.gemm_only == e.spec.gemm_only);
    prev = i;
    if (b && next && !alone && kind && b->comm == c && b->offset == e.offset + e.size &&
        b->size < limit) {
      b->offset = e.offset;
      b->size += e.size;
      b->first_tensor = i;
    } else {
      buckets_.push_back({i, i, e.offset, e.size, c, {}});
    }
  }
  // The moments: whole tensors, except this rank's rows of each split bucket.
  std::vector<std::int64_t> first(table.size(), 0), rows(table.size());
  std::vector<char> split_here(table.size(), 0);
  for (int i = 0; i < table.size(); ++i) rows[i] = table.entry(i).spec.local_rows();
  std::map<const DataComm*, int> split_buckets;  // per group: its buckets split so far
  if (shard)
    for (Bucket& b : buckets_) {
      if (b.first_tensor == tied_) continue;
      this->split(b, split_buckets[b.comm]++);
      std::int64_t lo = b.offset;
      for (int q = 0; q < b.comm->rank(); ++q) lo += b.blocks[q];
      const std::int64_t hi = lo + b.blocks[b.comm->rank()];
      for (int i = b.first_tensor; i <= b.last_tensor; ++i) {
        const TensorEntry& e = table.entry(i);
        const std::int64_t w = std::max<std::int64_t>(1, e.spec.row_elements());
        const std::int64_t a = std::clamp(lo, e.offset, e.offset + e.size);
        const std::int64_t z = std::clamp(hi, e.offset, e.offset + e.size);
        first[i] = (a - e.offset) / w;
        rows[i] = (z - a) / w;
        split_here[i] = 1;
      }
    }
  std::int64_t at = 0, at_host = 0;  // host tensors' moments are packed apart
  for (int i = 0; i < table.size(); ++i) {
    std::int64_t& o = table.entry(i).spec.host_resident ? at_host : at;
    slices_.push_back({first[i], rows[i], o, split_here[i] != 0});
    o += rows[i] * table.entry(i).spec.row_elements();
  }
}

void GradReducer::split(Bucket& b, int k) const {
  const int R = b.comm->size();
  // Boundary q near offset + q*size/R, moved to a row boundary of its tensor: rounded with a
  // phase in [0, 1) of a row that differs from bucket to bucket (the k-th split bucket of the
  // group: k times the golden ratio, mod 1), so that buckets of fewer rows than members (an
  // expert tensor's row is a whole expert) give their rows to different members.
  const std::int64_t phase = (std::int64_t(k) * 40503) % 65536;  // of 65536
  std::vector<std::int64_t> cut(R + 1, b.offset);
  cut[R] = b.offset + b.size;
  int t = b.first_tensor;
  for (int q = 1; q < R; ++q) {
    const std::int64_t target = b.offset + b.size * q / R;
    while (t < b.last_tensor && table_.entry(t).offset + table_.entry(t).size <= target) ++t;
    const TensorEntry& e = table_.entry(t);
    const std::int64_t w = std::max<std::int64_t>(1, e.spec.row_elements());
    const std::int64_t r = ((target - e.offset) * 65536 + phase * w) / (w * 65536);
    cut[q] = std::clamp(e.offset + std::min(r * w, e.size), cut[q - 1], cut[R]);
  }
  b.blocks.resize(R);
  for (int q = 0; q < R; ++q) b.blocks[q] = cut[q + 1] - cut[q];
}

void GradReducer::ready_from(int first_final) {
  while (next_ < buckets_.size() && buckets_[next_].first_tensor >= first_final) {
    const Bucket& b = buckets_[next_++];
    float* g = table_.grads.data() + b.offset;
    pending_.push_back(b.blocks.empty() ? b.comm->start_allreduce_sum(g, b.size)
                                        : b.comm->start_reduce_scatter_sum(g, b.blocks));
  }
}

void GradReducer::finish() {
  ready_from(0);
  // The host tensors while the device buckets travel (their gradients are final: the layers
  // added them on the host before their backward returned).
  for (const HostSum& h : host_)
    h.comm->allreduce_sum_host_data(table_.host_grad(h.tensor), table_.entry(h.tensor).size);
  for (std::size_t i = 0; i < pending_.size(); ++i) buckets_[i].comm->complete(pending_[i]);
  pending_.clear();
  next_ = 0;
  if (tied_ >= 0) {
    const DataComm& tie = grid_.data_plane(grid_.tie);
    Pending p = tie.start_allreduce_sum(table_.grad(tied_), table_.entry(tied_).size);
    tie.complete(p);
  }
}

void GradReducer::gather_params() {
  std::vector<Pending> started;
  for (const Bucket& b : buckets_) {
    if (b.blocks.empty()) continue;
    // A bucket's tensors are adjacent in the gradients and in the buffer their parameters
    // live in: the bf16 copies, or the fp32 values.
    const int t = b.first_tensor;
    started.push_back(
        table_.has_copy(t)
            ? b.comm->start_allgather(table_.weights_b16.data() + table_.copy_offset(t), b.blocks)
            : b.comm->start_allgather(table_.params.data() + table_.param_offset(t), b.blocks));
  }
  std::size_t i = 0;
  for (const Bucket& b : buckets_)
    if (!b.blocks.empty()) b.comm->complete(started[i++]);
}

}  // namespace kmoe
