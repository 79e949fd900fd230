// Grouped GEMMs whose group sizes live on the device: the MoE experts' products in one launch
// each, with no host read of the experts' row counts (ARCHITECTURE.md "Host synchronizations").
//
// Rows are grouped as the MoE dispatch lays them out: group g owns rows [off(g), off(g+1)) of
// row-major operands; `off` (groups + 1 entries) is read only by the kernels. The launch covers
// an upper bound of the tiles (max_rows / tile + groups row tiles); tiles past the last group's
// rows return at once.
//
// A tiled team kernel (tiles in team scratch, one thread per output element per k-step): every
// output element is summed in ascending k by one thread, so results are bit-identical run to
// run on every backend; they differ from vendor BLAS in the last bits. In bf16 runs the inputs
// are rounded to bf16 as they are loaded and the sums stay fp32; on CUDA builds for compute
// capability 8.0 and later (grouped_gemm_tensor_cores()) the bf16 products run on the tensor
// cores instead: the same 32 x 32 tiles, staged as bf16 in scratch, each 16 x 16 quarter summed
// by one warp in an nvcuda::wmma fp32 accumulator (fixed order too: bit-identical run to run).
// HIP builds have no WMMA here (rocWMMA is not used): their bf16 products take the tiled kernel
// above, as on CPUs.
// Vendor BLAS stays the choice on host backends (moe.expert_gemm = auto), where reading the
// offsets costs nothing.
#pragma once

#include <cstdint>

#include "core/gemm.hpp"
#include "core/kokkos_types.hpp"

namespace kmoe {

// A grouped product's row-major input: fp32, or the bf16 values a bf16 run keeps (bf16.hpp).
struct GroupedSrc {
  const float* f32 = nullptr;
  const std::uint16_t* b16 = nullptr;
  GroupedSrc(const float* p) : f32(p) {}                     // NOLINT: fp32 rows as they are
  GroupedSrc(const Operand& x) : f32(x.f32), b16(x.b16) {}  // NOLINT: a (kept) operand's rows
};

// Whether this build's bf16 grouped products run on tensor cores (CUDA, compute capability 8.0
// and later): the start-up log and the tests say which kernel ran.
bool grouped_gemm_tensor_cores();

class GroupedGemm {
 public:
  // Products in ctx's precision; ctx.fragment_tiles: bf16 products through the tensor-core
  // kernel's tiling on any build, its fragments computed by one thread where there are no tensor
  // cores (the same staging, layouts and edges as on the GPU, checked on CPUs). Builds with
  // tensor cores always take that kernel in bf16.
  GroupedGemm(const RunContext& ctx, int groups);

  // Reads `off` on the device into the tile map that later calls use; `max_rows`: the most rows
  // the groups can hold together (a host bound, not the device count). Call again when the
  // offsets change.
  void plan(ConstIVec off, std::int64_t max_rows);

  // Rows: C_g = alpha * A_g op(W_g) + beta * C_g for every group g, where A_g is the group's
  // rows of A (rows x K, row-major), C_g its rows of C (rows x n), and W_g = W + g * w_stride:
  // with tw = T, W_g is (n x K) and op(W_g) = W_g^T; with tw = N, W_g is (K x n). W: fp32
  // weights, or a bf16 run's compute copy.
  void rows(Trans tw, float alpha, GroupedSrc A, int K, GroupedSrc W, std::int64_t w_stride,
            float beta, float* C, int n) const;

  // Weight gradients: G_g += alpha * A_g^T B_g for every group with rows, where A_g are the
  // group's rows of A (rows x m) and B_g of B (rows x n), G_g = G + g * g_stride (m x n). A group
  // without rows leaves G_g untouched.
  void weight_grads(float alpha, GroupedSrc A, int m, GroupedSrc B, int n, float* G,
                    std::int64_t g_stride) const;

  static constexpr int tile = 32;  // rows and columns of an output tile
  static constexpr int depth = 16; // k-step of the tiles in scratch

 private:
  bool bf16_;       // inputs rounded to bf16 as they are loaded
  bool fragments_;  // bf16 products on the fragment kernels
  int groups_;
  std::int64_t max_rows_ = 0;
  ConstIVec off_;
  View1I tile_off_;  // (groups + 1): first row tile of each group
};

}  // namespace kmoe
