#include "io/checkpoint.hpp"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "core/error.hpp"
#include "core/fault_injection.hpp"
#include "io/deck.hpp"
#include "io/hdf5_file.hpp"
#include "parallel/placement.hpp"

namespace kmoe {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "kmoe-checkpoint";
constexpr std::int64_t kFormatVersion = 1;

// Deck keys that define the trained function: they must match on resume.
bool is_model_key(const std::string& key) {
  return key.rfind("model.", 0) == 0 || key.rfind("moe.", 0) == 0 || key.rfind("engram.", 0) == 0 ||
         key == "train.seq_len" || key == "train.seed";
}

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << text << "\n";
    KMOE_REQUIRE(out.good(), tmp.string() << ": cannot write");
  }
  fs::rename(tmp, path);
}

// Keeps `current` (just written) and the newest keep-1 stepNNNNNNNN.h5 files before it; older
// ones go. Files of later steps (left by another run in the same directory) are not this run's
// history and stay: deleting by name order alone could remove the file `latest` names.
void prune(const fs::path& dir, int keep, const std::string& current) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.size() == 15 && n.rfind("step", 0) == 0 && n.substr(12) == ".h5" && n < current)
      files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  for (std::size_t i = 0; i + (keep - 1) < files.size(); ++i) fs::remove(files[i]);
}

}  // namespace

std::string checkpoint_file_name(int step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step%08d.h5", step);
  return buf;
}

std::string tensor_path(const std::string& name) {
  std::string p = name;
  std::replace(p.begin(), p.end(), '.', '/');
  return p;
}

void save_checkpoint(const Config& cfg, const ProcessGrid& grid, const TensorTable& table,
                     const TrainState& state) {
  const fs::path dir = cfg.checkpoint.dir;
  const std::string name = checkpoint_file_name(state.step);
  const fs::path final_path = dir / name, tmp_path = dir / ("." + name + ".tmp");
  if (grid.is_root()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    KMOE_REQUIRE(!ec, "checkpoint.dir = " << dir.string() << ": cannot create: " << ec.message());
  }
  grid.world.barrier();

  // Every element is written once, into its hyperslab, by its owner (RUNTIME.md section 4);
  // every rank creates every dataset of the model (collective metadata), stage or not.
  const std::vector<TensorSpec> catalog = global_catalog(table, grid);
  auto params = Kokkos::create_mirror_view_and_copy(HostSpace(), table.params);
  auto m = Kokkos::create_mirror_view_and_copy(HostSpace(), table.exp_avg);
  auto v = Kokkos::create_mirror_view_and_copy(HostSpace(), table.exp_avg_sq);

  H5File f = H5File::create(tmp_path.string(), grid.world.comm());
  f.set_attr("/", "format_version", kFormatVersion);
  f.set_attr("/", "step", std::int64_t(state.step));
  f.set_attr("/", "tokens_seen", state.tokens_seen);
  f.set_attr("/", "saved_layout", std::vector<std::int64_t>{grid.pp, grid.dp, grid.ep});
  f.set_attr("/", "kmoe_version", std::string(KMOE_VERSION));
  f.set_attr("/input", "deck", cfg.resolved_text);
  f.set_attr("/data", "seed", std::int64_t(cfg.train.seed));
  f.set_attr("/data", "next_step", std::int64_t(state.step + 1));
  f.set_attr("/data", "next_position", state.next_position);
  f.set_attr("/optimizer", "step", std::int64_t(state.step));
  for (std::size_t i = 0; i < catalog.size(); ++i) {
    const TensorSpec& g = catalog[i];
    const int local = table.find(g.name);
    const TensorEntry* e = local >= 0 ? &table.entry(local) : nullptr;
    const bool writer = e && owns(e->spec, grid);
    const std::int64_t r0 = e ? e->spec.row_begin : 0, nr = e ? e->spec.local_rows() : 0;
    const std::int64_t off = e ? e->offset : 0;
    const std::string p = tensor_path(g.name);
    f.write_rows_f32("/model/" + p, g.shape, r0, nr, params.data() + off, writer);
    if (!g.trainable) continue;  // buffers have no moments
    f.write_rows_f32("/optimizer/exp_avg/" + p, g.shape, r0, nr, m.data() + off, writer);
    f.write_rows_f32("/optimizer/exp_avg_sq/" + p, g.shape, r0, nr, v.data() + off, writer);
    if (i == catalog.size() / 2 && fault_requested("kill_during_save")) std::raise(SIGKILL);
  }
  // The format attribute goes last: a file without it was never finished.
  f.set_attr("/", "format", std::string(kFormat));
  f.close();

  if (grid.is_root()) {
    fs::rename(tmp_path, final_path);
    write_text_atomically(dir / "latest", name);
    prune(dir, cfg.checkpoint.keep, name);
  }
  grid.world.barrier();
}

