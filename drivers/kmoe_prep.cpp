// kmoe-prep: text to token files with the byte-level tokenizer or a SentencePiece model
// (RUNTIME.md section 3), and token files back to text.
//   kmoe-prep --fortunes [--input-dir DIR] --out-dir OUT [tokenizer]
//   kmoe-prep --out-dir OUT [--separator S] [--val-every N] [--dtype uint16|uint32]
//             [tokenizer] FILE...
//   tokenizer: --sentencepiece MODEL | --train-sentencepiece VOCAB
//   kmoe-prep --decode TOKENS [--sentencepiece MODEL] [--dtype uint16|uint32] [--separator S]
// Needs neither Kokkos nor MPI: it runs before any training job, often on a login node.
#include <algorithm>
#include <boost/program_options.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "io/text_corpus.hpp"
#include "io/tokenizer.hpp"

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

// --decode: a token file back to text, each document followed by a line holding the separator
// (what kmoe-prep reads back into the same documents).
int decode_file(const std::string& path, const std::string& dtype, kmoe::TextTokenizer& tok,
                const std::string& separator) {
  KMOE_REQUIRE(fs::is_regular_file(path), "--decode: " << path << " not found or not a file");
  std::ifstream in(path, std::ios::binary);
  const int width = dtype == "uint16" ? 2 : 4;
  const auto bytes = static_cast<std::int64_t>(fs::file_size(path));
  KMOE_REQUIRE(bytes % width == 0, "--decode: " << path << " holds " << bytes
                                                << " bytes, not a whole number of " << dtype);
  std::vector<unsigned char> raw(static_cast<std::size_t>(bytes));
  in.read(reinterpret_cast<char*>(raw.data()), bytes);
  KMOE_REQUIRE(in.good() || bytes == 0, "--decode: cannot read " << path);
  std::vector<std::int32_t> doc;
  auto flush = [&] {
    std::cout << tok.decode(doc) << separator << "\n";
    doc.clear();
  };
  for (std::int64_t i = 0; i < bytes; i += width) {
    std::uint32_t id = raw[i] | (std::uint32_t(raw[i + 1]) << 8);
    if (width == 4) id |= (std::uint32_t(raw[i + 2]) << 16) | (std::uint32_t(raw[i + 3]) << 24);
    doc.push_back(static_cast<std::int32_t>(id));
    if (static_cast<std::int32_t>(id) == tok.end_of_document()) flush();
  }
  if (!doc.empty()) flush();
  return 0;
}

