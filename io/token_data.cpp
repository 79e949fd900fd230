// Token files are read an instance at a time (pread), never whole: a corpus may be far larger
// than RAM, and each rank touches only the instances it is handed. Reads, unlike a memory
// mapping, report a file truncated under a running job as an error instead of a SIGBUS.
#include "io/token_data.hpp"

#include <fcntl.h>
#include <glob.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace kmoe {
namespace {

int dtype_bytes(const std::string& dtype) {
  if (dtype == "uint16") return 2;
  if (dtype == "uint32") return 4;
  KMOE_FAIL("data.dtype must be uint16 or uint32, got '" << dtype << "'");
}

bool has_glob_chars(const std::string& pattern) {
  return pattern.find_first_of("*?[") != std::string::npos;
}

// Byte-wise order, not glob's locale collation, so every rank and machine sees the same files.
std::vector<std::string> expand_pattern(const std::string& pattern, const std::string& key) {
  if (!has_glob_chars(pattern)) {
    struct stat st;
    KMOE_REQUIRE(::stat(pattern.c_str(), &st) == 0,
                 key << ": file not found: " << pattern << " (" << std::strerror(errno) << ")");
    return {pattern};
  }
  glob_t g;
  std::memset(&g, 0, sizeof(g));
  const int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
  std::vector<std::string> matches;
  if (rc == 0) matches.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  ::globfree(&g);
  KMOE_REQUIRE(rc != GLOB_NOMATCH, key << ": pattern '" << pattern << "' matches no files");
  KMOE_REQUIRE(rc == 0, key << ": glob('" << pattern << "') failed (code " << rc << ")");
  std::sort(matches.begin(), matches.end());
  return matches;
}

struct NpyHeader {
  std::string descr;
  bool fortran_order = true;
  std::vector<std::int64_t> shape;
};

// Position just after `'key':` in the header's Python dict literal, or npos.
std::size_t npy_value_pos(const std::string& header, const std::string& key) {
  for (const char quote : {'\'', '"'}) {
    const std::string quoted = quote + key + quote;
    std::size_t p = header.find(quoted);
    if (p == std::string::npos) continue;
    p = header.find_first_not_of(" ", p + quoted.size());
    if (p == std::string::npos || header[p] != ':') return std::string::npos;
    return header.find_first_not_of(" ", p + 1);
  }
  return std::string::npos;
}

NpyHeader parse_npy_dict(const std::string& header, const std::string& where) {
  NpyHeader h;
  std::size_t p = npy_value_pos(header, "descr");
  KMOE_REQUIRE(p != std::string::npos && (header[p] == '\'' || header[p] == '"'),
               where << ": malformed .npy header, no 'descr': " << header);
  const std::size_t end = header.find(header[p], p + 1);
  KMOE_REQUIRE(end != std::string::npos, where << ": malformed .npy header: " << header);
  h.descr = header.substr(p + 1, end - p - 1);

  p = npy_value_pos(header, "fortran_order");
  KMOE_REQUIRE(p != std::string::npos, where << ": malformed .npy header, no 'fortran_order'");
  KMOE_REQUIRE(header.compare(p, 5, "False") == 0 || header.compare(p, 4, "True") == 0,
               where << ": malformed .npy header, bad 'fortran_order': " << header);
  h.fortran_order = header.compare(p, 4, "True") == 0;

  p = npy_value_pos(header, "shape");
  KMOE_REQUIRE(p != std::string::npos && header[p] == '(',
               where << ": malformed .npy header, no 'shape': " << header);
  const std::size_t close = header.find(')', p);
  KMOE_REQUIRE(close != std::string::npos, where << ": malformed .npy header: " << header);
  std::size_t q = p + 1;
  while (q < close) {
    q = header.find_first_not_of(", ", q);
    if (q == std::string::npos || q >= close) break;
    char* stop = nullptr;
    const long long dim = std::strtoll(header.c_str() + q, &stop, 10);
    const std::size_t next = static_cast<std::size_t>(stop - header.c_str());
    KMOE_REQUIRE(next > q && dim >= 0, where << ": malformed .npy shape: " << header);
    h.shape.push_back(dim);
    q = next;
  }
  return h;
}

std::uint32_t read_le32(const unsigned char* b) {
  return std::uint32_t(b[0]) | std::uint32_t(b[1]) << 8 | std::uint32_t(b[2]) << 16 |
         std::uint32_t(b[3]) << 24;
}

// Reads exactly n bytes at `offset`; false on a short read (the file ends before) or an error.
bool read_at(int fd, void* buf, std::int64_t n, std::int64_t offset, int* error) {
  auto* p = static_cast<unsigned char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, static_cast<std::size_t>(n), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      *error = got < 0 ? errno : 0;
      return false;
    }
    p += got;
    n -= got;
    offset += got;
  }
  return true;
}

