#include "io/checkpoint.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

#include "core/bf16.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/fault_injection.hpp"
#include "io/collective_write.hpp"
#include "io/deck.hpp"
#include "io/durable_file.hpp"
#include "io/hdf5_file.hpp"
#include "parallel/io_watchdog.hpp"
#include "parallel/placement.hpp"

namespace kmoe {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "kmoe-checkpoint";
constexpr std::int64_t kFormatVersion = 1;

// Deck keys that define the trained function: they must match on resume. Where the Engram
// tables live (engram.offload) does not.
bool is_model_key(const std::string& key) {
  if (key == "engram.offload") return false;
  return key.rfind("model.", 0) == 0 || key.rfind("moe.", 0) == 0 || key.rfind("engram.", 0) == 0 ||
         key == "train.seq_len" || key == "train.seed";
}

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << text << "\n";
    out.close();  // a full disk shows at the flush
    KMOE_REQUIRE(!out.fail(), tmp.string() << ": cannot write (the file system is full?)");
  }
  rename_durably(tmp, path, "file");
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

namespace {

// Every attribute of a checkpoint but its final "format" mark (written last: a file without it
// was never finished), through attr(object, name, value).
template <class SetAttr>
void write_run_attributes(const Config& cfg, const TrainState& state,
                          const std::vector<std::int64_t>& layout, SetAttr&& attr) {
  attr("/", "format_version", kFormatVersion);
  attr("/", "step", std::int64_t(state.step));
  attr("/", "tokens_seen", state.tokens_seen);
  attr("/", "saved_layout", layout);
  attr("/", "kmoe_version", std::string(KMOE_VERSION));
  attr("/input", "deck", cfg.resolved_text);
  attr("/data", "seed", std::int64_t(cfg.train.seed));
  attr("/data", "next_step", std::int64_t(state.step + 1));
  attr("/data", "next_position", state.next_position);
  attr("/optimizer", "step", std::int64_t(state.step));
}

// Bytes a checkpoint of `catalog` takes: parameters, and moments of the trainable tensors, plus
// room for the metadata (the deck text, attributes, one object header per dataset).
std::int64_t checkpoint_bytes(const std::vector<TensorSpec>& catalog, const Config& cfg) {
  std::int64_t bytes = std::int64_t(1) << 20;
  bytes += 2 * static_cast<std::int64_t>(cfg.resolved_text.size());
  for (const TensorSpec& g : catalog) {
    std::int64_t n = 1;
    for (std::int64_t d : g.shape) n *= d;
    bytes += 4 * n * (g.trainable ? 3 : 1) + 4096;
  }
  return bytes;
}

void require_room(const fs::path& dir, std::int64_t bytes, const std::string& name) {
  if (fault_requested("no_space_check")) return;  // tests: let the writes meet the full disk
  std::error_code ec;
  const fs::space_info s = fs::space(dir, ec);
  if (ec) return;  // no figure to check against: the writes will tell
  const double mib = 1024.0 * 1024.0;
  KMOE_REQUIRE(std::int64_t(s.available) >= bytes,
               "checkpoint.dir = " << dir.string() << ": no room for " << name << " (about "
                                   << std::fixed << std::setprecision(1) << bytes / mib << " MiB; "
                                   << s.available / mib << " MiB free)");
}

// ", N MiB free on its file system", or "" when unknown.
std::string free_space_note(const fs::path& dir) {
  std::error_code ec;
  const fs::space_info s = fs::space(dir, ec);
  if (ec) return "";
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << " (" << s.available / (1024.0 * 1024.0)
     << " MiB free on its file system)";
  return os.str();
}

}  // namespace

