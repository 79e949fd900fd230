// C = alpha * op(A) op(B) + beta * C on contiguous row-major views, one KokkosBlas::gemm call
// (vendor BLAS underneath). Shapes are checked here: Kokkos Kernels checks only in debug builds.
//
// The run context's precision (train.precision, run_context.hpp) says how a GEMM treats its inputs
// (MODEL.md section 8): fp32; TF32 tensor cores (CUDA); bf16: A and B rounded to bf16 (nearest,
// ties to even), products summed and C kept in fp32 (cublasGemmEx with bf16 inputs on CUDA; on
// CPUs the rounded values go through the fp32 BLAS, the same numbers up to the order of the
// sums). A GEMM whose inputs stay fp32 whatever the run's precision (the router) is given
// ctx.exact_fp32().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "core/config.hpp"
#include "core/kokkos_types.hpp"
#include "core/run_context.hpp"

namespace kmoe {

enum class Trans { N, T };

// A contiguous row-major matrix operand: fp32 values, or bf16 values (`b16`, the bits of
// bf16.hpp) that a bf16 run keeps for its products. On CUDA the bf16 values go to cuBLAS as
// they are; on CPUs they are widened into the fp32 BLAS's input.
struct Operand {
  const float* f32 = nullptr;
  const std::uint16_t* b16 = nullptr;
  int rows = 0, cols = 0;
};
inline Operand operand(ConstMat m) {
  return {m.data(), nullptr, static_cast<int>(m.extent(0)), static_cast<int>(m.extent(1))};
}
// Rows [r0, r0 + n) of a row-major operand.
inline Operand rows_of(const Operand& x, int r0, int n) {
  const std::int64_t at = std::int64_t(r0) * x.cols;
  return {x.f32 ? x.f32 + at : nullptr, x.b16 ? x.b16 + at : nullptr, n, x.cols};
}

// op(A): [m, k], op(B): [k, n], C: [m, n]. A bf16 operand needs ctx.precision = bf16.
void gemm(const RunContext& ctx, Trans ta, Trans tb, float alpha, const Operand& A,
          const Operand& B, float beta, Mat C);
inline void gemm(const RunContext& ctx, Trans ta, Trans tb, float alpha, ConstMat A, ConstMat B,
                 float beta, Mat C) {
  gemm(ctx, ta, tb, alpha, operand(A), operand(B), beta, C);
}
inline void gemm(const RunContext& ctx, Trans ta, Trans tb, float alpha, const Operand& A,
                 ConstMat B, float beta, Mat C) {
  gemm(ctx, ta, tb, alpha, A, operand(B), beta, C);
}
inline void gemm(const RunContext& ctx, Trans ta, Trans tb, float alpha, ConstMat A,
                 const Operand& B, float beta, Mat C) {
  gemm(ctx, ta, tb, alpha, operand(A), B, beta, C);
}

// A strided batch of products: for b in [0, batch), C_b = alpha op(A_b) op(B_b) + beta C_b, with
// X_b = X + b * stride_x, each a row-major matrix of the shape given (as gemm()'s operands)
// whose rows lie `ld` elements apart (0: its cols, contiguous). One cublasSgemmStridedBatched
// (cublasGemmStridedBatchedEx in bf16 runs) on CUDA builds with cuBLAS; gemm() per product
// elsewhere (vendor BLAS on CPUs), the host BLAS directly for rows apart.
struct Strided {
  const float* data;
  int rows, cols;
  std::int64_t stride;
  const std::uint16_t* b16 = nullptr;  // bf16 values instead of `data` (an Operand's b16)
  int ld = 0;                          // elements from one row to the next; 0: cols
};
// With ctx.batch_threads host threads for the products of one strided batch (host backends with a
// host BLAS): with more than 1, gemm_strided_batched runs a batch's products side by side on the
// host execution space, one BLAS call each, instead of one after the other with the BLAS's own
// threads (many small products, as attention's, thread poorly inside each). Only for a BLAS
// that runs one thread per call there (apply_execution decides: an OpenBLAS that is sequential,
// OpenMP under Kokkos' OpenMP backend (one thread inside a parallel region) or set to one
// thread). The products of a one-thread BLAS, bit for bit. The MoE experts use the same threads
// (expert_threads in moe.hpp). Always 1 on builds without a host BLAS on host memory
// (make_run_context).
void gemm_strided_batched(const RunContext& ctx, Trans ta, Trans tb, float alpha, Strided A,
                          Strided B, float beta, float* C, int c_rows, int c_cols,
                          std::int64_t c_stride, int batch, int c_ld = 0);

// One group of a grouped batch: `count` products of one shape, laid out as a strided batch's
// (gemm_strided_batched): product b reads A + b * A.stride and B + b * B.stride and writes the
// (c_rows, c_cols) matrix at C + b * c_stride, its rows c_ld apart (0: c_cols).
struct GemmGroup {
  Strided A, B;
  float* C;
  int c_rows, c_cols;
  std::int64_t c_stride;
  int count;
  int c_ld = 0;
};

// The device-side pointer tables of a caller's grouped batches (CUDA builds: cuBLAS takes a
// grouped batch's operands as arrays of device pointers), kept between calls: a call whose
// pointers are the last call's uploads nothing, so a caller that makes the same grouped call
// each micro-batch (one object per call site) copies its tables once. Empty elsewhere.
class GemmGroupTables {
 public:
  // The tables holding `ptrs` (A's pointers, then B's, then C's), on the device: uploaded when
  // they differ from the last call's, a named host wait. Pointers that keep changing (document
  // masking's runs of sequences differ from micro-batch to micro-batch) would make that a wait
  // per call: after kUploads uploads, a change returns nullptr instead, and the caller runs one
  // strided batch per group (more launches, no wait).
  const void* const* device(const std::vector<const void*>& ptrs);
  static constexpr int kUploads = 3;  // the first, and workspace growth in the first steps
  // Whether device() has refused a change: the caller may go to its strided batches at once,
  // before forming (and, in bf16 runs, rounding) what the tables would hold.
  bool varying() const { return varying_; }

