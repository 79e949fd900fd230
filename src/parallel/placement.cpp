#include "parallel/placement.hpp"

#include <set>
#include <sstream>

#include "core/error.hpp"

namespace kmoe {

bool owns(const TensorSpec& spec, const ProcessGrid& grid) {
  if (spec.tied_copy) return false;
  switch (spec.shard) {
    case Shard::None:
      return grid.replica() == 0;
    case Shard::Ep:
      return grid.dp_rank == 0;
    case Shard::Stage:
      return true;
  }
  return false;
}

const Communicator* gradient_comm(const TensorSpec& spec, const ProcessGrid& grid) {
  switch (spec.shard) {
    case Shard::None:
      return &grid.stage;
    case Shard::Ep:
      return &grid.dp_axis;
    case Shard::Stage:
      return nullptr;
  }
  return nullptr;
}

std::vector<TensorSpec> global_catalog(const TensorTable& table, const ProcessGrid& grid) {
  // One line per tensor: name, trainable flag, global shape. Each stage's first replica speaks
  // for its stage; world order is stage order, so the union keeps the model's order.
  std::ostringstream mine;
  if (grid.replica() == 0)
    for (const auto& e : table.entries()) {
      if (e.spec.tied_copy) continue;
      mine << e.spec.name << ' ' << (e.spec.trainable ? 1 : 0);
      for (auto d : e.spec.shape) mine << ' ' << d;
      mine << '\n';
    }
  std::vector<TensorSpec> out;
  std::set<std::string> seen;
  for (const std::string& text : grid.world.all_gather(mine.str())) {
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      TensorSpec s;
      int trainable = 1;
      ls >> s.name >> trainable;
      for (std::int64_t d; ls >> d;) s.shape.push_back(d);
      s.trainable = trainable != 0;
      if (seen.insert(s.name).second) out.push_back(std::move(s));
    }
  }
  return out;
}

MomentRows moment_rows(const TensorTable& table, int i, const ProcessGrid& grid) {
  const TensorSpec& spec = table.entry(i).spec;
  const MomentSlice& s = table.moments(i);
  MomentRows r;
  r.local_first = s.first;
  r.first = spec.row_begin + s.first;
  r.rows = s.rows;
  r.write = s.split ? s.rows > 0 : owns(spec, grid);
  return r;
}

}  // namespace kmoe