void save_checkpoint(const Config& cfg, const ProcessGrid& grid, const TensorTable& table,
                     const TrainState& state) {
  const Communicator& world = grid.world;
  const fs::path dir = cfg.checkpoint.dir;
  const std::string name = checkpoint_file_name(state.step);
  const fs::path final_path = dir / name, tmp_path = dir / ("." + name + ".tmp");
  // Every element is written once, into its hyperslab, by its owner (RUNTIME.md section 4);
  // every rank creates every dataset of the model (collective metadata), stage or not.
  const std::vector<TensorSpec> catalog = global_catalog(table, grid);
  world.on_root([&] {
    std::error_code ec;
    fs::create_directories(dir, ec);
    KMOE_REQUIRE(!ec, "checkpoint.dir = " << dir.string() << ": cannot create: " << ec.message());
    require_room(dir, checkpoint_bytes(catalog, cfg), name);
  });
  auto params = host_copy("checkpoint params", table.params);
  auto m = host_copy("checkpoint exp_avg", table.exp_avg);
  auto v = host_copy("checkpoint exp_avg_sq", table.exp_avg_sq);

  // Every rank makes every step, the ranks agree after each (CollectiveWrite): a write that
  // fails on some ranks (a full disk) ends every rank on the same path.
  CollectiveWrite out(tmp_path.string(), world, cfg.parallel.watchdog_seconds);
  auto attr = [&](const std::string& object, const std::string& key, const auto& value) {
    out.step([&](H5File& f) { f.set_attr(object, key, value); });
  };
  write_run_attributes(cfg, state, {grid.pp, grid.dp, grid.ep}, attr);
  for (std::size_t i = 0; out.ok() && i < catalog.size(); ++i) {
    const TensorSpec& g = catalog[i];
    const int local = table.find(g.name);
    const TensorEntry* e = local >= 0 ? &table.entry(local) : nullptr;
    // The moments this rank keeps (a slice of the tensor with optimizer.shard).
    const MomentRows mr = e && g.trainable ? moment_rows(table, local, grid) : MomentRows();
    // The fp32 values: the owner's whole local part, or (a bf16 compute copy) each replica's
    // master rows, which are its moment slice.
    const bool copy = e && table.has_copy(local);
    const bool writer = copy ? mr.write : e && owns(e->spec, grid);
    const std::int64_t r0 = copy ? mr.first : e ? e->spec.row_begin : 0;
    const std::int64_t nr = copy ? mr.rows : e ? e->spec.local_rows() : 0;
    const std::int64_t off = e ? table.param_offset(local) : 0;
    // A tensor in host memory is written from the table's host buffers.
    const bool host = e && table.host(local);
    const float* values = host ? table.host_params.data() : params.data();
    const float* m_src = host ? table.host_exp_avg.data() : m.data();
    const float* v_src = host ? table.host_exp_avg_sq.data() : v.data();
    const std::string p = tensor_path(g.name);
    const bool middle = i == catalog.size() / 2;
    if (middle && fault_requested("kill_during_save")) std::raise(SIGKILL);
    out.step([&](H5File& f) {
      if (middle && save_fault_here(world.rank(), state.step)) f.fail_next_write();
      f.write_rows_f32("/model/" + p, g.shape, r0, nr, values + off, writer);
    });
    if (!g.trainable) continue;  // buffers have no moments
    const std::int64_t at = e ? table.moments(local).offset : 0;
    out.step([&](H5File& f) {
      f.write_rows_f32("/optimizer/exp_avg/" + p, g.shape, mr.first, mr.rows, m_src + at,
                       mr.write);
    });
    out.step([&](H5File& f) {
      f.write_rows_f32("/optimizer/exp_avg_sq/" + p, g.shape, mr.first, mr.rows, v_src + at,
                       mr.write);
    });
  }
  // The format attribute goes last: a file without it was never finished.
  attr("/", "format", std::string(kFormat));
  out.finish("checkpoint " + final_path.string() + " not saved",
             free_space_note(dir) + "; its partial file is removed, the previous checkpoints and " +
                 (dir / "latest").string() + " are as they were");
  world.on_root([&] {
    // Every rank's data is in the closed file: on the disk before its name (RUNTIME.md 2).
    rename_durably(tmp_path, final_path, "checkpoint");
    write_text_atomically(dir / "latest", name);
    prune(dir, cfg.checkpoint.keep, name);
  });
}

