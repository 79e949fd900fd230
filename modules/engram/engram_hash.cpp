#include "modules/engram/engram_hash.hpp"

#include <algorithm>
#include <limits>
#include <set>

#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "io/token_data.hpp"

namespace kmoe {

namespace {

bool is_prime(std::int64_t n) {
  if (n < 2) return false;
  if (n % 2 == 0) return n == 2;
  for (std::int64_t d = 3; d * d <= n; d += 2)
    if (n % d == 0) return false;
  return true;
}

}  // namespace

std::vector<std::uint64_t> engram_multipliers(std::uint64_t seed, int layer, int max_ngram,
                                              std::int64_t vocab_c) {
  const std::uint64_t M = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) /
                          static_cast<std::uint64_t>(vocab_c);
  const std::uint64_t half = std::max<std::uint64_t>(1, M / 2);
  std::uint64_t state = seed + 10007ull * static_cast<std::uint64_t>(layer);
  std::vector<std::uint64_t> m(max_ngram);
  for (int k = 0; k < max_ngram; ++k) {
    state += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    const std::uint64_t r = z ^ (z >> 31);
    m[k] = 2 * (r % half) + 1;
  }
  return m;
}

EngramCompression load_engram_compression(const EngramCfg& cfg, int vocab_size) {
  EngramCompression c;
  c.map.resize(vocab_size);
  if (cfg.compression_map.empty()) {
    for (int v = 0; v < vocab_size; ++v) c.map[v] = v;
    c.vocab_c = vocab_size;
    return c;
  }
  // The token-file reader parses headerless arrays and .npy alike; one "instance" per id.
  const TokenDataset file({cfg.compression_map}, "uint32", 1, std::numeric_limits<int>::max(),
                          "engram.compression_map");
  KMOE_REQUIRE(file.num_instances() == vocab_size,
               "engram.compression_map = "
                   << cfg.compression_map << " holds " << file.num_instances()
                   << " ids; it needs one per token id (model.vocab_size = " << vocab_size << ")");
  std::int32_t max_id = 0;
  for (int v = 0; v < vocab_size; ++v) {
    file.read_instance(v, &c.map[v]);
    max_id = std::max(max_id, c.map[v]);
  }
  c.vocab_c = std::int64_t(max_id) + 1;
  return c;
}

std::vector<EngramHashPlan> engram_hash_plans(const EngramCfg& cfg, std::int64_t vocab_c) {
  std::vector<int> layers = cfg.layers;
  std::sort(layers.begin(), layers.end());
  std::set<std::int64_t> used;
  std::vector<EngramHashPlan> plans;
  for (int l : layers) {
    EngramHashPlan p;
    p.layer = l;
    p.multipliers = engram_multipliers(cfg.seed, l, cfg.max_ngram, vocab_c);
    for (int n = 2; n <= cfg.max_ngram; ++n) {
      std::int64_t cur =
          (cfg.table_size.empty() ? 5 * vocab_c : std::int64_t(cfg.table_size[n - 2])) - 1;
      for (int h = 0; h < cfg.heads; ++h) {
        do ++cur;
        while (!is_prime(cur) || used.count(cur));
        used.insert(cur);
        p.offsets.push_back(p.rows);
        p.primes.push_back(cur);
        p.rows += cur;
      }
    }
    KMOE_REQUIRE(p.rows < std::numeric_limits<int>::max(),
                 "engram.table_size: layer " << l << " needs " << p.rows
                                             << " table rows, more than a 32-bit row index");
    plans.push_back(std::move(p));
  }
  return plans;
}

