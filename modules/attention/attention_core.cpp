#include "modules/attention/attention_core.hpp"

#include "core/error.hpp"
#include "modules/attention/fused_attention.hpp"
#include "modules/attention/tiled_attention.hpp"

namespace kmoe {

const char* attention_path_name(AttentionPath p) {
  switch (p) {
    case AttentionPath::Tiled:
      return "tiled";
    case AttentionPath::Fused:
      return "fused";
  }
  return "?";
}

AttentionChoice choose_attention_path(AttentionKernel requested, const ModelCfg& /*m*/) {
  AttentionChoice c;
  switch (requested) {
    case AttentionKernel::Tiled:
      c.path = AttentionPath::Tiled;
      c.why = "train.attention = tiled: blocked GEMMs over the causal band, the probabilities kept";
      break;
    case AttentionKernel::Fused:
      c.path = AttentionPath::Fused;
      c.why =
          "train.attention = fused: key blocks streamed with an online softmax, no score "
          "matrix kept";
      break;
    case AttentionKernel::Auto:
      c.path = AttentionPath::Tiled;
      c.why =
          "train.attention = auto: the tiled core, the faster on CPUs (the fused core is "
          "train.attention = fused)";
      break;
  }
  return c;
}

std::unique_ptr<AttentionCore> make_attention_core(AttentionPath path, const RunContext& ctx,
                                                   const AttentionDims& dims) {
  switch (path) {
    case AttentionPath::Tiled:
      return std::make_unique<TiledAttention>(ctx, dims);
    case AttentionPath::Fused:
      return std::make_unique<FusedAttention>(ctx, dims);
  }
  throw Error(std::string("attention: no core for path ") + attention_path_name(path));
}

AttentionCoreSizes attention_core_sizes(AttentionPath path, const AttentionDims& dims, bool bf16) {
  switch (path) {
    case AttentionPath::Tiled:
      return TiledAttention::sizes(dims, bf16);
    case AttentionPath::Fused:
      return FusedAttention::sizes(dims, bf16);
  }
  throw Error(std::string("attention: no sizes for path ") + attention_path_name(path));
}

}  // namespace kmoe
