#include "core/kept_operand.hpp"

namespace kmoe {

KeptOperand::KeptOperand(const std::string& label, std::int64_t n) : n_(n) {
  if (gemm_precision() == Precision::Bf16)
    b16_ = Kokkos::View<std::uint16_t*, Layout, MemSpace>(label + " (bf16)", n);
  else
    f32_ = View1F(label, n);
}

}  // namespace kmoe
