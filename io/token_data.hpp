// Token data (RUNTIME.md section 3): headerless little-endian uint16/uint32 token files or .npy
// files, read an instance at a time; cut into non-overlapping instances of T tokens that never span
// two files; shuffled per epoch from (seed, epoch) alone; validation read in file order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kmoe {

// One open token file (header skipped for .npy).
struct TokenFile {
  std::string path;
  std::shared_ptr<int> fd;       // closed with the last copy
  std::int64_t data_offset = 0;  // first token byte (after any .npy header)
  std::int64_t n_tokens = 0;
  std::int64_t size_at_open = 0;  // bytes
  int elem_size = 2;              // bytes per token: 2 (uint16) or 4 (uint32)
};

class TokenDataset {
 public:
  // `patterns`: files or globs in order (each glob expands sorted by name); `key` names the deck
  // key in error messages ("data.paths" or "data.val_paths"). Throws kmoe::Error on a missing
  // file, a size that is not a multiple of the dtype, a .npy whose dtype disagrees, ...
  TokenDataset(const std::vector<std::string>& patterns, const std::string& dtype, int seq_len,
               int vocab_size, const std::string& key);

  std::int64_t num_instances() const { return static_cast<std::int64_t>(instances_.size()); }
  int seq_len() const { return seq_len_; }
  const std::vector<TokenFile>& files() const { return files_; }

  // Copies instance i (0-based, file order) into out[0..T). Throws kmoe::Error naming the file
  // and token offset if a token id is >= vocab_size, and naming the file if it cannot be read
  // (e.g. truncated since it was opened).
  void read_instance(std::int64_t i, std::int32_t* out) const;

 private:
  struct Instance {
    int file;
    std::int64_t first_token;
  };
  std::vector<TokenFile> files_;
  std::vector<Instance> instances_;
  int seq_len_;
  int vocab_size_;
  std::string key_;                            // deck key named in read_instance's errors
  mutable std::vector<unsigned char> buffer_;  // one instance's bytes
};

// Permutation of [0, n) for one epoch, a function of (seed, epoch, n) only (never rank count).
std::vector<std::int64_t> epoch_permutation(std::int64_t n, std::uint64_t seed, std::int64_t epoch);

// The training instance stream: position i is entry (i mod n) of epoch (i div n)'s permutation.
class InstanceStream {
 public:
  InstanceStream(std::int64_t n_instances, std::uint64_t seed);
  std::int64_t instance_at(std::int64_t position);  // caches the current epoch's permutation

 private:
  std::int64_t n_;
  std::uint64_t seed_;
  std::int64_t cached_epoch_ = -1;
  std::vector<std::int64_t> perm_;
};

}  // namespace kmoe
