// Text to token ids and back (data.tokenizer, RUNTIME.md section 3): kmoe's byte-level ids or a
// SentencePiece model (Debian's libsentencepiece). kmoe-prep encodes corpora with it,
// kmoe-generate encodes prompts and decodes samples with the tokenizer the checkpoint's deck names.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.hpp"

namespace kmoe {

class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;
  // A document's text as ids, without the end-of-document id. Bytes that are not UTF-8 keep
  // their value: the byte tokenizer's ids are bytes; a SentencePiece model with byte fallback
  // (what kmoe-prep --train-sentencepiece builds) gives each its <0xNN> piece (and the three
  // bytes of U+2581, its sign for a space, too), a model without gives its unknown id and
  // counts it (unknown_bytes()).
  virtual std::vector<std::int32_t> encode(std::string_view text) = 0;
  // Ids to text: byte pieces become their bytes, the end-of-document id and ids outside the
  // tokenizer's pieces (padding of the vocabulary) are left out.
  virtual std::string decode(const std::vector<std::int32_t>& ids) const = 0;
  // The ids it produces are in [0, pieces()); model.vocab_size must be at least that.
  virtual std::int64_t pieces() const = 0;
  virtual std::int32_t end_of_document() const = 0;
  // Bytes that were not UTF-8 and had no byte piece, over every encode() so far.
  virtual std::int64_t unknown_bytes() const { return 0; }
  virtual std::string describe() const = 0;
};

// kmoe's byte-level ids: byte b is id b, 256 ends a document.
std::unique_ptr<TextTokenizer> byte_tokenizer();

// Whether this build can read SentencePiece models (KMOE_ENABLE_SENTENCEPIECE).
bool have_sentencepiece();

// A SentencePiece model file (*.model); a missing, unreadable or corrupt file, or a model
// without an end-of-document (eos) piece, is an error naming the file.
std::unique_ptr<TextTokenizer> load_sentencepiece(const std::string& path);

// Trains a SentencePiece model of about `vocab` pieces (unigram; byte fallback; no
// normalization, no dummy prefix, whitespace kept, so that decode(encode(text)) == text; unknown
// id 0, end of document 1) on the lines of `documents` and writes it to `model_path`. Errors
// name the vocabulary size or the file.
void train_sentencepiece(const std::vector<std::string>& documents, int vocab,
                         const std::string& model_path);

// The tokenizer a deck names (data.tokenizer, data.tokenizer_model); external ids have none
// (an error naming data.tokenizer).
std::unique_ptr<TextTokenizer> deck_tokenizer(const DataCfg& data);

// Before a run trains on a deck's ids: with data.tokenizer = sentencepiece, its
// data.tokenizer_model loads (where this build reads SentencePiece; elsewhere the file must at
// least open) and its pieces fit model.vocab_size. Errors name the key and the file: the
// checkpoints will name the model, and kmoe-generate and kmoe-export read it.
void check_deck_tokenizer(const DataCfg& data, int vocab_size);

// The largest id a token dtype ("uint16" | "uint32") holds; a vocabulary of `pieces` ids that
// does not fit is an error naming `what` (the model file) and the dtype.
void check_vocab_fits(std::int64_t pieces, const std::string& dtype, const std::string& what);

}  // namespace kmoe
