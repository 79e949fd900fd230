#include "modules/attention/fused_attention.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/bf16.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {

using ScratchF = Kokkos::View<float*, ExecSpace::scratch_memory_space, Unmanaged>;

// Below every score: the running max of a row that has seen no key yet.
constexpr float kNoMax = -3.0e38f;

// Where a call's rows live and what the mask lets them read (attention_core.hpp's layouts).
struct Geometry {
  int nseq, H, Hkv, G, dh, T, window, B;
  float scale;
  bool bf16;
  DocStarts docs;

  // Element 0 of query head h at position t of sequence s: (nseq, Hkv, T, G, dh).
  KOKKOS_INLINE_FUNCTION std::int64_t q_at(int s, int h, int t) const {
    return (((std::int64_t(s) * Hkv + h / G) * T + t) * G + h % G) * dh;
  }
  // Element 0 of kv head kvh's key (value) at position t: (nseq, Hkv, T, dh).
  KOKKOS_INLINE_FUNCTION std::int64_t k_at(int s, int kvh, int t) const {
    return ((std::int64_t(s) * Hkv + kvh) * T + t) * dh;
  }
  KOKKOS_INLINE_FUNCTION std::int64_t lse_at(int s, int h, int t) const {
    return (std::int64_t(s) * H + h) * T + t;
  }
  // The first key position t of sequence s reads (the last is t): nondecreasing in t.
  KOKKOS_INLINE_FUNCTION int lo(int s, int t) const {
    return first_key(t, docs(s * T + t), window);
  }
  // A product's operand as the GEMMs of the run would see it.
  KOKKOS_INLINE_FUNCTION float rounded(float x) const { return bf16 ? round_bf16(x) : x; }
  KOKKOS_INLINE_FUNCTION int blocks() const { return (T + B - 1) / B; }
};

KOKKOS_INLINE_FUNCTION int lesser(int a, int b) { return a < b ? a : b; }

// The query block league rank r of a (sequence, head, query block) kernel is: rows [q0, q0 + nq)
// of head h of sequence s.
struct QueryBlock {
  int s, h, q0, nq;
  KOKKOS_INLINE_FUNCTION QueryBlock(const Geometry& g, int r) {
    const int nqb = g.blocks();
    s = r / nqb / g.H;
    h = (r / nqb) % g.H;
    q0 = (r % nqb) * g.B;
    nq = lesser(g.B, g.T - q0);
  }
};
KOKKOS_INLINE_FUNCTION int greater(int a, int b) { return a > b ? a : b; }

KOKKOS_INLINE_FUNCTION float dot(const ScratchF& a, int ia, const ScratchF& b, int ib, int n) {
  float acc = 0.0f;
  for (int d = 0; d < n; ++d) acc += a(ia + d) * b(ib + d);
  return acc;
}

// Team scratch of views of these sizes (floats).
std::size_t scratch_bytes(std::initializer_list<int> sizes) {
  std::size_t bytes = 0;
  for (int n : sizes) bytes += ScratchF::shmem_size(n);
  return bytes;
}
std::size_t forward_scratch(int B, int dh) {
  return scratch_bytes({B * dh, B * dh, B * dh, B * dh, B * B, B, B, B});
}
std::size_t key_scratch(int B, int dh) {
  return scratch_bytes({B * dh, B * dh, B * dh, B * dh, B * dh, B * dh, B * B, B * B, B, B});
}
std::size_t query_scratch(int B, int dh) {
  return scratch_bytes({B * dh, B * dh, B * dh, B * dh, B * dh, B * B, B * B, B, B});
}

TeamPolicy fused_policy(std::int64_t teams, std::size_t bytes, const char* what) {
  KMOE_REQUIRE(teams <= std::int64_t(INT32_MAX), "fused attention: " << teams << " " << what);
  return team_policy(static_cast<int>(teams)).set_scratch_size(0, Kokkos::PerTeam(bytes));
}

