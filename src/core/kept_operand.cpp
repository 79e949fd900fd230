#include "core/kept_operand.hpp"

#include "core/buffers.hpp"
#include "core/error.hpp"

namespace kmoe {

KeptOperand::KeptOperand(const std::string& label, std::int64_t n, bool may_be_bf16)
    : label_(label), bf16_(may_be_bf16 && gemm_precision() == Precision::Bf16) {
  if (bf16_)
    b16_ = Kokkos::View<std::uint16_t*, Layout, MemSpace>(label + " (bf16)", n);
  else
    f32_ = View1F(label, n);
}

void KeptOperand::ensure(std::int64_t n) {
  if (bf16_)
    ensure_size(b16_, n, label_ + " (bf16)");
  else
    ensure_size(f32_, n, label_);
}

float* KeptOperand::f32() const {
  KMOE_REQUIRE(!bf16_, label_ << ": kept as bf16, read as fp32");
  return f32_.data();
}

std::uint16_t* KeptOperand::b16() const {
  KMOE_REQUIRE(bf16_, label_ << ": kept as fp32, read as bf16");
  return b16_.data();
}

}  // namespace kmoe
