// The attention core (MODEL.md section 1): softmax(q k^T / sqrt(dh) + mask) v and its backward,
// between the projections, QK-norm and RoPE that `Attention` does and the output projection.
// Every implementation (one file each, chosen in make_attention_core) has the same contract:
//
//   in    q (nseq, Hkv, T, G, dh): the G = H / Hkv query heads of a kv head side by side at each
//           position, so that the rows of a kv head's group are one (T * G, dh) matrix;
//         k, v (nseq, Hkv, T, dh); all three after QK-norm and RoPE, kept by `Attention` (bf16
//           in bf16 runs) and handed to backward again;
//         the mask: causal, a window (position t reads keys (t - window, t] only; 0: none) and
//           the document starts of the rows (train.document_mask; empty: none).
//   out   forward: the heads (nseq, Hkv, T, G, dh) in fp32, in q's layout; what its backward
//           needs that q, k, v are not (the tiled core: the probabilities), kept by the core.
//   back  from that state and dO (q's layout): dQ (in dO's place), dK and dV ((nseq, Hkv, T,
//           dh), assigned).
//
// The core's own memory is reported by its static sizes (attention_core_sizes): the state it
// saves, which the planner counts with the block's saved activations, and the workspace of its
// forward and backward on top of what `Attention` takes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/checked_size.hpp"
#include "core/config.hpp"
#include "core/doc_starts.hpp"
#include "core/kept_operand.hpp"
#include "core/kokkos_types.hpp"
#include "core/run_context.hpp"
#include "core/workspace.hpp"

namespace kmoe {

// The first key position t reads: its document's start, and within the window (0: none).
KOKKOS_INLINE_FUNCTION int first_key(int t, int doc_start, int window) {
  const int w = window > 0 ? t - window + 1 : 0;
  return doc_start > w ? doc_start : w;
}

// The host's document plan (DocStarts::tile_start) is made per this many rows of a sequence:
// the tiled core's query tiles.
constexpr int kAttentionPlanRows = 64;

// The shape of one core: heads, kv heads, head width and sequence length; max_seqs the most
// sequences of a call.
struct AttentionDims {
  int H = 0, Hkv = 0, dh = 0, T = 0, max_seqs = 0;
  int window = 0;  // model.sliding_window of the block (0: none)
  int G() const { return H / Hkv; }
};

// The inputs of a call: q, k, v in the layouts above.
struct AttentionInputs {
  const KeptOperand& q;
  const KeptOperand& k;
  const KeptOperand& v;
};

// Bytes a core takes for max_seqs sequences (checked: the planner sizes any deck): its saved
// state (kept from forward to backward) and the deepest workspace of its forward and of its
// backward (Workspace::rounded buffers).
struct AttentionCoreSizes {
  Size saved, forward_workspace, backward_workspace;
};

class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  // The name the start-up log gives the path ("tiled").
  virtual const char* name() const = 0;
  // heads (nseq * H * T * dh, q's layout) = the masked attention of q, k, v; keeps what
  // backward needs (`docs` must stay valid until then). Temporaries from `ws`.
  virtual void forward(const AttentionInputs& in, int nseq, const DocStarts& docs, float* heads,
                       Workspace& ws) = 0;
  // From the last forward's state: d_heads holds dO on entry, dQ on return; d_k, d_v assigned.
  // d_heads16 (bf16 runs; else nullptr): dO rounded to bf16 in the same layout, written by the
  // kernel that made dO, for a core whose products read it.
  virtual void backward(const AttentionInputs& in, int nseq, float* d_heads,
                        const std::uint16_t* d_heads16, float* d_k, float* d_v, Workspace& ws) = 0;
  // The score entries the last forward computed (a core that forms no scores: 0).
  virtual std::int64_t scores_computed() const = 0;
};

// The attention paths a build has. Tiled: blocked GEMMs over the causal band of scores, the
// probabilities kept (tiled_attention.hpp). Fused: one Kokkos kernel per direction streaming key
// blocks through team scratch with an online softmax, the output and log-sum-exp kept
// (fused_attention.hpp).
enum class AttentionPath { Tiled, Fused };
const char* attention_path_name(AttentionPath p);

// The one place that chooses a block's path from train.attention (RunContext::attention), with
// the reason the start-up log prints. auto takes the tiled core on every backend until the fused
// kernels are timed on GPUs (docs/PERFORMANCE.md); on CPUs the tiled core's BLAS products are
// the faster.
struct AttentionChoice {
  AttentionPath path = AttentionPath::Tiled;
  std::string why;
};
AttentionChoice choose_attention_path(AttentionKernel requested, const ModelCfg& m);

std::unique_ptr<AttentionCore> make_attention_core(AttentionPath path, const RunContext& ctx,
                                                   const AttentionDims& dims);
AttentionCoreSizes attention_core_sizes(AttentionPath path, const AttentionDims& dims, bool bf16);

}  // namespace kmoe