// A key block's rows [k0, k0 + nk) of kv head kvh into scratch.
KOKKOS_INLINE_FUNCTION void load_keys(const TeamMember& tm, const Geometry& g, int s, int kvh,
                                      int k0, int nk, KeptIn k, KeptIn v, const ScratchF& Ks,
                                      const ScratchF& Vs) {
  const int dh = g.dh;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nk * dh), [&](int e) {
    const std::int64_t at = g.k_at(s, kvh, k0 + e / dh) + e % dh;
    Ks(e) = k.get(at);
    Vs(e) = v.get(at);
  });
  tm.team_barrier();
}

// Scores S = q k^T / sqrt(dh) of a query block (nq rows from q0 in Qs) and a key block.
KOKKOS_INLINE_FUNCTION void block_scores(const TeamMember& tm, const Geometry& g, int nq, int nk,
                                         const ScratchF& Qs, const ScratchF& Ks,
                                         const ScratchF& S) {
  const int B = g.B, dh = g.dh;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * nk), [&](int e) {
    const int i = e / nk, j = e % nk;
    S(i * B + j) = dot(Qs, i * dh, Ks, j * dh, dh) * g.scale;
  });
  tm.team_barrier();
}

// Forward: a team per (sequence, head, query block); the key blocks from the block's first
// row's first key to its last row. Each: the scores, then the online softmax's running max M
// and sum L per row (A: the factor this block rescales the earlier ones by). fp32 runs sweep
// the keys once: the output rows are rescaled and summed as they go and divided by L at the
// end. bf16 runs round the probabilities normalized, as the tiled core and the reference do:
// a first sweep makes M and L, a second the rows' P = exp(S - lse) and their sum P v (twice
// the forward's score products).
void fused_forward(const Geometry g, KeptIn q, KeptIn k, KeptIn v, float* heads, KeptOut out,
                   float* lse) {
  const int B = g.B, dh = g.dh, nqb = g.blocks();
  Kokkos::parallel_for(
      "attn::fused_forward",
      fused_policy(std::int64_t(g.nseq) * g.H * nqb, forward_scratch(B, dh), "query blocks"),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const QueryBlock qblock(g, tm.league_rank());
        const int s = qblock.s, h = qblock.h, q0 = qblock.q0, nq = qblock.nq, kvh = h / g.G;
        const int last = q0 + nq - 1;
        const bool normalized = g.bf16;  // a second sweep with the normalized probabilities
        ScratchF Qs(tm.team_scratch(0), B * dh), Ks(tm.team_scratch(0), B * dh),
            Vs(tm.team_scratch(0), B * dh), Os(tm.team_scratch(0), B * dh),
            S(tm.team_scratch(0), B * B), M(tm.team_scratch(0), B), L(tm.team_scratch(0), B),
            A(tm.team_scratch(0), B);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh), [&](int e) {
          Qs(e) = q.get(g.q_at(s, h, q0 + e / dh) + e % dh);
          Os(e) = 0.0f;
        });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq), [&](int i) {
          M(i) = kNoMax;
          L(i) = 0.0f;
        });
        tm.team_barrier();
        const int first = g.lo(s, q0);
        for (int k0 = first; k0 <= last; k0 += B) {
          const int nk = lesser(B, last - k0 + 1);
          load_keys(tm, g, s, kvh, k0, nk, k, v, Ks, Vs);
          block_scores(tm, g, nq, nk, Qs, Ks, S);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq), [&](int i) {
            const int t = q0 + i, jl = greater(g.lo(s, t), k0) - k0;
            const int jh = lesser(t, k0 + nk - 1) - k0;
            float mx = M(i);
            for (int j = jl; j <= jh; ++j) mx = S(i * B + j) > mx ? S(i * B + j) : mx;
            const float alpha = M(i) == kNoMax ? 0.0f : math::exp_poly(M(i) - mx);
            float sum = 0.0f;
            for (int j = 0; j < nk; ++j) {
              const float p = j >= jl && j <= jh ? math::exp_poly(S(i * B + j) - mx) : 0.0f;
              sum += p;
              S(i * B + j) = p;
            }
            L(i) = L(i) * alpha + sum;
            M(i) = mx;
            A(i) = alpha;
          });
          tm.team_barrier();
          if (normalized) continue;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh), [&](int e) {
            const int i = e / dh, d = e % dh;
            float acc = 0.0f;
            for (int j = 0; j < nk; ++j) acc += S(i * B + j) * Vs(j * dh + d);
            Os(e) = Os(e) * A(i) + acc;
          });
          tm.team_barrier();
        }
        // The log-sum-exp of each row (A now holds it).
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq), [&](int i) {
          A(i) = M(i) + math::log(L(i));
          lse[g.lse_at(s, h, q0 + i)] = A(i);
        });
        tm.team_barrier();
        if (normalized) {
          for (int k0 = first; k0 <= last; k0 += B) {
            const int nk = lesser(B, last - k0 + 1);
            load_keys(tm, g, s, kvh, k0, nk, k, v, Ks, Vs);
            block_scores(tm, g, nq, nk, Qs, Ks, S);
            Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * nk), [&](int e) {
              const int i = e / nk, j = e % nk, t = q0 + i, key = k0 + j;
              const bool seen = key >= g.lo(s, t) && key <= t;
              S(i * B + j) = seen ? g.rounded(math::exp_poly(S(i * B + j) - A(i))) : 0.0f;
            });
            tm.team_barrier();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh), [&](int e) {
              const int i = e / dh, d = e % dh;
              float acc = 0.0f;
              for (int j = 0; j < nk; ++j) acc += S(i * B + j) * Vs(j * dh + d);
              Os(e) += acc;
            });
            tm.team_barrier();
          }
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh), [&](int e) {
          const int i = e / dh;
          const float o = normalized ? Os(e) : Os(e) / L(i);
          const std::int64_t at = g.q_at(s, h, q0 + i) + e % dh;
          heads[at] = o;
          out.set(at, o);
        });
      });
}