void write_initial_checkpoint(
    const std::string& path, const Config& cfg, const std::vector<TensorSpec>& catalog,
    const std::function<void(const TensorSpec&, std::vector<float>&)>& values) {
  const fs::path final_path = path;
  const fs::path tmp = final_path.parent_path() / ("." + final_path.filename().string() + ".tmp");
  {
    H5File f = H5File::create(tmp.string(), MPI_COMM_SELF);
    write_run_attributes(cfg, TrainState(), {1, 1, 1},
                         [&](const std::string& object, const std::string& key,
                             const auto& value) { f.set_attr(object, key, value); });
    std::vector<float> v;
    for (const TensorSpec& g : catalog) {
      std::int64_t n = 1;
      for (std::int64_t d : g.shape) n *= d;
      v.assign(n, 0.0f);
      try {
        values(g, v);
      } catch (...) {  // the source refused a value: no half-written file stays behind
        f.close();
        std::error_code ec;
        fs::remove(tmp, ec);
        throw;
      }
      KMOE_REQUIRE(std::int64_t(v.size()) == n, path << ": " << g.name << " got " << v.size()
                                                      << " values for " << n << " elements");
      const std::string p = tensor_path(g.name);
      f.write_f32("/model/" + p, g.shape, v.data(), true);
      if (!g.trainable) continue;
      std::fill(v.begin(), v.end(), 0.0f);  // AdamW starts from zero moments
      f.write_f32("/optimizer/exp_avg/" + p, g.shape, v.data(), true);
      f.write_f32("/optimizer/exp_avg_sq/" + p, g.shape, v.data(), true);
    }
    f.set_attr("/", "format", std::string(kFormat));
    KMOE_REQUIRE(f.try_close(), tmp.string() << ": cannot finish writing (the disk is full?)");
  }
  rename_durably(tmp, final_path, "checkpoint");
}

std::string resume_file(const CheckpointCfg& c) {
  if (c.resume == "none") return "";
  if (c.resume == "auto") {
    const fs::path latest = fs::path(c.dir) / "latest";
    if (!fs::exists(latest)) return "";
    std::ifstream in(latest);
    std::string name;
    std::getline(in, name);
    // Edited by hand or copied through another system: CR-LF, spaces.
    const auto first = name.find_first_not_of(" \t\r\n");
    name = first == std::string::npos
               ? std::string()
               : name.substr(first, name.find_last_not_of(" \t\r\n") + 1 - first);
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

namespace {

// The format, the deck's model and the step attributes of an open checkpoint.
TrainState inspect(const H5File& f, const std::string& path, const Config& cfg,
                   std::string* changes) {
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
  // The saved deck read again: keys added to kmoe since it was saved take their defaults, so
  // a checkpoint from before them resumes when the run leaves them at their defaults.
  std::string saved = f.attr_string("/input", "deck");
  try {
    saved = parse_deck(saved, path + ":/input/deck").resolved_text;
  } catch (const Error&) {
    // a key kmoe no longer knows: compare the text as saved
  }
  compare_decks(path, saved, cfg.resolved_text, changes);
  TrainState s;
  s.step = static_cast<int>(f.attr_int("/", "step"));
  s.tokens_seen = f.attr_int("/", "tokens_seen");
  s.next_position = f.attr_int("/data", "next_position");
  KMOE_REQUIRE(
      f.attr_int("/data", "next_step") == s.step + 1 && f.attr_int("/optimizer", "step") == s.step,
      path << ": inconsistent step attributes");
  return s;
}

}  // namespace

void require_finite(const std::string& file, const std::string& dataset, const TensorSpec& spec,
                    std::int64_t first_row, const float* values, std::int64_t n,
                    const char* action) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::isfinite(values[i])) continue;
    const std::int64_t row_len = std::max<std::int64_t>(1, spec.row_elements());
    KMOE_FAIL(file << ": dataset " << dataset << " holds " << values[i] << " at row "
                   << first_row + i / row_len << ", element " << i % row_len
                   << " (a non-finite value in " << spec.name << "): refusing to " << action
                   << " it");
  }
}