std::string resume_file(const CheckpointCfg& c) {
  if (c.resume == "none") return "";
  if (c.resume == "auto") {
    const fs::path latest = fs::path(c.dir) / "latest";
    if (!fs::exists(latest)) return "";
    std::ifstream in(latest);
    std::string name;
    std::getline(in, name);
    KMOE_REQUIRE(!name.empty(), latest.string() << " is empty; remove it or set checkpoint.resume");
    const fs::path file = fs::path(c.dir) / name;
    KMOE_REQUIRE(fs::exists(file),
                 latest.string() << " names " << name << ", which does not exist in " << c.dir);
    return file.string();
  }
  KMOE_REQUIRE(fs::exists(c.resume), "checkpoint.resume = " << c.resume << ": no such file");
  return c.resume;
}

namespace {

// Lists the model-defining keys that differ (an error) and the others that changed (printed).
void compare_decks(const std::string& path, const std::string& saved, const std::string& current,
                   std::string* changes) {
  const auto before = resolved_values(saved), now = resolved_values(current);
  std::ostringstream model_diff, other_diff;
  std::set<std::string> seen;
  auto value_in = [](const auto& list, const std::string& key) -> const std::string* {
    for (const auto& kv : list)
      if (kv.first == key) return &kv.second;
    return nullptr;
  };
  for (const auto* list : {&now, &before})
    for (const auto& kv : *list) {
      if (!seen.insert(kv.first).second) continue;
      const std::string* a = value_in(before, kv.first);
      const std::string* b = value_in(now, kv.first);
      if (a && b && *a == *b) continue;
      std::ostringstream& os = is_model_key(kv.first) ? model_diff : other_diff;
      os << "\n  " << kv.first << ": " << (a ? *a : "(absent)") << " -> " << (b ? *b : "(absent)");
    }
  KMOE_REQUIRE(model_diff.str().empty(),
               path << ": the deck's model does not match the checkpoint's (checkpoint -> deck):"
                    << model_diff.str());
  if (changes) *changes = other_diff.str();
}

}  // namespace

TrainState load_checkpoint(const std::string& path, const Config& cfg, const ProcessGrid& grid,
                           TensorTable& table, bool with_optimizer, std::string* changes) {
  H5File f = H5File::open(path, grid.world.comm());
  KMOE_REQUIRE(f.has_attr("/", "format"),
               path << ": not a complete kmoe checkpoint (no format attribute: an unfinished "
                       "save or another kind of file)");
  const std::string format = f.attr_string("/", "format");
  KMOE_REQUIRE(format == kFormat,
               path << ": format attribute is '" << format << "', expected '" << kFormat << "'");
  const std::int64_t version = f.attr_int("/", "format_version");
  KMOE_REQUIRE(version == kFormatVersion, path << ": format_version " << version
                                               << " is not supported (this kmoe reads "
                                               << kFormatVersion << ")");
  compare_decks(path, f.attr_string("/input", "deck"), cfg.resolved_text, changes);

  auto params = Kokkos::create_mirror_view(table.params);
  auto m = Kokkos::create_mirror_view(table.exp_avg);
  auto v = Kokkos::create_mirror_view(table.exp_avg_sq);
  // Each rank reads exactly its own hyperslabs, whatever layout wrote the file.
  for (const auto& e : table.entries()) {
    const std::string p = tensor_path(e.spec.name);
    const std::int64_t r0 = e.spec.row_begin, nr = e.spec.local_rows();
    f.read_rows_f32("/model/" + p, e.spec.shape, r0, nr, params.data() + e.offset);
    if (with_optimizer && e.spec.trainable) {
      f.read_rows_f32("/optimizer/exp_avg/" + p, e.spec.shape, r0, nr, m.data() + e.offset);
      f.read_rows_f32("/optimizer/exp_avg_sq/" + p, e.spec.shape, r0, nr, v.data() + e.offset);
    }
  }
  TrainState s;
  s.step = static_cast<int>(f.attr_int("/", "step"));
  s.tokens_seen = f.attr_int("/", "tokens_seen");
  s.next_position = f.attr_int("/data", "next_position");
  KMOE_REQUIRE(
      f.attr_int("/data", "next_step") == s.step + 1 && f.attr_int("/optimizer", "step") == s.step,
      path << ": inconsistent step attributes");
  Kokkos::deep_copy(table.params, params);
  if (with_optimizer) {
    Kokkos::deep_copy(table.exp_avg, m);
    Kokkos::deep_copy(table.exp_avg_sq, v);
  }
  return s;
}

}  // namespace kmoe
