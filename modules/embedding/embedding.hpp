// Token embedding (MODEL.md section 1): x = Embed[tokens], no scaling. The backward scatter-add
// groups positions by token id (KeyBuckets) so the sum order is fixed on every backend.
#pragma once

#include <cstdint>

#include "core/bucket_sort.hpp"
#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"

namespace kmoe {

class Embedding {
 public:
  // Declares embed.weight [V, D] (no weight decay).
  Embedding(int vocab, int d_model, double init_std, int max_tokens, TensorTable& table);
  // embed.weight's declaration; the last pipeline stage's tied copy declares the same.
  static TensorSpec weight_spec(int vocab, int d_model, double init_std);

  int weight_index() const { return weight_; }
  // x: (N, D); x16 (bf16 runs): where x is also written rounded to bf16, for products.
  void forward(const TensorTable& table, ConstIVec tokens, Mat x, std::uint16_t* x16 = nullptr);
  void backward(TensorTable& table, ConstIVec tokens, ConstMat dx);  // embed grad +=

 private:
  int V_, D_, weight_;
  KeyBuckets buckets_;
};

}  // namespace kmoe