// The probabilities P = exp(scores - lse) of a (query block, key block) pair (0 outside the
// mask) into P, dP = dO v^T into dP; then P as the products read it (R(P) in bf16 runs, as the
// forward's P v read it) and dS = P * (dP - D) * scale into dP, rounded as dQ and dK read it. Qs,
// dOs: nq rows from q0; Ks, Vs: nk rows from k0.
struct BlockGrads {
  KOKKOS_INLINE_FUNCTION static void run(const TeamMember& tm, const Geometry& g, int s, int q0,
                                         int nq, int k0, int nk, const ScratchF& Qs,
                                         const ScratchF& dOs, const ScratchF& Ks,
                                         const ScratchF& Vs, const ScratchF& Lq, const ScratchF& Dq,
                                         const ScratchF& P, const ScratchF& dP) {
    const int B = g.B, dh = g.dh;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * nk), [&](int e) {
      const int i = e / nk, j = e % nk, t = q0 + i, key = k0 + j;
      const bool seen = key >= g.lo(s, t) && key <= t;
      P(i * B + j) =
          seen ? math::exp_poly(dot(Qs, i * dh, Ks, j * dh, dh) * g.scale - Lq(i)) : 0.0f;
      dP(i * B + j) = dot(dOs, i * dh, Vs, j * dh, dh);
    });
    tm.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * nk), [&](int e) {
      const int i = e / nk, j = e % nk;
      const float p = g.rounded(P(i * B + j));
      dP(i * B + j) = g.rounded(p * (dP(i * B + j) - Dq(i)) * g.scale);
      P(i * B + j) = p;
    });
    tm.team_barrier();
  }
};

// A query block's dO (as products read it), log-sum-exp and D = rowsum(dO * O) into scratch.
KOKKOS_INLINE_FUNCTION void load_queries(const TeamMember& tm, const Geometry& g, int s, int h,
                                         int q0, int nq, KeptIn q, KeptIn out, const float* d_heads,
                                         const float* lse, const ScratchF& Qs, const ScratchF& dOs,
                                         const ScratchF& Lq, const ScratchF& Dq) {
  const int dh = g.dh;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh), [&](int e) {
    const std::int64_t at = g.q_at(s, h, q0 + e / dh) + e % dh;
    Qs(e) = q.get(at);
    dOs(e) = g.rounded(d_heads[at]);
  });
  Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq), [&](int i) {
    const std::int64_t at = g.q_at(s, h, q0 + i);
    float acc = 0.0f;
    for (int d = 0; d < dh; ++d) acc += g.rounded(d_heads[at + d]) * out.get(at + d);
    Dq(i) = acc;
    Lq(i) = lse[g.lse_at(s, h, q0 + i)];
  });
  tm.team_barrier();
}

