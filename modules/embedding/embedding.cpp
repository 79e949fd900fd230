#include "modules/embedding/embedding.hpp"

#include "core/bf16.hpp"

namespace kmoe {

TensorSpec Embedding::weight_spec(int vocab, int d_model, double init_std) {
  return TensorSpec::matrix("embed.weight", {vocab, d_model}, init_std).no_decay();
}

Embedding::Embedding(int vocab, int d_model, double init_std, int max_tokens, TensorTable& table)
    : V_(vocab), D_(d_model), buckets_(max_tokens, vocab) {
  weight_ = table.add(weight_spec(vocab, d_model, init_std));
}

void Embedding::forward(const TensorTable& table, ConstIVec tokens, Mat x, std::uint16_t* x16) {
  const int N = tokens.extent(0), D = D_;
  auto w = as_cmat(table.param(weight_), V_, D_);
  Kokkos::parallel_for(
      "embed::forward", Range2({0, 0}, {N, D}), KOKKOS_LAMBDA(int r, int d) {
        const float v = w(tokens(r), d);
        x(r, d) = v;
        if (x16) x16[std::int64_t(r) * D + d] = bf16_bits(v);
      });
}

void Embedding::backward(TensorTable& table, ConstIVec tokens, ConstMat dx) {
  buckets_.build(tokens);
  auto off = buckets_.offsets;
  auto ord = buckets_.order;
  auto dw = as_mat(table.grad(weight_), V_, D_);
  Kokkos::parallel_for(
      "embed::backward", Range2({0, 0}, {V_, D_}), KOKKOS_LAMBDA(int v, int d) {
        float acc = 0.0f;
        for (int a = off(v); a < off(v + 1); ++a) acc += dx(ord(a), d);
        if (off(v + 1) > off(v)) dw(v, d) += acc;
      });
}

}  // namespace kmoe
