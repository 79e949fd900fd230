#include "io/tokenizer.hpp"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "io/text_corpus.hpp"

#if defined(KMOE_HAVE_SENTENCEPIECE)
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unordered_map>
#endif

namespace kmoe {

namespace {

// The length of the UTF-8 character at s[i] (1-4), or 0 when the bytes there are not one
// (overlong forms, surrogates and values above U+10FFFF included).
std::size_t utf8_char(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const std::size_t left = s.size() - i;
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  auto cont = [&](std::size_t k) { return k < left && (b(k) & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    if (c == 0xE0 && b(1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(1) >= 0xA0) return 0;  // surrogates
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(1) >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

class ByteTokenizer : public TextTokenizer {
 public:
  std::vector<std::int32_t> encode(std::string_view text) override {
    std::vector<std::int32_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<std::int32_t>& ids) const override {
    std::string s;
    for (std::int32_t id : ids)
      if (id >= 0 && id < 256) s += static_cast<char>(id);
    return s;
  }
  std::int64_t pieces() const override { return kByteEndOfDocument + 1; }
  std::int32_t end_of_document() const override { return kByteEndOfDocument; }
  std::string describe() const override { return "byte-level (256 bytes, 256 ends a document)"; }
};

#if defined(KMOE_HAVE_SENTENCEPIECE)
class SentencePieceTokenizer : public TextTokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    std::ifstream probe(path, std::ios::binary);
    KMOE_REQUIRE(probe.good(), path << ": cannot open the SentencePiece model");
    const auto st = sp_.Load(path);
    KMOE_REQUIRE(st.ok(), path << ": not a SentencePiece model (" << st.ToString() << ")");
    KMOE_REQUIRE(sp_.GetPieceSize() > 0, path << ": a SentencePiece model without pieces");
    KMOE_REQUIRE(sp_.eos_id() >= 0,
                 path << ": the SentencePiece model has no end-of-sentence piece (eos_id = -1); "
                         "kmoe ends every document with it");
    for (int b = 0; b < 256; ++b) {
      char piece[8];
      std::snprintf(piece, sizeof piece, "<0x%02X>", b);
      const int id = sp_.PieceToId(piece);
      byte_id_[b] = sp_.IsByte(id) ? id : -1;
    }
  }

  std::vector<std::int32_t> encode(std::string_view text) override {
    std::vector<std::int32_t> out;
    std::size_t run = 0;  // start of the current valid UTF-8 run
    auto flush = [&](std::size_t end) {
      if (end == run) return;
      std::vector<int> ids;
      const auto st = sp_.Encode(text.substr(run, end - run), &ids);
      KMOE_REQUIRE(st.ok(), path_ << ": encoding failed (" << st.ToString() << ")");
      out.insert(out.end(), ids.begin(), ids.end());
    };
    for (std::size_t i = 0; i < text.size();) {
      const std::size_t n = utf8_char(text, i);
      // U+2581, SentencePiece's sign for a space, would come back as a space: with byte
      // pieces it goes as its three bytes.
      const bool space_sign = n == 3 && byte_id_[0] >= 0 && text.compare(i, 3, "\xE2\x96\x81") == 0;
      if (space_sign) {
        flush(i);
        for (int k = 0; k < 3; ++k) out.push_back(byte_id_[static_cast<unsigned char>(text[i + k])]);
        run = i += 3;
        continue;
      }
      if (n > 0) {
        i += n;
        continue;
      }
      flush(i);
      const int b = static_cast<unsigned char>(text[i]);
      if (byte_id_[b] >= 0) {
        out.push_back(byte_id_[b]);
      } else {
        out.push_back(sp_.unk_id());
        ++unknown_bytes_;
      }
      run = ++i;
    }
    flush(text.size());
    return out;
  }

  std::string decode(const std::vector<std::int32_t>& ids) const override {
    // SentencePiece decodes the runs of other pieces; byte pieces become their bytes as they
    // are (SentencePiece would write U+FFFD for bytes that are not UTF-8).
    std::string text;
    std::vector<int> run;
    auto flush_run = [&] {
      if (run.empty()) return;
      std::string s;
      const auto st = sp_.Decode(run, &s);
      KMOE_REQUIRE(st.ok(), path_ << ": decoding failed (" << st.ToString() << ")");
      text += s;
      run.clear();
    };
    const int n = sp_.GetPieceSize();
    for (std::int32_t id : ids) {
      if (id < 0 || id >= n || id == sp_.eos_id()) continue;
      if (sp_.IsByte(id)) {
        flush_run();
        unsigned value = 0;
        std::sscanf(sp_.IdToPiece(id).c_str(), "<0x%02X>", &value);
        text += static_cast<char>(value);
      } else {
        run.push_back(id);
      }
    }
    flush_run();
    return text;
  }

  std::int64_t pieces() const override { return sp_.GetPieceSize(); }
  std::int32_t end_of_document() const override { return sp_.eos_id(); }
  std::int64_t unknown_bytes() const override { return unknown_bytes_; }
  std::string describe() const override {
    std::ostringstream os;
    os << "SentencePiece " << path_ << " (" << sp_.GetPieceSize() << " pieces, end of document "
       << sp_.eos_id() << (byte_id_[0] >= 0 ? ", byte fallback" : "") << ")";
    return os.str();
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  int byte_id_[256];
  std::int64_t unknown_bytes_ = 0;
};

// Sentences for the trainer: every line of every document, the bytes that are not UTF-8 left
// out (byte fallback encodes them).
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& documents) : docs_(documents) { advance(); }
  bool done() const override { return doc_ >= docs_.size(); }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    while (doc_ < docs_.size()) {
      const std::string& d = docs_[doc_];
      if (pos_ >= d.size()) {
        ++doc_;
        pos_ = 0;
        continue;
      }
      std::size_t end = d.find('\n', pos_);
      if (end == std::string::npos) end = d.size();
      line_.clear();
      for (std::size_t i = pos_; i < end;) {
        const std::size_t n = utf8_char(std::string_view(d).substr(0, end), i);
        if (n > 0) line_.append(d, i, n);
        i += n > 0 ? n : 1;
      }
      pos_ = end + 1;
      if (!line_.empty()) return;
    }
  }
  const std::vector<std::string>& docs_;
  std::size_t doc_ = 0, pos_ = 0;
  std::string line_;
};
#endif

}  // namespace

std::unique_ptr<TextTokenizer> byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

#if defined(KMOE_HAVE_SENTENCEPIECE)
bool have_sentencepiece() { return true; }

std::unique_ptr<TextTokenizer> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

void train_sentencepiece(const std::vector<std::string>& documents, int vocab,
                         const std::string& model_path) {
  KMOE_REQUIRE(vocab >= 300, "--train-sentencepiece " << vocab
                                                      << ": at least 300 pieces (256 byte pieces, "
                                                         "the unknown and end-of-document pieces "
                                                         "and some of the text's)");
  LineIterator lines(documents);
  KMOE_REQUIRE(!lines.done(), "--train-sentencepiece: the corpus has no text to train on");
  const std::unordered_map<std::string, std::string> args = {
      {"vocab_size", std::to_string(vocab)},
      {"model_type", "unigram"},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"split_digits", "true"},
      {"character_coverage", "1.0"},
      {"unk_id", "0"},
      {"eos_id", "1"},
      {"bos_id", "-1"},
      {"pad_id", "-1"},
      {"hard_vocab_limit", "false"},
      {"minloglevel", "2"}};
  std::string proto;
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &proto);
  KMOE_REQUIRE(st.ok(), "--train-sentencepiece " << vocab << ": SentencePiece could not train ("
                                                 << st.ToString() << ")");
  std::ofstream out(model_path, std::ios::binary | std::ios::trunc);
  out.write(proto.data(), static_cast<std::streamsize>(proto.size()));
  out.close();
  KMOE_REQUIRE(out.good(), model_path << ": cannot write the SentencePiece model");
}
#else
bool have_sentencepiece() { return false; }

