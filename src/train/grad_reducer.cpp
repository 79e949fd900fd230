#include "train/grad_reducer.hpp"

#include <algorithm>

#include "parallel/placement.hpp"

namespace kmoe {

GradReducer::GradReducer(TensorTable& table, const ProcessGrid& grid, double bucket_mb, bool tied)
    : table_(table), grid_(grid) {
  const std::int64_t limit =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(bucket_mb * 1024 * 1024 / sizeof(float)));
  // Every member of a communicator must issue the same all-reduces: bucket boundaries depend
  // only on what is the same on every member (table indices, reduction groups, the sizes of
  // tensors reduced over the group), never on tensors outside the group. A row block with no
  // rows here stays in its bucket (it adds nothing) so the members still agree.
  int prev = -1;  // the index of the last tensor taken into a bucket
  for (int i = table.size() - 1; i >= 0; --i) {
    const TensorEntry& e = table.entry(i);
    if (!e.spec.trainable) continue;
    const Communicator* axis = gradient_comm(e.spec, grid);
    if (!axis || axis->size() == 1) continue;
    const DataComm* c = &grid.data_plane(*axis);
    // Declared back to back, so adjacent in the flat buffer: extend the open bucket downwards.
    Bucket* b = buckets_.empty() ? nullptr : &buckets_.back();
    const bool next = prev == i + 1;
    prev = i;
    if (b && next && b->comm == c && b->offset == e.offset + e.size && b->size < limit) {
      b->offset = e.offset;
      b->size += e.size;
      b->first_tensor = i;
    } else {
      buckets_.push_back({i, e.offset, e.size, c});
    }
  }
  if (tied && grid.tie.valid()) tied_ = table.find("embed.weight");
}

void GradReducer::ready_from(int first_final) {
  while (next_ < buckets_.size() && buckets_[next_].first_tensor >= first_final) {
    const Bucket& b = buckets_[next_++];
    pending_.push_back(b.comm->start_allreduce_sum(table_.grads.data() + b.offset, b.size));
  }
}

void GradReducer::finish() {
  ready_from(0);
  for (std::size_t i = 0; i < pending_.size(); ++i) buckets_[i].comm->complete(pending_[i]);
  pending_.clear();
  next_ = 0;
  if (tied_ >= 0) {
    const DataComm& tie = grid_.data_plane(grid_.tie);
    Pending p = tie.start_allreduce_sum(table_.grad(tied_), table_.entry(tied_).size);
    tie.complete(p);
  }
}

}  // namespace kmoe