std::vector<unsigned char> read_prefix(int fd, std::int64_t n, const std::string& where) {
  std::vector<unsigned char> b(static_cast<std::size_t>(n));
  int error = 0;
  KMOE_REQUIRE(read_at(fd, b.data(), n, 0, &error),
               where << ": cannot read its first " << n << " bytes"
                     << (error ? std::string(" (") + std::strerror(error) + ")" : std::string()));
  return b;
}

// Returns the byte offset of the token data in a .npy file of `size` bytes, checking its header
// against the deck's dtype.
std::int64_t npy_data_offset(int fd, std::int64_t size, const std::string& dtype,
                             const std::string& where) {
  KMOE_REQUIRE(size >= 10, where << ": truncated .npy header");
  const std::vector<unsigned char> head = read_prefix(fd, size >= 12 ? 12 : 10, where);
  const int major = head[6];
  KMOE_REQUIRE(major >= 1 && major <= 3,
               where << ": unsupported .npy format version " << major << "." << int(head[7]));
  const std::int64_t len_bytes = major == 1 ? 2 : 4;
  KMOE_REQUIRE(size >= 8 + len_bytes, where << ": truncated .npy header");
  const std::int64_t header_len =
      major == 1 ? std::int64_t(head[8]) | std::int64_t(head[9]) << 8 : read_le32(head.data() + 8);
  const std::int64_t data_offset = 8 + len_bytes + header_len;
  KMOE_REQUIRE(data_offset <= size, where << ": truncated .npy header (" << header_len
                                          << " header bytes declared, file has " << size << ")");
  const std::vector<unsigned char> bytes = read_prefix(fd, data_offset, where);
  const std::string header(reinterpret_cast<const char*>(bytes.data() + 8 + len_bytes),
                           static_cast<std::size_t>(header_len));
  const NpyHeader h = parse_npy_dict(header, where);

  const std::string want = dtype == "uint16" ? "<u2" : "<u4";
  KMOE_REQUIRE(h.descr == want, where << ": .npy dtype '" << h.descr
                                      << "' does not match data.dtype " << dtype << " (expected '"
                                      << want << "')");
  KMOE_REQUIRE(!h.fortran_order, where << ": .npy file has fortran_order True; expected False");
  KMOE_REQUIRE(h.shape.size() == 1, where << ": .npy array has " << h.shape.size()
                                          << " dimensions; token files must be 1-D");
  const std::int64_t elem = dtype_bytes(dtype);
  KMOE_REQUIRE(h.shape[0] * elem == size - data_offset,
               where << ": .npy shape (" << h.shape[0] << ",) of " << dtype << " needs "
                     << h.shape[0] * elem << " data bytes, file has " << size - data_offset);
  return data_offset;
}