// dK, dV: a team per (sequence, kv head, key block); its kv head's G query heads one after
// another, each over the query blocks from the key block's first row on that can see it.
void fused_key_grads(const Geometry g, KeptIn q, KeptIn k, KeptIn v, KeptIn out,
                     const float* d_heads, const float* lse, float* d_k, float* d_v) {
  const int B = g.B, dh = g.dh, nkb = g.blocks();
  Kokkos::parallel_for(
      "attn::fused_key_grads",
      fused_policy(std::int64_t(g.nseq) * g.Hkv * nkb, key_scratch(B, dh), "key blocks"),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const int r = tm.league_rank(), kb = r % nkb, kvh = (r / nkb) % g.Hkv;
        const int s = r / nkb / g.Hkv, k0 = kb * B, nk = lesser(B, g.T - k0), klast = k0 + nk - 1;
        ScratchF Ks(tm.team_scratch(0), B * dh), Vs(tm.team_scratch(0), B * dh),
            dKs(tm.team_scratch(0), B * dh), dVs(tm.team_scratch(0), B * dh),
            Qs(tm.team_scratch(0), B * dh), dOs(tm.team_scratch(0), B * dh),
            P(tm.team_scratch(0), B * B), dP(tm.team_scratch(0), B * B), Lq(tm.team_scratch(0), B),
            Dq(tm.team_scratch(0), B);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nk * dh), [&](int e) {
          const std::int64_t at = g.k_at(s, kvh, k0 + e / dh) + e % dh;
          Ks(e) = k.get(at);
          Vs(e) = v.get(at);
          dKs(e) = 0.0f;
          dVs(e) = 0.0f;
        });
        tm.team_barrier();
        for (int hg = 0; hg < g.G; ++hg) {
          const int h = kvh * g.G + hg;
          // Rows before k0 read none of the keys; a row whose first key is past the block
          // reads none either, nor (first keys do not decrease) any row after it.
          for (int q0 = k0; q0 < g.T && g.lo(s, q0) <= klast; q0 += B) {
            const int nq = lesser(B, g.T - q0);
            load_queries(tm, g, s, h, q0, nq, q, out, d_heads, lse, Qs, dOs, Lq, Dq);
            BlockGrads::run(tm, g, s, q0, nq, k0, nk, Qs, dOs, Ks, Vs, Lq, Dq, P, dP);
            Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nk * dh), [&](int e) {
              const int j = e / dh, d = e % dh;
              float dv = 0.0f, dk = 0.0f;
              for (int i = 0; i < nq; ++i) {
                dv += P(i * B + j) * dOs(i * dh + d);
                dk += dP(i * B + j) * Qs(i * dh + d);
              }
              dVs(e) += dv;
              dKs(e) += dk;
            });
            tm.team_barrier();
          }
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nk * dh), [&](int e) {
          const std::int64_t at = g.k_at(s, kvh, k0 + e / dh) + e % dh;
          d_k[at] = dKs(e);
          d_v[at] = dVs(e);
        });
      });
}

