// kmoe-prep: UTF-8 text to token files with the byte-level tokenizer (RUNTIME.md section 3).
//   kmoe-prep --fortunes [--input-dir DIR] --out-dir OUT
//   kmoe-prep --out-dir OUT [--separator S] [--val-every N] [--dtype uint16|uint32] FILE...
// Needs neither Kokkos nor MPI: it runs before any training job, often on a login node.
#include <algorithm>
#include <boost/program_options.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "io/text_corpus.hpp"

namespace fs = std::filesystem;
namespace po = boost::program_options;

namespace {

constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

// Redraws only when the shown percentage changes: a line per block would flood a log file.
class ProgressBar {
 public:
  explicit ProgressBar(std::int64_t total) : total_(total) {}
  // An error mid-read must not print its message onto the end of the bar.
  ~ProgressBar() {
    if (shown_ >= 0 && !finished_) std::fputc('\n', stderr);
  }
  void advance(std::int64_t bytes) {
    done_ += bytes;
    const int percent = total_ > 0 ? static_cast<int>(100 * done_ / total_) : 100;
    if (percent != shown_) draw(percent);
  }
  void finish() {
    if (shown_ != 100) draw(100);
    std::fputc('\n', stderr);
    finished_ = true;
  }

 private:
  void draw(int percent) {
    constexpr int kWidth = 30;
    const int filled = percent * kWidth / 100;
    std::string bar(kWidth, ' ');
    std::fill(bar.begin(), bar.begin() + filled, '=');
    if (filled < kWidth) bar[filled] = '>';
    std::fprintf(stderr, "\r[%s] %3d%% %.1f/%.1f MB", bar.c_str(), percent, done_ / 1e6,
                 total_ / 1e6);
    std::fflush(stderr);
    shown_ = percent;
  }
  std::int64_t total_;
  std::int64_t done_ = 0;
  int shown_ = -1;
  bool finished_ = false;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The fortune files proper: strfile's index (*.dat) and the UTF-8 symlinks (*.u8) would
// duplicate or corrupt the text.
std::vector<std::string> fortune_files(const std::string& dir) {
  KMOE_REQUIRE(fs::is_directory(dir), "input directory not found: " << dir);
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || ends_with(name, ".dat") || ends_with(name, ".u8")) continue;
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());  // byte-wise: the corpus must not depend on the locale
  std::vector<std::string> paths;
  for (const std::string& name : names) paths.push_back((fs::path(dir) / name).string());
  return paths;
}

int run(int argc, char** argv) {
  std::string input_dir = kFortunesDir, out_dir, dtype = "uint16", separator;
  std::int64_t val_every = 20;
  std::vector<std::string> files;
  bool fortunes = false;

  po::options_description visible(
      "Usage:\n"
      "  kmoe-prep --fortunes [--input-dir DIR] --out-dir OUT\n"
      "  kmoe-prep --out-dir OUT [--separator S] [--val-every N] [--dtype uint16|uint32] FILE...\n"
      "Writes OUT/train.bin and OUT/val.bin: byte-level tokens (0..255 bytes, 256 end of "
      "document,\nvocab_size 320), headerless little-endian.\n\nOptions");
  auto add = visible.add_options();
  add("help,h", "print this help");
  add("fortunes", po::bool_switch(&fortunes),
      "the default corpus: every file of --input-dir except *.dat and *.u8, in name order, "
      "documents separated by lines holding only '%', every 20th to validation");
  add("input-dir", po::value(&input_dir),
      "fortune files directory (default /usr/share/games/fortunes)");
  add("out-dir", po::value(&out_dir), "output directory, created if needed (required)");
  add("separator", po::value(&separator),
      "a line holding exactly S ends a document (default: each file is one document)");
  add("val-every", po::value(&val_every)->default_value(20),
      "every N-th document goes to val.bin; 0 writes no val.bin");
  add("dtype", po::value(&dtype)->default_value("uint16"), "token dtype: uint16 or uint32");
  po::options_description all;
  all.add(visible).add_options()("file", po::value(&files));
  po::positional_options_description positional;
  positional.add("file", -1);

  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(all).positional(positional).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << visible << "\n";
    return 0;
  }
  KMOE_REQUIRE(!out_dir.empty(), "--out-dir is required (see --help)");
  KMOE_REQUIRE(dtype == "uint16" || dtype == "uint32",
               "--dtype must be uint16 or uint32, got '" << dtype << "'");
  KMOE_REQUIRE(val_every >= 0, "--val-every must be >= 0, got " << val_every);
  std::optional<std::string> sep;
  if (vm.count("separator")) sep = separator;

  if (fortunes) {
    KMOE_REQUIRE(files.empty(), "--fortunes takes no FILE arguments");
    if (!sep) sep = "%";
    files = fortune_files(input_dir);
    KMOE_REQUIRE(!files.empty(), "no fortune files in " << input_dir);
  } else {
    KMOE_REQUIRE(!vm.count("input-dir"), "--input-dir needs --fortunes");
    KMOE_REQUIRE(!files.empty(), "no input files (give FILE... or --fortunes; see --help)");
  }

  std::int64_t total_bytes = 0;
  for (const std::string& f : files) {
    KMOE_REQUIRE(fs::is_regular_file(f), "input file not found or not a regular file: " << f);
    total_bytes += static_cast<std::int64_t>(fs::file_size(f));
  }

  kmoe::CorpusWriter writer(out_dir, dtype, val_every);
  kmoe::DocumentSplitter splitter(sep, [&writer](std::string_view d) { writer.add_document(d); });
  ProgressBar progress(total_bytes);
  for (const std::string& f : files) {
    kmoe::feed_text_file(f, splitter, [&progress](std::int64_t n) { progress.advance(n); });
  }
  progress.finish();
  const kmoe::CorpusCounts c = writer.finish();

  std::cout << "kmoe-prep: " << files.size() << " files, " << total_bytes << " bytes\n"
            << "  documents: train " << c.documents_train << ", val " << c.documents_val << "\n"
            << "  tokens:    train " << c.tokens_train << ", val " << c.tokens_val << "\n"
            << "  vocab_size " << kmoe::kByteVocabSize << " (model.vocab_size), dtype " << dtype
            << "\n"
            << "  wrote " << writer.train_path();
  if (val_every > 0) std::cout << " and " << writer.val_path();
  std::cout << "\n";
  if (c.removed_stale_val)
    std::cout << "  removed " << (fs::path(out_dir) / "val.bin").string()
              << ": it held an earlier corpus's validation split (--val-every 0 writes none)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "kmoe-prep: error: " << e.what() << "\n";
  } catch (...) {
    std::cerr << "kmoe-prep: error: unknown exception\n";
  }
  return 1;
}
