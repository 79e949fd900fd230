// Text to token files for kmoe-prep (RUNTIME.md section 3): documents split at separator lines,
// the byte-level tokenizer (ids 0..255 are bytes, 256 ends a document), and train/val token files
// in the headerless little-endian layout that TokenDataset reads.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kmoe {

constexpr std::int32_t kByteEndOfDocument = 256;

// Smallest multiple of `multiple` >= n_ids: vocabularies padded so embedding and output GEMMs
// get aligned sizes.
constexpr std::int64_t round_up_vocab(std::int64_t n_ids, std::int64_t multiple = 64) {
  return (n_ids + multiple - 1) / multiple * multiple;
}

// 257 ids padded to 320.
constexpr std::int64_t kByteVocabSize = round_up_vocab(kByteEndOfDocument + 1);

// A document's bytes as ids 0..255 followed by kByteEndOfDocument.
std::vector<std::int32_t> byte_tokenize_document(std::string_view document);

// Streams text into documents. A document is the text of its lines, each keeping its '\n'; a
// line holding exactly the separator (a trailing '\r' ignored, for CRLF files) ends the current
// document and belongs to none. Without a separator only end_input() ends a document. Documents
// that are empty or only whitespace are dropped before they reach the sink.
class DocumentSplitter {
 public:
  using Sink = std::function<void(std::string_view document)>;
  DocumentSplitter(std::optional<std::string> separator, Sink sink);

  void feed(std::string_view chunk);  // chunks may cut lines anywhere
  void end_input();                   // a file's end ends the current document

 private:
  void take_line(std::string_view line, bool has_newline);
  void emit_document();

  std::optional<std::string> separator_;
  Sink sink_;
  std::string line_;      // the unterminated tail of the last chunk
  std::string document_;  // lines of the current document so far
};

// Documents of a whole text, as DocumentSplitter would emit them.
std::vector<std::string> split_documents(std::string_view text,
                                         const std::optional<std::string>& separator);

// Feeds the file at `path` to `splitter` in blocks, calling on_bytes(n) after each block of n
// bytes, then ends the document. Throws kmoe::Error if the file cannot be read.
void feed_text_file(const std::string& path, DocumentSplitter& splitter,
                    const std::function<void(std::int64_t)>& on_bytes = {});

// Appends tokens to a headerless little-endian token file. Writes go to `path + ".partial"`,
// renamed onto `path` by commit(), so a failed run never leaves a plausible-looking token file.
class TokenFileWriter {
 public:
  TokenFileWriter(std::string path, const std::string& dtype);  // dtype: uint16 | uint32
  ~TokenFileWriter();  // removes the partial file unless committed
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  void append(const std::vector<std::int32_t>& ids);
  void commit();
  std::int64_t tokens() const { return tokens_; }

 private:
  void flush_buffer();

  std::string path_;
  std::string partial_path_;
  int elem_size_;
  std::uint32_t max_id_;
  std::ofstream out_;
  std::vector<unsigned char> buffer_;
  std::int64_t tokens_ = 0;
  bool committed_ = false;
};

struct CorpusCounts {
  std::int64_t documents_train = 0;
  std::int64_t documents_val = 0;
  std::int64_t tokens_train = 0;
  std::int64_t tokens_val = 0;
  // Without a validation split: an out_dir/val.bin of an earlier corpus was removed (it would
  // not belong to this train.bin).
  bool removed_stale_val = false;
};

// Byte-tokenizes documents into out_dir/train.bin and out_dir/val.bin (created as needed).
// Documents are numbered 0, 1, ... in arrival order; with val_every = N > 0 every N-th one
// (index % N == N - 1) goes to val.bin; with N = 0 there is no val.bin.
class CorpusWriter {
 public:
  CorpusWriter(const std::string& out_dir, const std::string& dtype, std::int64_t val_every);

  void add_document(std::string_view document);  // byte-level ids
  // A document another tokenizer encoded, its end-of-document id included.
  void add_ids(const std::vector<std::int32_t>& ids);
  // Commits the files; throws kmoe::Error (leaving no token files) if no document reached
  // train.bin. With val_every = 0 an existing out_dir/val.bin (another corpus's) is removed.
  CorpusCounts finish();

  const CorpusCounts& counts() const { return counts_; }
  std::string train_path() const;
  std::string val_path() const;  // empty when val_every == 0

 private:
  std::string out_dir_;
  std::int64_t val_every_;
  std::optional<TokenFileWriter> train_;
  std::optional<TokenFileWriter> val_;
  CorpusCounts counts_;
};

}  // namespace kmoe