// dQ: a team per (sequence, head, query block), over the key blocks its rows read; dQ replaces
// the block's dO rows (read into scratch first; no other team reads them).
void fused_query_grads(const Geometry g, KeptIn q, KeptIn k, KeptIn v, KeptIn out, float* d_heads,
                       const float* lse) {
  const int B = g.B, dh = g.dh, nqb = g.blocks();
  Kokkos::parallel_for(
      "attn::fused_query_grads",
      fused_policy(std::int64_t(g.nseq) * g.H * nqb, query_scratch(B, dh), "query blocks"),
      KOKKOS_LAMBDA(const TeamMember& tm) {
        const QueryBlock qblock(g, tm.league_rank());
        const int s = qblock.s, h = qblock.h, q0 = qblock.q0, nq = qblock.nq, kvh = h / g.G;
        const int last = q0 + nq - 1;
        ScratchF Qs(tm.team_scratch(0), B * dh), dOs(tm.team_scratch(0), B * dh),
            dQs(tm.team_scratch(0), B * dh), Ks(tm.team_scratch(0), B * dh),
            Vs(tm.team_scratch(0), B * dh), P(tm.team_scratch(0), B * B),
            dP(tm.team_scratch(0), B * B), Lq(tm.team_scratch(0), B), Dq(tm.team_scratch(0), B);
        load_queries(tm, g, s, h, q0, nq, q, out, d_heads, lse, Qs, dOs, Lq, Dq);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh), [&](int e) { dQs(e) = 0.0f; });
        for (int k0 = g.lo(s, q0); k0 <= last; k0 += B) {
          const int nk = lesser(B, last - k0 + 1);
          load_keys(tm, g, s, kvh, k0, nk, k, v, Ks, Vs);
          BlockGrads::run(tm, g, s, q0, nq, k0, nk, Qs, dOs, Ks, Vs, Lq, Dq, P, dP);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh), [&](int e) {
            const int i = e / dh, d = e % dh;
            float acc = 0.0f;
            for (int j = 0; j < nk; ++j) acc += dP(i * B + j) * Ks(j * dh + d);
            dQs(e) += acc;
          });
          tm.team_barrier();
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(tm, nq * dh),
                             [&](int e) { d_heads[g.q_at(s, h, q0 + e / dh) + e % dh] = dQs(e); });
      });
}

}  // namespace

int FusedAttention::block_rows(int dh) {
  // Device paths on a host backend take the GPU's blocks, as they take its code paths.
  constexpr bool host = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
  const std::size_t budget =
      host && !device_paths() ? (std::size_t(1) << 20) : std::size_t(48) << 10;
  for (int B = 64; B > 8; B /= 2)
    if (std::max({forward_scratch(B, dh), key_scratch(B, dh), query_scratch(B, dh)}) <= budget)
      return B;
  return 8;
}

AttentionCoreSizes FusedAttention::sizes(const AttentionDims& d, bool /*bf16*/) {
  const Size rows = Size(d.max_seqs) * d.H * d.T;
  AttentionCoreSizes s;
  s.saved = Size(4) * rows * d.dh + Size(4) * rows;
  return s;
}

FusedAttention::FusedAttention(const RunContext& ctx, const AttentionDims& dims)
    : ctx_(ctx.unpooled()), dims_(dims), block_(block_rows(dims.dh)) {
  const std::int64_t rows = std::int64_t(dims.max_seqs) * dims.H * dims.T;
  out_ = KeptOperand(ctx, "attn::fused_out", rows * dims.dh, /*may_be_bf16=*/false);
  lse_ = saved_floats(ctx, "attn::fused_lse", rows);
}

void FusedAttention::forward(const AttentionInputs& in, int nseq, const DocStarts& docs,
                             float* heads, Workspace& /*ws*/) {
  docs_ = docs;
  const Geometry g{nseq,         dims_.H,  dims_.Hkv,
                   dims_.G(),    dims_.dh, dims_.T,
                   dims_.window, block_,   1.0f / std::sqrt(static_cast<float>(dims_.dh)),
                   ctx_.bf16(),  docs};
  fused_forward(g, in.q.in(), in.k.in(), in.v.in(), heads, out_.out(), lse_.data());
}

void FusedAttention::backward(const AttentionInputs& in, int nseq, float* d_heads,
                              const std::uint16_t* /*d_heads16: no products here*/, float* d_k,
                              float* d_v, Workspace& /*ws*/) {
  const Geometry g{nseq,         dims_.H,  dims_.Hkv,
                   dims_.G(),    dims_.dh, dims_.T,
                   dims_.window, block_,   1.0f / std::sqrt(static_cast<float>(dims_.dh)),
                   ctx_.bf16(),  docs_};
  fused_key_grads(g, in.q.in(), in.k.in(), in.v.in(), out_.in(), d_heads, lse_.data(), d_k, d_v);
  fused_query_grads(g, in.q.in(), in.k.in(), in.v.in(), out_.in(), d_heads, lse_.data());
}

}  // namespace kmoe