std::unique_ptr<TextTokenizer> load_sentencepiece(const std::string& path) {
  KMOE_FAIL(path << ": this kmoe was built without SentencePiece (install libsentencepiece-dev "
                    "and configure with -DKMOE_ENABLE_SENTENCEPIECE=ON)");
}

void train_sentencepiece(const std::vector<std::string>&, int, const std::string&) {
  KMOE_FAIL("--train-sentencepiece: this kmoe was built without SentencePiece (install "
            "libsentencepiece-dev and configure with -DKMOE_ENABLE_SENTENCEPIECE=ON)");
}
#endif

std::unique_ptr<TextTokenizer> deck_tokenizer(const DataCfg& data) {
  switch (data.tokenizer) {
    case Tokenizer::Bytes:
      return byte_tokenizer();
    case Tokenizer::SentencePiece:
      return load_sentencepiece(data.tokenizer_model);
    case Tokenizer::External:
      break;
  }
  KMOE_FAIL("data.tokenizer = external: the ids are another tool's, kmoe has no tokenizer for "
            "them (give token ids instead of text)");
}

void check_deck_tokenizer(const DataCfg& data, int vocab_size) {
  if (data.tokenizer != Tokenizer::SentencePiece) return;
  const std::string& path = data.tokenizer_model;
  if (!have_sentencepiece()) {
    std::ifstream in(path, std::ios::binary);
    KMOE_REQUIRE(in.good(), "data.tokenizer_model = " << path << ": cannot open");
    return;
  }
  std::unique_ptr<TextTokenizer> t;
  try {
    t = load_sentencepiece(path);
  } catch (const Error& e) {
    KMOE_FAIL("data.tokenizer_model = " << path << ": " << e.what());
  }
  KMOE_REQUIRE(t->pieces() <= vocab_size,
               "data.tokenizer_model = " << path << ": its " << t->pieces()
                                         << " pieces exceed model.vocab_size = " << vocab_size);
}

void check_vocab_fits(std::int64_t pieces, const std::string& dtype, const std::string& what) {
  const std::int64_t limit = dtype == "uint16" ? 65536 : std::int64_t(1) << 32;
  KMOE_REQUIRE(pieces <= limit, what << ": " << pieces << " ids do not fit --dtype " << dtype
                                     << " (at most " << limit << "); use --dtype uint32");
}

}  // namespace kmoe