 private:
  std::vector<std::uintptr_t> last_;                     // the pointers last uploaded
  int uploads_ = 0;
  bool varying_ = false;
  Kokkos::View<std::uintptr_t*, Layout, MemSpace> dev_;  // as words: a View takes no void*
};

// A grouped batch: for every group g and product b in it, C = alpha op(A) op(B) + beta C, as
// gemm_strided_batched on each group, in one call where the build allows: one
// cublasGemmGroupedBatchedEx on CUDA builds with cuBLAS 12.5 or later (where cuBLAS refuses the
// call's types, as it may for bf16 inputs with fp32 results, one strided batch per group, and
// grouped_batch_note() says so); on host backends with a host BLAS every product one host BLAS
// call, side by side on ctx.batch_threads host threads when there are several (bit for bit the
// products one after the other); one strided batch per group elsewhere. bf16 inputs are rounded
// once over the span the groups' operands cover together, not once per group. The products of
// different groups may run at once: their C matrices must not overlap.
void gemm_grouped_batched(const RunContext& ctx, Trans ta, Trans tb, float alpha, float beta,
                          const std::vector<GemmGroup>& groups, GemmGroupTables& tables);

// How this device build runs grouped batches, once the first call has decided it (CUDA: whether
// cuBLAS took them); "" on host backends, whose products are host BLAS calls anyway.
std::string grouped_batch_note();

// One product on the calling host thread, for products a caller already runs side by side on
// the host threads (ctx.batch_threads > 1, as the MoE experts' per-expert GEMMs): the
// single call of the host BLAS that gemm() makes on fp32 row-major operands, on one thread: the
// numbers of gemm() with a one-thread BLAS. Not for a single-column N x N product (gemm() runs
// that as a gemv). fp32 operands only (a bf16 operand is an error); a build without a host BLAS
// on host memory never has batch threads and throws here.
void gemm_on_host_thread(Trans ta, Trans tb, float alpha, const Operand& A, const Operand& B,
                         float beta, Mat C);

// Runs f(item, slot) (a kernel named `label` to the profiling tools) for every item in [0, items)
// on up to `slots` host threads, each taking the next item as it comes free (items of uneven size
// balance); slot, below `slots`, is the thread's own index for its scratch. Returns when every item
// is done. On a host space without threads (Serial) the items run in order on slot 0. The first
// exception an item throws is rethrown here once the threads are done; items not yet taken are
// skipped.
template <class F>
void host_items_side_by_side(const char* label, int items, int slots, const F& f) {
  using Host = Kokkos::DefaultHostExecutionSpace;
  using Policy = Kokkos::TeamPolicy<Host>;
  slots = std::max(1, std::min(slots, items));
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // written by the one thread that sets `failed`
  Kokkos::parallel_for(label, Policy(slots, 1), [&](const typename Policy::member_type& tm) {
    for (int i = next++; i < items && !failed; i = next++) {
      try {
        f(i, tm.league_rank());
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
  });
  if constexpr (!std::is_same_v<Host, ExecSpace>) Host().fence();
  if (error) std::rethrow_exception(error);
}

// Whether gemm_strided_batched takes rows apart (ld larger than cols) at the vendor BLAS's speed
// on this build: CUDA with cuBLAS, and host backends with Kokkos Kernels' BLAS TPL (every build
// kmoe accepts but HIP, where such a batch is an error).
bool gemm_rows_apart();

}  // namespace kmoe
