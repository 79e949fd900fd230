#include "io/text_corpus.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "core/error.hpp"

namespace kmoe {
namespace {

constexpr std::size_t kReadBlockBytes = 1 << 20;
constexpr std::size_t kWriteBufferBytes = 1 << 20;

bool is_blank(std::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](unsigned char c) { return std::isspace(c) != 0; });
}

}  // namespace

std::vector<std::int32_t> byte_tokenize_document(std::string_view document) {
  std::vector<std::int32_t> ids;
  ids.reserve(document.size() + 1);
  // Through unsigned char: plain char is signed on x86, and bytes >= 0x80 (UTF-8) must map to
  // 128..255, not to negative ids.
  for (unsigned char c : document) ids.push_back(c);
  ids.push_back(kByteEndOfDocument);
  return ids;
}

DocumentSplitter::DocumentSplitter(std::optional<std::string> separator, Sink sink)
    : separator_(std::move(separator)), sink_(std::move(sink)) {}

void DocumentSplitter::feed(std::string_view chunk) {
  while (!chunk.empty()) {
    const std::size_t nl = chunk.find('\n');
    if (nl == std::string_view::npos) {
      line_.append(chunk);
      return;
    }
    if (line_.empty()) {
      take_line(chunk.substr(0, nl), true);
    } else {
      line_.append(chunk.substr(0, nl));
      take_line(line_, true);
      line_.clear();
    }
    chunk.remove_prefix(nl + 1);
  }
}

void DocumentSplitter::end_input() {
  if (!line_.empty()) {
    take_line(line_, false);
    line_.clear();
  }
  emit_document();
}

void DocumentSplitter::take_line(std::string_view line, bool has_newline) {
  if (separator_) {
    std::string_view bare = line;
    if (!bare.empty() && bare.back() == '\r') bare.remove_suffix(1);
    if (bare == *separator_) {
      emit_document();
      return;
    }
  }
  document_.append(line);
  if (has_newline) document_.push_back('\n');
}

void DocumentSplitter::emit_document() {
  if (!is_blank(document_)) sink_(document_);
  document_.clear();
}

std::vector<std::string> split_documents(std::string_view text,
                                         const std::optional<std::string>& separator) {
  std::vector<std::string> docs;
  DocumentSplitter splitter(separator, [&docs](std::string_view d) { docs.emplace_back(d); });
  splitter.feed(text);
  splitter.end_input();
  return docs;
}

void feed_text_file(const std::string& path, DocumentSplitter& splitter,
                    const std::function<void(std::int64_t)>& on_bytes) {
  std::ifstream in(path, std::ios::binary);
  KMOE_REQUIRE(in, "cannot open " << path << " (" << std::strerror(errno) << ")");
  std::vector<char> block(kReadBlockBytes);
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    const std::streamsize got = in.gcount();
    if (got <= 0) break;
    splitter.feed(std::string_view(block.data(), static_cast<std::size_t>(got)));
    if (on_bytes) on_bytes(got);
  }
  KMOE_REQUIRE(in.eof() && !in.bad(), "error reading " << path);
  splitter.end_input();
}

TokenFileWriter::TokenFileWriter(std::string path, const std::string& dtype)
    : path_(std::move(path)), partial_path_(path_ + ".partial") {
  KMOE_REQUIRE(dtype == "uint16" || dtype == "uint32",
               "dtype must be uint16 or uint32, got '" << dtype << "'");
  elem_size_ = dtype == "uint16" ? 2 : 4;
  max_id_ = dtype == "uint16" ? 0xFFFFu : 0xFFFFFFFFu;
  out_.open(partial_path_, std::ios::binary | std::ios::trunc);
  KMOE_REQUIRE(out_, "cannot create " << partial_path_ << " (" << std::strerror(errno) << ")");
  buffer_.reserve(kWriteBufferBytes + 4);
}

TokenFileWriter::~TokenFileWriter() {
  if (committed_) return;
  out_.close();
  std::error_code ignored;
  std::filesystem::remove(partial_path_, ignored);
}

