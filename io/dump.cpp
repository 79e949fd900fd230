#include "io/dump.hpp"

#include <filesystem>

#include "core/device_sync.hpp"
#include "io/checkpoint.hpp"
#include "io/collective_write.hpp"
#include "parallel/placement.hpp"

namespace kmoe {

void write_step_dump(const Config& cfg, const ProcessGrid& grid, const TensorTable& table,
                     const StepDump& d) {
  const std::string path = cfg.output.dir + "/dump_step" + std::to_string(d.step) + ".h5";
  const bool writer = grid.is_root();  // tokens and routes are whole-batch arrays
  auto grads = host_copy("dump gradients", table.grads);
  // A write failing on some ranks (a full output disk) ends every rank with one error.
  CollectiveWrite out(path, grid.world, cfg.parallel.watchdog_seconds);
  out.step([&](H5File& f) { f.set_attr("/", "step", std::int64_t(d.step)); });
  // (Pairs, not structured bindings: a lambda capturing those needs C++20, which nvcc says.)
  for (const auto& kv : {std::pair<const char*, double>{"loss", d.loss},
                         {"ce", d.ce},
                         {"aux", d.aux},
                         {"grad_norm", d.grad_norm},
                         {"lr", d.lr}})
    out.step([&](H5File& f) { f.set_attr("/", kv.first, kv.second); });
  out.step([&](H5File& f) {
    f.write_i32("/batch/tokens", {d.global_batch, d.seq_len}, d.tokens.data(), writer);
  });
  for (const auto& r : d.routes)
    out.step([&](H5File& f) {
      f.write_i32("/route/" + std::to_string(r.first),
                  {std::int64_t(d.global_batch) * d.seq_len, d.top_k}, r.second.data(), writer);
    });
  for (const TensorSpec& g : global_catalog(table, grid)) {
    if (!g.trainable || !out.ok()) continue;  // buffers have no gradient
    const int i = table.find(g.name);
    const TensorEntry* e = i >= 0 ? &table.entry(i) : nullptr;
    // The reduced rows: with optimizer.shard each replica holds those of its moment slice.
    const MomentRows r = e ? moment_rows(table, i, grid) : MomentRows();
    const std::int64_t at = e ? e->offset + r.local_first * e->spec.row_elements() : 0;
    out.step([&](H5File& f) {
      const float* src = e && table.host(i) ? table.host_grads.data() : grads.data();
      f.write_rows_f32("/grad/" + tensor_path(g.name), g.shape, r.first, r.rows, src + at,
                       r.write);
    });
  }
  out.finish("step dump " + path + " not written");
}

}  // namespace kmoe