int run(int argc, char** argv) {
  std::string input_dir = kFortunesDir, out_dir, dtype = "uint16", separator, sp_model, decode;
  std::int64_t val_every = 20;
  int sp_vocab = 0;
  std::vector<std::string> files;
  bool fortunes = false;

  po::options_description visible(
      "Usage:\n"
      "  kmoe-prep --fortunes [--input-dir DIR] --out-dir OUT [TOKENIZER]\n"
      "  kmoe-prep --out-dir OUT [--separator S] [--val-every N] [--dtype uint16|uint32]\n"
      "            [TOKENIZER] FILE...\n"
      "  kmoe-prep --decode TOKENS [--sentencepiece MODEL] [--dtype ...] [--separator S]\n"
      "TOKENIZER: --sentencepiece MODEL | --train-sentencepiece VOCAB (default: byte-level).\n"
      "Writes OUT/train.bin and OUT/val.bin, headerless little-endian: byte-level tokens (0..255 "
      "bytes,\n256 end of document, vocab_size 320) or the SentencePiece model's ids (its "
      "end-of-sentence id\nends each document), and prints the deck's [model] vocab_size and "
      "[data] lines.\n\nOptions");
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
  add("sentencepiece", po::value(&sp_model),
      "encode with this SentencePiece model (bytes that are not UTF-8 become its byte pieces "
      "when it has byte fallback)");
  add("train-sentencepiece", po::value(&sp_vocab),
      "first train a SentencePiece model of about VOCAB pieces on the corpus (unigram, byte "
      "fallback, no normalization: text comes back byte for byte) into OUT/sentencepiece.model, "
      "then encode with it; reads the whole corpus into memory");
  add("decode", po::value(&decode),
      "write the text of a token file to standard output, each document followed by a line "
      "holding the separator (default '%')");
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
  KMOE_REQUIRE(dtype == "uint16" || dtype == "uint32",
               "--dtype must be uint16 or uint32, got '" << dtype << "'");
  KMOE_REQUIRE(sp_model.empty() || !vm.count("train-sentencepiece"),
               "give --sentencepiece MODEL or --train-sentencepiece VOCAB, not both");
  if (!decode.empty()) {
    KMOE_REQUIRE(files.empty() && out_dir.empty() && !fortunes && !vm.count("train-sentencepiece"),
                 "--decode takes only --sentencepiece, --dtype and --separator");
    auto tok = sp_model.empty() ? kmoe::byte_tokenizer() : kmoe::load_sentencepiece(sp_model);
    return decode_file(decode, dtype, *tok, vm.count("separator") ? separator : "%");
  }
  KMOE_REQUIRE(!out_dir.empty(), "--out-dir is required (see --help)");
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

  // The tokenizer: byte-level, a given SentencePiece model, or one trained here on the corpus
  // (read whole first).
  std::unique_ptr<kmoe::TextTokenizer> tok;
  std::vector<std::string> documents;
  if (vm.count("train-sentencepiece")) {
    kmoe::DocumentSplitter collect(sep, [&](std::string_view d) { documents.emplace_back(d); });
    for (const std::string& f : files) kmoe::feed_text_file(f, collect);
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    KMOE_REQUIRE(!ec, "cannot create directory " << out_dir << ": " << ec.message());
    sp_model = (fs::path(out_dir) / "sentencepiece.model").string();
    std::cerr << "kmoe-prep: training a SentencePiece model of " << sp_vocab << " pieces on "
              << documents.size() << " documents\n";
    kmoe::train_sentencepiece(documents, sp_vocab, sp_model);
  }
  tok = sp_model.empty() ? kmoe::byte_tokenizer() : kmoe::load_sentencepiece(sp_model);
  if (!sp_model.empty()) kmoe::check_vocab_fits(tok->pieces(), dtype, sp_model);
  const std::int64_t vocab = kmoe::round_up_vocab(tok->pieces());

  kmoe::CorpusWriter writer(out_dir, dtype, val_every);
  auto add_doc = [&](std::string_view d) {
    if (sp_model.empty()) return writer.add_document(d);
    std::vector<std::int32_t> ids = tok->encode(d);
    ids.push_back(tok->end_of_document());
    writer.add_ids(ids);
  };
  if (!documents.empty()) {
    for (const std::string& d : documents) add_doc(d);
  } else {
    kmoe::DocumentSplitter splitter(sep, add_doc);
    ProgressBar progress(total_bytes);
    for (const std::string& f : files) {
      kmoe::feed_text_file(f, splitter, [&progress](std::int64_t n) { progress.advance(n); });
    }
    progress.finish();
  }
  const kmoe::CorpusCounts c = writer.finish();

  std::cout << "kmoe-prep: " << files.size() << " files, " << total_bytes << " bytes\n"
            << "  documents: train " << c.documents_train << ", val " << c.documents_val << "\n"
            << "  tokens:    train " << c.tokens_train << ", val " << c.tokens_val << "\n"
            << "  tokenizer: " << tok->describe() << "\n"
            << "  vocab_size " << vocab << " (model.vocab_size), dtype " << dtype << "\n";
  if (!sp_model.empty()) {
    std::cout << "  deck: [data] tokenizer = sentencepiece, tokenizer_model = "
              << fs::absolute(sp_model).string() << ", eod_id = " << tok->end_of_document()
              << ", dtype = " << dtype << "\n";
    if (tok->unknown_bytes() > 0)
      std::cout << "  note: " << tok->unknown_bytes()
                << " bytes were not UTF-8 and the model has no byte pieces: they became its "
                   "unknown id\n";
  }
  std::cout << "  wrote " << writer.train_path();
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
