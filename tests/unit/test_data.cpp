// Token data (io/token_data) and kmoe-prep's text pipeline (io/text_corpus), on files written by
// hand into a fresh temporary directory.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "io/text_corpus.hpp"
#include "io/tokenizer.hpp"
#include "io/token_data.hpp"

namespace kmoe {
namespace {

namespace fs = std::filesystem;

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "kmoe-test-data-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  std::string write_bytes(const std::string& name, const std::string& bytes) const {
    std::ofstream(path(name), std::ios::binary) << bytes;
    return path(name);
  }

  // Little-endian by construction, whatever the host.
  static std::string le_bytes(const std::vector<std::uint32_t>& ids, int elem_size) {
    std::string s;
    for (std::uint32_t id : ids) {
      for (int b = 0; b < elem_size; ++b) s.push_back(static_cast<char>((id >> (8 * b)) & 0xFF));
    }
    return s;
  }

  static std::vector<std::uint32_t> range(std::uint32_t first, std::uint32_t n) {
    std::vector<std::uint32_t> v(n);
    std::iota(v.begin(), v.end(), first);
    return v;
  }

  static std::vector<std::int32_t> instance(const TokenDataset& d, std::int64_t i) {
    std::vector<std::int32_t> out(static_cast<std::size_t>(d.seq_len()));
    d.read_instance(i, out.data());
    return out;
  }

  static std::string npy_v1(const std::string& descr, std::size_t n, const std::string& data) {
    std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" +
                       std::to_string(n) + ",), }";
    while ((10 + dict.size() + 1) % 64 != 0) dict.push_back(' ');
    dict.push_back('\n');
    std::string h = "\x93NUMPY";
    h += std::string{'\x01', '\x00'};
    h.push_back(static_cast<char>(dict.size() & 0xFF));
    h.push_back(static_cast<char>(dict.size() >> 8));
    return h + dict + data;
  }

