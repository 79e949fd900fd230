// Engram's hashed n-gram addressing (MODEL.md section 4, steps 1-6), bit-exact with the spec:
// per-layer splitmix64 multipliers, one set of distinct prime moduli across all Engram layers,
// and the table row of every (token, head). The rest of the layer (lookup, gate, convolution)
// builds on these rows.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.hpp"
#include "core/doc_starts.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

// The addressing of one Engram layer.
struct EngramHashPlan {
  int layer = 0;                           // block index
  std::vector<std::uint64_t> multipliers;  // m_0 .. m_{N-1}
  std::vector<std::int64_t> primes;        // p_j, j = (n-2)*K + h: order-2 heads first
  std::vector<std::int64_t> offsets;       // o_j = sum_{i<j} p_i
  std::int64_t rows = 0;                   // R = sum_j p_j
  int pad_c = 0;                           // compress(engram.pad_id); set by the model builder
};

// m_k of `layer`: splitmix64 draws from state seed + 10007*layer; M = floor((2^63-1)/V'),
// half = max(1, floor(M/2)), m_k = 2*(r_k mod half) + 1.
std::vector<std::uint64_t> engram_multipliers(std::uint64_t seed, int layer, int max_ngram,
                                              std::int64_t vocab_c);

// Plans of every Engram layer in increasing block order (the order primes are drawn in).
// table_size empty: 5 * V' per order.
std::vector<EngramHashPlan> engram_hash_plans(const EngramCfg& cfg, std::int64_t vocab_c);

// Token compression (step 1): the canonical id of each of the V token ids, read from
// engram.compression_map (headerless little-endian uint32, or .npy of uint32), or the identity
// when it is empty. V' = 1 + the largest canonical id.
struct EngramCompression {
  std::vector<std::int32_t> map;  // (V)
  std::int64_t vocab_c = 0;       // V'
};
EngramCompression load_engram_compression(const EngramCfg& cfg, int vocab_size);

// Device-side addressing of one layer: rows(t, j) for compressed token ids of sequences of
// length T (n-grams never reach into the previous sequence; before the start: pad_c).
class EngramHasher {
 public:
  EngramHasher(const EngramHashPlan& plan, int max_ngram, int heads, int pad_c);
  // tokens: (nseq * T) compressed ids -> rows: (nseq * T, (N-1)*K) table rows. With `docs`
  // (train.document_mask) n-grams do not reach before their position's document start either.
  void rows(ConstIVec tokens, int T, Kokkos::View<int**, Layout, MemSpace> rows,
            DocStarts docs = DocStarts()) const;
  // The same rows computed by host threads from host memory (engram.offload = host):
  // tokens (n_tok) compressed ids -> rows (n_tok * heads_total()) row-major. starts: each
  // position's document start (nullptr: none), read as DocStarts does with `shift`.
  void rows_host(const std::int32_t* tokens, int n_tok, int T, const int* starts, int shift,
                 int* rows) const;
  int heads_total() const { return (max_ngram_ - 1) * heads_; }

 private:
  int max_ngram_, heads_, pad_c_;
  Kokkos::View<std::uint64_t*, Layout, MemSpace> mult_;
  Kokkos::View<std::int64_t*, Layout, MemSpace> primes_, offsets_;
  std::vector<std::uint64_t> host_mult_;
  std::vector<std::int64_t> host_primes_, host_offsets_;
};

}  // namespace kmoe