EngramHasher::EngramHasher(const EngramHashPlan& plan, int max_ngram, int heads, int pad_c)
    : max_ngram_(max_ngram),
      heads_(heads),
      pad_c_(pad_c),
      mult_("engram::multipliers", max_ngram),
      primes_("engram::primes", plan.primes.size()),
      offsets_("engram::offsets", plan.offsets.size()),
      host_mult_(plan.multipliers.begin(), plan.multipliers.begin() + max_ngram),
      host_primes_(plan.primes),
      host_offsets_(plan.offsets) {
  auto hm = Kokkos::create_mirror_view(mult_);
  auto hp = Kokkos::create_mirror_view(primes_);
  auto ho = Kokkos::create_mirror_view(offsets_);
  for (int k = 0; k < max_ngram; ++k) hm(k) = plan.multipliers[k];
  for (std::size_t j = 0; j < plan.primes.size(); ++j) {
    hp(j) = plan.primes[j];
    ho(j) = plan.offsets[j];
  }
  mark_host_sync("engram hash setup");
  Kokkos::deep_copy(mult_, hm);
  mark_host_sync("engram hash setup");
  Kokkos::deep_copy(primes_, hp);
  mark_host_sync("engram hash setup");
  Kokkos::deep_copy(offsets_, ho);
}

namespace {

// Rows of position i (t within its sequence, its n-grams reading no position before `first`):
// rows(i, j) for every order n = 2..N and head h, j = (n-2)*K + h. The device kernel and the
// host (engram.offload = host) run this same integer arithmetic.
template <class Tokens, class Out>
KOKKOS_INLINE_FUNCTION void hash_position(const Tokens& tokens, int i, int t, int first, int N,
                                          int K, std::uint64_t pad, const std::uint64_t* mult,
                                          const std::int64_t* primes,
                                          const std::int64_t* offsets, const Out& out) {
  std::uint64_t mix = 0;  // XOR over k < n of S_k[t] * m_k, grown one order at a time
  for (int k = 0; k < N; ++k) {
    const std::uint64_t s = t - k >= first ? static_cast<std::uint64_t>(tokens(i - k)) : pad;
    mix ^= s * mult[k];
    if (k == 0) continue;  // orders start at n = 2
    const int n = k + 1;
    for (int h = 0; h < K; ++h) {
      const int j = (n - 2) * K + h;
      out(j, static_cast<int>(offsets[j] + static_cast<std::int64_t>(
                                                mix % static_cast<std::uint64_t>(primes[j]))));
    }
  }
}

// Host memory as hash_position reads and writes it (callable from its host and device code).
struct HostIds {
  const std::int32_t* ids;
  KOKKOS_INLINE_FUNCTION std::int32_t operator()(int i) const { return ids[i]; }
};
struct HostRows {
  int* rows;  // this position's (N-1)*K rows
  KOKKOS_INLINE_FUNCTION void operator()(int j, int r) const { rows[j] = r; }
};

}  // namespace

void EngramHasher::rows(ConstIVec tokens, int T, Kokkos::View<int**, Layout, MemSpace> rows,
                        DocStarts docs) const {
  const int N = max_ngram_, K = heads_, n_tok = tokens.extent(0);
  const std::uint64_t pad = static_cast<std::uint64_t>(pad_c_);
  auto mult = mult_;
  auto primes = primes_;
  auto offsets = offsets_;
  Kokkos::parallel_for(
      "engram::rows", Range(0, n_tok), KOKKOS_LAMBDA(int i) {
        hash_position(tokens, i, i % T, docs(i), N, K, pad, mult.data(), primes.data(),
                      offsets.data(), [&](int j, int r) { rows(i, j) = r; });
      });
}

void EngramHasher::rows_host(const std::int32_t* tokens, int n_tok, int T, const int* starts,
                             int shift, int* rows) const {
  const int N = max_ngram_, K = heads_, Kt = heads_total();
  const std::uint64_t pad = static_cast<std::uint64_t>(pad_c_);
  const std::uint64_t* mult = host_mult_.data();
  const std::int64_t* primes = host_primes_.data();
  const std::int64_t* offsets = host_offsets_.data();
  const HostIds tok{tokens};
  Kokkos::parallel_for(
      "engram::rows_host", Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(0, n_tok),
      [=](int i) {
        const int first = starts ? std::max(0, starts[i] - shift) : 0;  // as DocStarts reads
        hash_position(tok, i, i % T, first, N, K, pad, mult, primes, offsets,
                      HostRows{rows + std::int64_t(i) * Kt});
      });
}

}  // namespace kmoe