TokenFile open_token_file(const std::string& path, const std::string& dtype,
                          const std::string& key) {
  const std::string where = key + ": file " + path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KMOE_REQUIRE(fd >= 0, where << ": cannot open (" << std::strerror(errno) << ")");
  TokenFile f;
  f.path = path;
  f.fd = std::shared_ptr<int>(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  struct stat st;
  KMOE_REQUIRE(::fstat(fd, &st) == 0 && S_ISREG(st.st_mode), where << ": not a regular file");
  const std::int64_t size = st.st_size;
  f.elem_size = dtype_bytes(dtype);
  f.size_at_open = size;
  if (size >= 6) {
    const std::vector<unsigned char> magic = read_prefix(fd, 6, where);
    if (std::memcmp(magic.data(), "\x93NUMPY", 6) == 0)
      f.data_offset = npy_data_offset(fd, size, dtype, where);
  }
  const std::int64_t data_bytes = size - f.data_offset;
  KMOE_REQUIRE(data_bytes % f.elem_size == 0, where << ": size " << data_bytes
                                                    << " bytes is not a multiple of " << f.elem_size
                                                    << " (data.dtype " << dtype << ")");
  f.n_tokens = data_bytes / f.elem_size;
  return f;
}

}  // namespace

TokenDataset::TokenDataset(const std::vector<std::string>& patterns, const std::string& dtype,
                           int seq_len, int vocab_size, const std::string& key)
    : seq_len_(seq_len), vocab_size_(vocab_size), key_(key) {
  dtype_bytes(dtype);
  KMOE_REQUIRE(seq_len > 0, "train.seq_len must be positive, got " << seq_len);
  KMOE_REQUIRE(vocab_size > 0, "model.vocab_size must be positive, got " << vocab_size);
  KMOE_REQUIRE(!patterns.empty(), key << ": no files given");
  std::vector<std::string> paths;
  for (const std::string& pattern : patterns)
    for (const std::string& path : expand_pattern(pattern, key)) paths.push_back(path);
  // Every file stays open for the run (reads see the file the run opened): raise the soft limit
  // on open files to the hard one if there are many shards.
  rlimit files_limit{};
  if (::getrlimit(RLIMIT_NOFILE, &files_limit) == 0 && files_limit.rlim_cur != RLIM_INFINITY &&
      paths.size() + 256 > files_limit.rlim_cur) {
    files_limit.rlim_cur = files_limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files_limit);
    ::getrlimit(RLIMIT_NOFILE, &files_limit);
    KMOE_REQUIRE(
        files_limit.rlim_cur == RLIM_INFINITY || paths.size() + 256 <= files_limit.rlim_cur,
        key << ": " << paths.size() << " token files, but this process may open only "
            << files_limit.rlim_cur << " files (ulimit -n): merge shards or raise the limit");
  }
  for (const std::string& path : paths) files_.push_back(open_token_file(path, dtype, key));
  std::int64_t total_tokens = 0;
  for (std::size_t f = 0; f < files_.size(); ++f) {
    total_tokens += files_[f].n_tokens;
    const std::int64_t n = files_[f].n_tokens / seq_len;
    for (std::int64_t k = 0; k < n; ++k) instances_.push_back({static_cast<int>(f), k * seq_len});
  }
  if (instances_.empty()) {
    std::string sizes;
    for (std::size_t f = 0; f < files_.size() && f < 8; ++f)
      sizes +=
          (f ? ", " : "") + files_[f].path + " (" + std::to_string(files_[f].n_tokens) + " tokens)";
    if (files_.size() > 8) sizes += ", ...";
    KMOE_FAIL(key << ": no instances: each of the " << files_.size()
                  << " file(s) is shorter than train.seq_len = " << seq_len << " tokens ("
                  << total_tokens << " tokens in all): " << sizes);
  }
}