TrainState check_checkpoint(const std::string& path, const Config& cfg, std::string* changes) {
  const H5File f = H5File::open(path, MPI_COMM_SELF);
  return inspect(f, path, cfg, changes);
}

TrainState load_checkpoint(const std::string& path, const Config& cfg, const ProcessGrid& grid,
                           TensorTable& table, bool with_optimizer, std::string* changes) {
  IoWatchdog watchdog(cfg.parallel.watchdog_seconds, "reading " + path);
  H5File f = H5File::open(path, grid.world.comm());
  f.set_progress([&watchdog] { watchdog.progress(); });
  const TrainState s = inspect(f, path, cfg, changes);
  // Host copies of the current values: what the file does not replace stays as it was.
  auto params = host_copy("checkpoint params", table.params);
  auto copies = host_copy("checkpoint copies", table.weights_b16);
  decltype(host_copy("", table.exp_avg)) m, v;
  if (with_optimizer) {
    m = host_copy("checkpoint exp_avg", table.exp_avg);
    v = host_copy("checkpoint exp_avg_sq", table.exp_avg_sq);
  }
  // Each rank reads exactly its own hyperslabs, whatever layout wrote the file, and refuses
  // non-finite values: trained on, a NaN would spread into every later checkpoint.
  auto read = [&](const std::string& dataset, const TensorEntry& e, std::int64_t r0,
                  std::int64_t nr, float* out) {
    f.read_rows_f32(dataset, e.spec.shape, r0, nr, out);
    watchdog.progress();
    require_finite(path, dataset, e.spec, r0, out, nr * e.spec.row_elements(), "load");
  };
  for (int t = 0; t < table.size(); ++t) {
    const TensorEntry& e = table.entry(t);
    const std::string p = tensor_path(e.spec.name);
    if (table.host(t)) {  // straight into the table's host buffers
      read("/model/" + p, e, e.spec.row_begin, e.spec.local_rows(), table.host_param(t));
      if (with_optimizer) {
        read("/optimizer/exp_avg/" + p, e, e.spec.row_begin, e.spec.local_rows(),
             table.host_m(t));
        read("/optimizer/exp_avg_sq/" + p, e, e.spec.row_begin, e.spec.local_rows(),
             table.host_v(t));
      }
      continue;
    }
    if (!table.has_copy(t)) {
      read("/model/" + p, e, e.spec.row_begin, e.spec.local_rows(),
           params.data() + table.param_offset(t));
    } else {  // every local row rounded into the compute copy, the master rows as they are
      std::vector<float> rows(e.size);
      read("/model/" + p, e, e.spec.row_begin, e.spec.local_rows(), rows.data());
      const std::int64_t w = e.spec.row_elements(), m0 = table.master_first(t) * w;
      std::copy_n(rows.data() + m0, table.master_rows(t) * w, params.data() + table.param_offset(t));
      for (std::int64_t j = 0; j < e.size; ++j) copies(table.copy_offset(t) + j) = bf16_bits(rows[j]);
    }
    if (with_optimizer && e.spec.trainable) {  // the moments this rank keeps
      const MomentSlice& s = table.moments(t);
      const std::int64_t r0 = e.spec.row_begin + s.first;
      read("/optimizer/exp_avg/" + p, e, r0, s.rows, m.data() + s.offset);
      read("/optimizer/exp_avg_sq/" + p, e, r0, s.rows, v.data() + s.offset);
    }
  }
  Kokkos::deep_copy(table.params, params);
  Kokkos::deep_copy(table.weights_b16, copies);
  if (with_optimizer) {
    Kokkos::deep_copy(table.exp_avg, m);
    Kokkos::deep_copy(table.exp_avg_sq, v);
  }
  return s;
}

}  // namespace kmoe
