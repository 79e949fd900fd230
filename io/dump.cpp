#include "io/dump.hpp"

#include <filesystem>

#include "io/checkpoint.hpp"
#include "io/hdf5_file.hpp"
#include "parallel/io_watchdog.hpp"
#include "parallel/placement.hpp"

namespace kmoe {

void write_step_dump(const Config& cfg, const ProcessGrid& grid, const TensorTable& table,
                     const StepDump& d) {
  const std::string path = cfg.output.dir + "/dump_step" + std::to_string(d.step) + ".h5";
  const bool writer = grid.is_root();  // tokens and routes are whole-batch arrays
  auto grads = Kokkos::create_mirror_view_and_copy(HostSpace(), table.grads);
  // Collective writes: a rank left behind by a failing one ends the job instead of waiting.
  IoWatchdog watchdog(cfg.parallel.watchdog_seconds, "writing " + path);
  H5File f = H5File::create(path, grid.world.comm());
  f.set_attr("/", "step", std::int64_t(d.step));
  f.set_attr("/", "loss", d.loss);
  f.set_attr("/", "ce", d.ce);
  f.set_attr("/", "aux", d.aux);
  f.set_attr("/", "grad_norm", d.grad_norm);
  f.set_attr("/", "lr", d.lr);
  f.write_i32("/batch/tokens", {d.global_batch, d.seq_len}, d.tokens.data(), writer);
  for (const auto& [block, route] : d.routes)
    f.write_i32("/route/" + std::to_string(block),
                {std::int64_t(d.global_batch) * d.seq_len, d.top_k}, route.data(), writer);
  for (const TensorSpec& g : global_catalog(table, grid)) {
    if (!g.trainable) continue;  // buffers have no gradient
    const int i = table.find(g.name);
    const TensorEntry* e = i >= 0 ? &table.entry(i) : nullptr;
    f.write_rows_f32("/grad/" + tensor_path(g.name), g.shape, e ? e->spec.row_begin : 0,
                     e ? e->spec.local_rows() : 0, grads.data() + (e ? e->offset : 0),
                     e && owns(e->spec, grid));
    watchdog.progress();
  }
  f.close();
}

}  // namespace kmoe