  // The message of the kmoe::Error that `f` throws ("" if none).
  template <class F>
  static std::string error_of(F f) {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  std::string dir_;
};

using V = std::vector<std::int32_t>;

TEST_F(DataTest, ReadsUint16LittleEndian) {
  const std::string f = write_bytes("a.bin", le_bytes({1, 258, 3, 300, 5, 6, 7, 8}, 2));
  TokenDataset d({f}, "uint16", 4, 320, "data.paths");
  ASSERT_EQ(d.num_instances(), 2);
  EXPECT_EQ(d.files().at(0).n_tokens, 8);
  EXPECT_EQ(instance(d, 0), (V{1, 258, 3, 300}));
  EXPECT_EQ(instance(d, 1), (V{5, 6, 7, 8}));
}

TEST_F(DataTest, ReadsUint32LittleEndian) {
  const std::string f = write_bytes("a.bin", le_bytes({70000, 1, 0x01020304, 2}, 4));
  TokenDataset d({f}, "uint32", 2, 0x02000000, "data.paths");
  ASSERT_EQ(d.num_instances(), 2);
  EXPECT_EQ(instance(d, 0), (V{70000, 1}));
  EXPECT_EQ(instance(d, 1), (V{0x01020304, 2}));
}

TEST_F(DataTest, ReadsNpyV1AfterItsHeader) {
  const std::string f = write_bytes("a.npy", npy_v1("<u2", 6, le_bytes(range(10, 6), 2)));
  TokenDataset d({f}, "uint16", 3, 320, "data.paths");
  ASSERT_EQ(d.files().at(0).n_tokens, 6);
  EXPECT_EQ(instance(d, 0), (V{10, 11, 12}));
  EXPECT_EQ(instance(d, 1), (V{13, 14, 15}));
}

TEST_F(DataTest, ReadsNpyV2WithFourByteHeaderLength) {
  const std::string dict = "{'descr': '<u4', 'fortran_order': False, 'shape': (4,), }\n";
  std::string bytes = std::string("\x93NUMPY") + std::string{'\x02', '\x00'};
  bytes += le_bytes({static_cast<std::uint32_t>(dict.size())}, 4) + dict;
  const std::string f = write_bytes("a.npy", bytes + le_bytes({7, 8, 9, 100000}, 4));
  TokenDataset d({f}, "uint32", 4, 200000, "data.paths");
  EXPECT_EQ(instance(d, 0), (V{7, 8, 9, 100000}));
}

TEST_F(DataTest, InstancesStayInsideFilesAndDropRemainders) {
  const std::string a = write_bytes("a.bin", le_bytes(range(0, 10), 2));
  const std::string e = write_bytes("empty.bin", "");
  const std::string b = write_bytes("b.bin", le_bytes(range(100, 7), 2));
  TokenDataset d({a, e, b}, "uint16", 4, 320, "data.paths");
  ASSERT_EQ(d.files().size(), 3u);
  EXPECT_EQ(d.files()[1].n_tokens, 0);
  ASSERT_EQ(d.num_instances(), 3);  // 10 -> 2 (+2 dropped), 0 -> 0, 7 -> 1 (+3 dropped)
  EXPECT_EQ(instance(d, 0), (V{0, 1, 2, 3}));
  EXPECT_EQ(instance(d, 1), (V{4, 5, 6, 7}));
  EXPECT_EQ(instance(d, 2), (V{100, 101, 102, 103}));
}

TEST_F(DataTest, GlobsExpandSortedByNameAndListsKeepTheirOrder) {
  write_bytes("b.bin", le_bytes({2, 2}, 2));
  write_bytes("a.bin", le_bytes({1, 1}, 2));
  write_bytes("c.txt", le_bytes({9, 9}, 2));
  const std::string c = path("c.txt");
  TokenDataset d({c, path("*.bin")}, "uint16", 2, 320, "data.paths");
  ASSERT_EQ(d.num_instances(), 3);
  EXPECT_EQ(instance(d, 0), (V{9, 9}));
  EXPECT_EQ(instance(d, 1), (V{1, 1}));
  EXPECT_EQ(instance(d, 2), (V{2, 2}));
}

TEST_F(DataTest, MissingFileAndEmptyGlobAreErrors) {
  const std::string missing = path("nope.bin");
  std::string msg = error_of([&] { TokenDataset({missing}, "uint16", 4, 320, "data.paths"); });
  EXPECT_NE(msg.find("data.paths"), std::string::npos) << msg;
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;

  const std::string pattern = path("*.bin");
  msg = error_of([&] { TokenDataset({pattern}, "uint16", 4, 320, "data.val_paths"); });
  EXPECT_NE(msg.find("data.val_paths"), std::string::npos) << msg;
  EXPECT_NE(msg.find(pattern), std::string::npos) << msg;
  EXPECT_NE(msg.find("matches no files"), std::string::npos) << msg;
}

TEST_F(DataTest, SizeNotAMultipleOfTheDtypeIsAnError) {
  const std::string f = write_bytes("odd.bin", std::string(7, '\0'));
  const std::string msg = error_of([&] { TokenDataset({f}, "uint16", 2, 320, "data.paths"); });
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("7 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("uint16"), std::string::npos) << msg;

  const std::string g = write_bytes("six.bin", std::string(6, '\0'));
  EXPECT_NE(error_of([&] { TokenDataset({g}, "uint32", 1, 320, "data.paths"); }).find("uint32"),
            std::string::npos);
}

TEST_F(DataTest, NpyHeaderMismatchesAreErrors) {
  const std::string f = write_bytes("a.npy", npy_v1("<u4", 2, le_bytes({1, 2}, 4)));
  std::string msg = error_of([&] { TokenDataset({f}, "uint16", 2, 320, "data.paths"); });
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("'<u4'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("uint16"), std::string::npos) << msg;

  const std::string g = write_bytes("b.npy", npy_v1("<i2", 2, le_bytes({1, 2}, 2)));
  msg = error_of([&] { TokenDataset({g}, "uint16", 2, 320, "data.paths"); });
  EXPECT_NE(msg.find("'<i2'"), std::string::npos) << msg;

  std::string fortran = npy_v1("<u2", 2, le_bytes({1, 2}, 2));
  fortran.replace(fortran.find("False"), 5, "True ");
  const std::string h = write_bytes("c.npy", fortran);
  msg = error_of([&] { TokenDataset({h}, "uint16", 2, 320, "data.paths"); });
  EXPECT_NE(msg.find("fortran_order"), std::string::npos) << msg;

  const std::string short_data = write_bytes("d.npy", npy_v1("<u2", 3, le_bytes({1, 2}, 2)));
  msg = error_of([&] { TokenDataset({short_data}, "uint16", 2, 320, "data.paths"); });
  EXPECT_NE(msg.find("shape"), std::string::npos) << msg;
}

TEST_F(DataTest, TokenIdAtLeastVocabSizeNamesFileAndOffset) {
  const std::string a = write_bytes("a.bin", le_bytes({1, 2, 3, 4}, 4));
  const std::string b = write_bytes("b.bin", le_bytes({1, 2, 3, 4, 5, 70000, 7, 8}, 4));
  TokenDataset d({a, b}, "uint32", 4, 320, "data.paths");
  ASSERT_EQ(d.num_instances(), 3);
  EXPECT_EQ(instance(d, 1), (V{1, 2, 3, 4}));
  const std::string msg = error_of([&] { instance(d, 2); });
  EXPECT_EQ(msg, "data.paths: token id 70000 >= model.vocab_size 320 in file " + b +
                     " at token offset 5");
}

TEST_F(DataTest, ZeroInstancesIsAnError) {
  const std::string a = write_bytes("a.bin", le_bytes({1, 2, 3}, 2));
  const std::string b = write_bytes("b.bin", "");
  const std::string msg = error_of([&] { TokenDataset({a, b}, "uint16", 4, 320, "data.paths"); });
  EXPECT_NE(msg.find("data.paths"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shorter than train.seq_len = 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find(a + " (3 tokens)"), std::string::npos) << msg;
  EXPECT_NE(msg.find(b + " (0 tokens)"), std::string::npos) << msg;
}

TEST_F(DataTest, UnknownDtypeIsAnError) {
  const std::string a = write_bytes("a.bin", le_bytes({1, 2}, 2));
  const std::string msg = error_of([&] { TokenDataset({a}, "int8", 2, 320, "data.paths"); });
  EXPECT_NE(msg.find("data.dtype"), std::string::npos) << msg;
}

TEST(EpochPermutation, IsAPermutationForEverySize) {
  for (std::int64_t n : {0, 1, 2, 3, 7, 64, 1000}) {
    std::vector<std::int64_t> p = epoch_permutation(n, 1234, 5);
    ASSERT_EQ(static_cast<std::int64_t>(p.size()), n);
    std::sort(p.begin(), p.end());
    for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(p[static_cast<std::size_t>(i)], i);
  }
}

TEST(EpochPermutation, DependsOnSeedAndEpochOnly) {
  const auto p = epoch_permutation(1000, 42, 3);
  epoch_permutation(77, 9, 1);  // no hidden state carried between calls
  EXPECT_EQ(epoch_permutation(1000, 42, 3), p);
  EXPECT_NE(epoch_permutation(1000, 42, 4), p);
  EXPECT_NE(epoch_permutation(1000, 43, 3), p);
  EXPECT_NE(epoch_permutation(1000, 42, 0), epoch_permutation(1000, 42, 1));
}

// Reimplements the algorithm documented in token_data.cpp, so the comment stays true.
TEST(EpochPermutation, MatchesTheDocumentedAlgorithm) {
  const std::uint64_t seed = 0xDEADBEEF;
  const std::int64_t epoch = 2, n = 50;
  const std::uint64_t key = splitmix64(seed ^ splitmix64(epoch + 0x6B6D6F6544415441ull));
  std::vector<std::int64_t> expect(n);
  std::iota(expect.begin(), expect.end(), 0);
  std::uint64_t k = 0;
  for (std::int64_t i = n - 1; i >= 1; --i) {
    std::swap(expect[i], expect[splitmix64(key + k++) % std::uint64_t(i + 1)]);
  }
  EXPECT_EQ(epoch_permutation(n, seed, epoch), expect);
}

TEST(InstanceStream, ConcatenatesEpochPermutations) {
  const std::int64_t n = 7;
  const std::uint64_t seed = 11;
  InstanceStream stream(n, seed);
  std::vector<std::int64_t> expect;
  for (std::int64_t e = 0; e < 3; ++e) {
    const auto p = epoch_permutation(n, seed, e);
    expect.insert(expect.end(), p.begin(), p.end());
  }
  for (std::int64_t pos = 4; pos < 3 * n; ++pos) {  // starts mid-epoch, as a resumed run does
    EXPECT_EQ(stream.instance_at(pos), expect[pos]) << "position " << pos;
  }
  EXPECT_EQ(stream.instance_at(2), expect[2]);  // going back recomputes the earlier epoch
  InstanceStream fresh(n, seed);
  EXPECT_EQ(fresh.instance_at(n + 3), expect[n + 3]);
}

// The byte-level tokenizer: bytes both ways (not UTF-8 included); a vocabulary too large for
// the token dtype is an error naming the model and the dtype.
TEST(Tokenizer, BytesBothWaysAndVocabularyFits) {
  auto tok = byte_tokenizer();
  const std::string text = "caf\xc3\xa9 \xff\xfe end\n";
  std::vector<std::int32_t> ids = tok->encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[6], 0xff);
  ids.push_back(tok->end_of_document());
  EXPECT_EQ(tok->decode(ids), text);
  EXPECT_EQ(tok->pieces(), 257);
  EXPECT_NO_THROW(check_vocab_fits(65536, "uint16", "m.model"));
  EXPECT_NO_THROW(check_vocab_fits(70000, "uint32", "m.model"));
  try {
    check_vocab_fits(65537, "uint16", "big.model");
    ADD_FAILURE() << "65537 ids fit uint16";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("big.model"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("uint32"), std::string::npos) << e.what();
  }
  DataCfg external;
  external.tokenizer = Tokenizer::External;
  EXPECT_THROW(deck_tokenizer(external), Error);
}

TEST(TextCorpus, SplitsAtSeparatorLinesAndSkipsBlankDocuments) {
  const std::string text = "a\n%\n  \n\t\n%\nb\n%%\n %\nc\n%\r\n%\n\nd";
  const auto docs = split_documents(text, std::string("%"));
  EXPECT_EQ(docs, (std::vector<std::string>{"a\n", "b\n%%\n %\nc\n", "\nd"}));
  EXPECT_EQ(split_documents(text, std::nullopt), std::vector<std::string>{text});
  EXPECT_TRUE(split_documents(" \n\n\t", std::nullopt).empty());
  EXPECT_TRUE(split_documents("%\n%\n", std::string("%")).empty());
}

TEST(TextCorpus, SplitterHandlesLinesCutAcrossChunksAndFileEnds) {
  std::vector<std::string> docs;
  DocumentSplitter s(std::string("%"), [&](std::string_view d) { docs.emplace_back(d); });
  for (const char* chunk : {"fir", "st\n", "%", "\nsec", "ond"}) s.feed(chunk);
  s.end_input();  // the file's end ends "second" without a newline
  s.feed("%\nthird\n");
  s.end_input();
  EXPECT_EQ(docs, (std::vector<std::string>{"first\n", "second", "third\n"}));
}

TEST(TextCorpus, ByteTokenizerAppendsEndOfDocument) {
  EXPECT_EQ(kByteVocabSize, 320);
  EXPECT_EQ(byte_tokenize_document("hi"), (V{104, 105, 256}));
  EXPECT_EQ(byte_tokenize_document("\xC3\xA9"), (V{0xC3, 0xA9, 256}));  // UTF-8 bytes, not < 0
  EXPECT_EQ(byte_tokenize_document(""), (V{256}));
}

TEST_F(DataTest, CorpusWriterSendsEveryNthDocumentToValidation) {
  const std::string out = path("out");
  CorpusWriter w(out, "uint16", 20);
  for (int i = 0; i < 45; ++i) w.add_document("doc " + std::to_string(i) + "\n");
  const CorpusCounts c = w.finish();
  EXPECT_EQ(c.documents_val, 2);  // 0-based documents 19 and 39
  EXPECT_EQ(c.documents_train, 43);
  EXPECT_EQ(c.tokens_val, 2 * 8);

  std::vector<std::uint32_t> want;
  for (int i : {19, 39}) {
    for (unsigned char ch : "doc " + std::to_string(i) + "\n") want.push_back(ch);
    want.push_back(256);
  }
  std::ifstream in(path("out/val.bin"), std::ios::binary);
  const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, le_bytes(want, 2));
  EXPECT_FALSE(fs::exists(path("out/val.bin.partial")));

  // What kmoe-prep writes, TokenDataset reads back with the byte vocabulary.
  TokenDataset d({path("out/train.bin")}, "uint16", 7, kByteVocabSize, "data.paths");
  EXPECT_EQ(d.files()[0].n_tokens, c.tokens_train);
  EXPECT_EQ(instance(d, 0), (V{'d', 'o', 'c', ' ', '0', '\n', 256}));
}

TEST_F(DataTest, CorpusWriterWithoutValidationAndInUint32) {
  {
    CorpusWriter w(path("o"), "uint32", 0);
    w.add_document("x");
    w.add_document("yz");
    EXPECT_EQ(w.finish().tokens_train, 5);
  }
  EXPECT_FALSE(fs::exists(path("o/val.bin")));
  EXPECT_EQ(fs::file_size(path("o/train.bin")), 5u * 4u);
}

TEST_F(DataTest, CorpusWithoutValidationRemovesAnEarlierCorpussValBin) {
  {
    CorpusWriter w(path("o"), "uint16", 2);
    for (const char* d : {"a", "b", "c", "d"}) w.add_document(d);
    EXPECT_FALSE(w.finish().removed_stale_val);
  }
  ASSERT_TRUE(fs::exists(path("o/val.bin")));
  {
    CorpusWriter w(path("o"), "uint16", 0);
    w.add_document("x");
    EXPECT_TRUE(w.finish().removed_stale_val);
  }
  EXPECT_FALSE(fs::exists(path("o/val.bin")));  // it belonged to the other train.bin
}

// A token file cut short while a run reads it (another job rewriting the corpus): the read
// names the file and both sizes instead of dying of SIGBUS as a memory mapping would.
TEST_F(DataTest, AFileTruncatedAfterOpeningIsAClearError) {
  const std::string a = write_bytes("a.bin", le_bytes({1, 2, 3, 4, 5, 6, 7, 8}, 2));
  TokenDataset d({a}, "uint16", 4, 320, "data.paths");
  ASSERT_EQ(d.num_instances(), 2);
  EXPECT_EQ(instance(d, 1), (V{5, 6, 7, 8}));
  fs::resize_file(a, 10);
  EXPECT_EQ(instance(d, 0), (V{1, 2, 3, 4}));  // still there
  const std::string msg = error_of([&] { instance(d, 1); });
  EXPECT_NE(msg.find("data.paths: file " + a), std::string::npos) << msg;
  EXPECT_NE(msg.find("the file has 10 bytes, 16 when the run opened it"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST_F(DataTest, CorpusWriterWithoutDocumentsFailsAndLeavesNoFiles) {
  {
    CorpusWriter w(path("o"), "uint16", 20);
    EXPECT_NE(error_of([&] { w.finish(); }).find("no documents"), std::string::npos);
  }
  EXPECT_TRUE(fs::is_empty(path("o")));
  EXPECT_NE(error_of([&] { CorpusWriter(path("p"), "int8", 20); }).find("int8"), std::string::npos);
}

}  // namespace
}  // namespace kmoe
