#include "modules/attention/attention_core.hpp"

#include "core/error.hpp"
#include "modules/attention/tiled_attention.hpp"

namespace kmoe {

const char* attention_path_name(AttentionPath p) {
  switch (p) {
    case AttentionPath::Tiled:
      return "tiled";
  }
  return "?";
}

AttentionChoice choose_attention_path(const ModelCfg& /*m*/, bool /*bf16*/) {
  AttentionChoice c;
  c.path = AttentionPath::Tiled;
  c.why = "blocked GEMMs over the causal band, the probabilities kept; the one path of this build";
  return c;
}

std::unique_ptr<AttentionCore> make_attention_core(AttentionPath path, const RunContext& ctx,
                                                   const AttentionDims& dims) {
  switch (path) {
    case AttentionPath::Tiled:
      return std::make_unique<TiledAttention>(ctx, dims);
  }
  throw Error(std::string("attention: no core for path ") + attention_path_name(path));
}

AttentionCoreSizes attention_core_sizes(AttentionPath path, const AttentionDims& dims, bool bf16) {
  switch (path) {
    case AttentionPath::Tiled:
      return TiledAttention::sizes(dims, bf16);
  }
  throw Error(std::string("attention: no sizes for path ") + attention_path_name(path));
}

}  // namespace kmoe