void TokenFileWriter::append(const std::vector<std::int32_t>& ids) {
  KMOE_REQUIRE(!committed_, "append to " << path_ << " after commit");
  for (const std::int32_t id : ids) {
    const auto u = static_cast<std::uint32_t>(id);
    KMOE_REQUIRE(id >= 0 && u <= max_id_,
                 "token id " << id << " does not fit the dtype of " << path_);
    buffer_.push_back(static_cast<unsigned char>(u));
    buffer_.push_back(static_cast<unsigned char>(u >> 8));
    if (elem_size_ == 4) {
      buffer_.push_back(static_cast<unsigned char>(u >> 16));
      buffer_.push_back(static_cast<unsigned char>(u >> 24));
    }
    if (buffer_.size() >= kWriteBufferBytes) flush_buffer();
  }
  tokens_ += static_cast<std::int64_t>(ids.size());
}

void TokenFileWriter::flush_buffer() {
  out_.write(reinterpret_cast<const char*>(buffer_.data()),
             static_cast<std::streamsize>(buffer_.size()));
  KMOE_REQUIRE(out_, "error writing " << partial_path_ << " (" << std::strerror(errno) << ")");
  buffer_.clear();
}

void TokenFileWriter::commit() {
  if (committed_) return;
  flush_buffer();
  out_.close();
  KMOE_REQUIRE(!out_.fail(), "error closing " << partial_path_);
  std::error_code ec;
  std::filesystem::rename(partial_path_, path_, ec);
  KMOE_REQUIRE(!ec, "cannot rename " << partial_path_ << " to " << path_ << ": " << ec.message());
  committed_ = true;
}

CorpusWriter::CorpusWriter(const std::string& out_dir, const std::string& dtype,
                           std::int64_t val_every)
    : out_dir_(out_dir), val_every_(val_every) {
  KMOE_REQUIRE(val_every >= 0, "val_every must be >= 0, got " << val_every);
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  KMOE_REQUIRE(!ec, "cannot create directory " << out_dir << ": " << ec.message());
  train_.emplace(train_path(), dtype);
  if (val_every_ > 0) val_.emplace(val_path(), dtype);
}

std::string CorpusWriter::train_path() const {
  return (std::filesystem::path(out_dir_) / "train.bin").string();
}

std::string CorpusWriter::val_path() const {
  if (val_every_ == 0) return {};
  return (std::filesystem::path(out_dir_) / "val.bin").string();
}

void CorpusWriter::add_document(std::string_view document) {
  add_ids(byte_tokenize_document(document));
}

void CorpusWriter::add_ids(const std::vector<std::int32_t>& ids) {
  const std::int64_t index = counts_.documents_train + counts_.documents_val;
  const auto n = static_cast<std::int64_t>(ids.size());
  if (val_every_ > 0 && index % val_every_ == val_every_ - 1) {
    val_->append(ids);
    counts_.documents_val += 1;
    counts_.tokens_val += n;
  } else {
    train_->append(ids);
    counts_.documents_train += 1;
    counts_.tokens_train += n;
  }
}

CorpusCounts CorpusWriter::finish() {
  KMOE_REQUIRE(counts_.documents_train + counts_.documents_val > 0,
               "no documents found in the input (only empty or whitespace text)");
  KMOE_REQUIRE(counts_.documents_train > 0, "no documents left for train.bin: all "
                                                << counts_.documents_val
                                                << " went to validation (val_every " << val_every_
                                                << ")");
  train_->commit();
  if (val_) {
    val_->commit();
  } else {
    const std::filesystem::path stale = std::filesystem::path(out_dir_) / "val.bin";
    std::error_code ec;
    if (std::filesystem::exists(stale, ec)) {
      std::filesystem::remove(stale, ec);
      KMOE_REQUIRE(!ec, "cannot remove " << stale.string() << ", the validation file of an "
                                         << "earlier corpus: " << ec.message());
      counts_.removed_stale_val = true;
    }
  }
  return counts_;
}

}  // namespace kmoe