void TokenDataset::read_instance(std::int64_t i, std::int32_t* out) const {
  KMOE_REQUIRE(i >= 0 && i < num_instances(),
               key_ << ": instance " << i << " out of range [0, " << num_instances() << ")");
  const Instance& inst = instances_[static_cast<std::size_t>(i)];
  const TokenFile& f = files_[static_cast<std::size_t>(inst.file)];
  const std::int64_t bytes = std::int64_t(seq_len_) * f.elem_size;
  const std::int64_t at = f.data_offset + inst.first_token * f.elem_size;
  buffer_.resize(static_cast<std::size_t>(bytes));
  int error = 0;
  if (!read_at(*f.fd, buffer_.data(), bytes, at, &error)) {
    struct stat st;
    const std::int64_t now = ::fstat(*f.fd, &st) == 0 ? std::int64_t(st.st_size) : -1;
    KMOE_FAIL(key_ << ": file " << f.path << ": cannot read instance " << i << " (bytes " << at
                   << " to " << at + bytes << "): "
                   << (error ? std::string(std::strerror(error))
                             : "the file has " + std::to_string(now) + " bytes, " +
                                   std::to_string(f.size_at_open) +
                                   " when the run opened it: changed or truncated while in use"));
  }
  const unsigned char* b = buffer_.data();
  const auto vocab = static_cast<std::uint32_t>(vocab_size_);
  for (int t = 0; t < seq_len_; ++t) {
    // Assembled byte by byte: little-endian on any host.
    const std::uint32_t id =
        f.elem_size == 2 ? std::uint32_t(b[0]) | std::uint32_t(b[1]) << 8 : read_le32(b);
    KMOE_REQUIRE(id < vocab, key_ << ": token id " << id << " >= model.vocab_size " << vocab_size_
                                  << " in file " << f.path << " at token offset "
                                  << inst.first_token + t);
    out[t] = static_cast<std::int32_t>(id);
    b += f.elem_size;
  }
}

// The exact algorithm, for independent reimplementations (all arithmetic mod 2^64, splitmix64 as
// in core/rng.hpp, i.e. the finalizer applied to x + 0x9E3779B97F4A7C15):
//   key  = splitmix64(seed ^ splitmix64(uint64(epoch) + 0x6B6D6F6544415441))
//   perm = [0, 1, ..., n-1]; k = 0
//   for i = n-1 down to 1:
//     j = splitmix64(key + k) % (i + 1); k += 1
//     swap(perm[i], perm[j])
// The modulo bias is below (i+1) / 2^64, far beneath anything a training run could detect.
std::vector<std::int64_t> epoch_permutation(std::int64_t n, std::uint64_t seed,
                                            std::int64_t epoch) {
  KMOE_REQUIRE(n >= 0, "epoch_permutation: negative instance count " << n);
  KMOE_REQUIRE(epoch >= 0, "epoch_permutation: negative epoch " << epoch);
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n));
  std::iota(perm.begin(), perm.end(), std::int64_t{0});
  const std::uint64_t key =
      splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(epoch) + 0x6B6D6F6544415441ull));
  std::uint64_t counter = 0;
  for (std::int64_t i = n - 1; i >= 1; --i) {
    const std::uint64_t j = splitmix64(key + counter++) % static_cast<std::uint64_t>(i + 1);
    std::swap(perm[static_cast<std::size_t>(i)], perm[static_cast<std::size_t>(j)]);
  }
  return perm;
}

InstanceStream::InstanceStream(std::int64_t n_instances, std::uint64_t seed)
    : n_(n_instances), seed_(seed) {
  KMOE_REQUIRE(n_instances > 0, "InstanceStream: no instances to draw from");
}

std::int64_t InstanceStream::instance_at(std::int64_t position) {
  KMOE_REQUIRE(position >= 0, "InstanceStream: negative position " << position);
  const std::int64_t epoch = position / n_;
  if (epoch != cached_epoch_) {
    perm_ = epoch_permutation(n_, seed_, epoch);
    cached_epoch_ = epoch;
  }
  return perm_[static_cast<std::size_t>(position % n_)];
}

}  // namespace kmoe
