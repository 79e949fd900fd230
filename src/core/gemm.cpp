#include "core/gemm.hpp"

#include <KokkosBlas3_gemm.hpp>
#include <KokkosKernels_config.h>
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS)
#include <KokkosBlas_Host_tpl.hpp>  // the host BLAS behind Kokkos Kernels' gemm (rows apart)
#endif
#if defined(KOKKOS_ENABLE_CUDA) && defined(KOKKOSKERNELS_ENABLE_TPL_CUBLAS)
#include <KokkosBlas_tpl_spec.hpp>  // the cuBLAS handle Kokkos Kernels' gemm uses
#endif

#include "core/bf16.hpp"
#include "core/buffers.hpp"
#include "core/device_sync.hpp"
#include "core/error.hpp"
#include "core/grouped_gemm.hpp"

namespace kmoe {

namespace {
// Each GEMM entry call reports the Kokkos Tools event "kmoe::gemm <kind>", which
// tests/tools/kokkos_counter counts per step: on CUDA builds one cuBLAS call each (its kernels
// are not Kokkos launches), so launches plus these calls are what a step asks of a GPU.
// A call made inside another one (a strided batch's products through gemm() on CPUs) is not
// counted again: on CUDA it is part of the outer call.
thread_local int g_call_depth = 0;
struct CountedCall {
  explicit CountedCall(const char* event) {
    if (g_call_depth++ == 0 && Kokkos::Tools::profileLibraryLoaded())
      Kokkos::Tools::markEvent(event);
  }
  ~CountedCall() { --g_call_depth; }
  CountedCall(const CountedCall&) = delete;
  CountedCall& operator=(const CountedCall&) = delete;
};

#if defined(KOKKOS_ENABLE_CUDA) && defined(KOKKOSKERNELS_ENABLE_TPL_CUBLAS)
#define KMOE_CUBLAS 1
using Bf16Input = std::uint16_t;  // bf16 bits, as cuBLAS takes them
#else
using Bf16Input = float;  // bf16-valued fp32, as the host BLAS takes them
#endif

// The bf16 copies of a GEMM's two inputs: grown to the largest operand, kept to the end.
Bf16Input* bf16_workspace(int which, std::int64_t n) {
  using V = Kokkos::View<Bf16Input*, Layout, MemSpace>;
  static V* ws = nullptr;
  if (!ws) {
    ws = new V[2];
    Kokkos::push_finalize_hook([] {
      delete[] ws;
      ws = nullptr;
    });
  }
  ensure_size(ws[which], n, "gemm::bf16_inputs");
  return ws[which].data();
}

#if defined(KMOE_CUBLAS)
// cuBLAS on Kokkos' stream for one call; the handle's math mode for it (TF32 or not). Between
// calls the handle keeps the default math: Kokkos Kernels' own calls find it so.
struct CublasCall {
  cublasHandle_t h;
  CublasCall(cublasMath_t mode) : h(KokkosBlas::Impl::CudaBlasSingleton::singleton().handle) {
    cublasSetStream(h, ExecSpace().cuda_stream());
    cublasSetMathMode(h, mode);
  }
  ~CublasCall() {  // as every call finds it: default math, no stream of its own
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
    cublasSetStream(h, nullptr);
  }
};
#endif
}  // namespace

namespace detail {
// dst[i] = src[i] rounded to bf16: as bf16 bits (CUDA) or as the fp32 value (host backends).
void to_bf16(const float* src, std::int64_t n, std::uint16_t* dst) {
  Kokkos::parallel_for(
      "gemm::to_bf16", flat_range(0, n),
      KOKKOS_LAMBDA(std::int64_t i) { dst[i] = bf16_bits(src[i]); });
}
void to_bf16(const float* src, std::int64_t n, float* dst) {
  Kokkos::parallel_for(
      "gemm::round_bf16", flat_range(0, n),
      KOKKOS_LAMBDA(std::int64_t i) { dst[i] = round_bf16(src[i]); });
}
// dst[i] = the bf16 value src[i] as fp32.
void widen_bf16(const std::uint16_t* src, std::int64_t n, float* dst) {
  Kokkos::parallel_for(
      "gemm::widen_bf16", flat_range(0, n),
      KOKKOS_LAMBDA(std::int64_t i) { dst[i] = bf16_to_float(src[i]); });
}
}  // namespace detail

namespace {
// An fp32 operand of a bf16 product rounded at the product's entry: the Kokkos Tools event
// "kmoe::rounded <n>" names the elements, which tests/tools/kokkos_counter sums per step. A
// producing kernel that writes its values as bf16 (KeptOperand, or a bf16 output of its own)
// spares every product that reads them this rounding (docs/PERFORMANCE.md lists what a bf16
// step still rounds here).
void count_rounded(std::int64_t n) {
  if (!Kokkos::Tools::profileLibraryLoaded()) return;
  Kokkos::Tools::markEvent("kmoe::rounded " + std::to_string(n));
}

// The n values of a bf16 product's input `which` (0: A, 1: B) in the form the library takes:
// bf16 bits on CUDA (a bf16 operand as it is), bf16-valued fp32 on CPUs.
#if defined(KMOE_CUBLAS)
const std::uint16_t* bf16_input(int which, const float* f32, const std::uint16_t* b16,
                                std::int64_t n) {
  if (b16) return b16;
  std::uint16_t* ws = bf16_workspace(which, n);
  count_rounded(n);
  detail::to_bf16(f32, n, ws);
  return ws;
}
#else
const float* bf16_input(int which, const float* f32, const std::uint16_t* b16, std::int64_t n) {
  float* ws = bf16_workspace(which, n);
  if (b16) {
    detail::widen_bf16(b16, n, ws);
  } else {
    count_rounded(n);
    detail::to_bf16(f32, n, ws);
  }
  return ws;
}
#endif
}  // namespace

void gemm(const RunContext& ctx, Trans ta, Trans tb, float alpha, const Operand& A,
          const Operand& B, float beta, Mat C) {
  const int m = ta == Trans::N ? A.rows : A.cols, ka = ta == Trans::N ? A.cols : A.rows;
  const int kb = tb == Trans::N ? B.rows : B.cols, n = tb == Trans::N ? B.cols : B.rows;
  KMOE_REQUIRE(ka == kb && m == static_cast<int>(C.extent(0)) && n == static_cast<int>(C.extent(1)),
               "gemm: shape mismatch: op(A) " << m << "x" << ka << ", op(B) " << kb << "x" << n
                                              << ", C " << C.extent(0) << "x" << C.extent(1));
  const bool bf16 = ctx.bf16();
  KMOE_REQUIRE(bf16 || (!A.b16 && !B.b16),
               "gemm: a bf16 operand in a product with fp32 inputs (train.precision = "
                   << choice_name(ctx.precision) << ")");
  if (m == 0 || n == 0) return;
  const CountedCall counted("kmoe::gemm");
  if (ka == 0) {
    // Kokkos Kernels returns early on an empty inner extent and would leave C stale.
    if (beta == 1.0f) return;
    Kokkos::parallel_for(
        "gemm::scale_c", Range2({0, 0}, {m, n}),
        KOKKOS_LAMBDA(int i, int j) { C(i, j) = beta == 0.0f ? 0.0f : beta * C(i, j); });
    return;
  }
  const char* opa = ta == Trans::N ? "N" : "T";
  const char* opb = tb == Trans::N ? "N" : "T";
  if (bf16) {
    const auto* a = bf16_input(0, A.f32, A.b16, std::int64_t(A.rows) * A.cols);
    const auto* b = bf16_input(1, B.f32, B.b16, std::int64_t(B.rows) * B.cols);
#if defined(KMOE_CUBLAS)
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's part comes first.
    CublasCall call(CUBLAS_DEFAULT_MATH);
    const cublasStatus_t st = cublasGemmEx(
        call.h, tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T, ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T,
        n, m, ka, &alpha, b, CUDA_R_16BF, B.cols, a, CUDA_R_16BF, A.cols, &beta, C.data(),
        CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    KMOE_REQUIRE(st == CUBLAS_STATUS_SUCCESS, "cublasGemmEx (bf16) failed (" << int(st) << ")");
#else
    KokkosBlas::gemm(opa, opb, alpha, ConstMat(a, A.rows, A.cols), ConstMat(b, B.rows, B.cols),
                     beta, C);
#endif
    return;
  }
  const ConstMat a(A.f32, A.rows, A.cols), b(B.f32, B.rows, B.cols);
#if defined(KMOE_CUBLAS)
  if (ctx.precision == Precision::Tf32) {  // the TF32 tensor cores for this call
    CublasCall call(CUBLAS_TF32_TENSOR_OP_MATH);
    KokkosBlas::gemm(opa, opb, alpha, a, b, beta, C);
    return;
  }
#endif
  KokkosBlas::gemm(opa, opb, alpha, a, b, beta, C);
}

namespace {
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS) && !defined(KMOE_CUBLAS)
// The host BLAS can take the operands where they are (host backends).
constexpr bool kHostBlas = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
#endif
int ld_of(const Strided& x) { return x.ld > 0 ? x.ld : x.cols; }
// The elements a strided batch's operand spans, from its first to its last.
std::int64_t span(const Strided& x, int batch) {
  return (batch - 1) * x.stride + std::int64_t(x.rows - 1) * ld_of(x) + x.cols;
}

#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS) && !defined(KMOE_CUBLAS)
// A strided batch through the host BLAS Kokkos Kernels' gemm calls, given the leading
// dimensions; bf16 inputs are rounded (or widened) over each operand's span first. `side_by_side`
// runs the products on the host threads at once (each call on one BLAS thread: see
// RunContext::batch_threads), else one after the other.
void host_batch(const RunContext& ctx, Trans ta, Trans tb, float alpha, const Strided& A,
                const Strided& B, float beta, float* C, int m, int n, int ka,
                std::int64_t c_stride, int ldc, int batch, bool side_by_side) {
  const float* a = A.data;
  const float* b = B.data;
  if (ctx.bf16()) {
    a = bf16_input(0, A.data, A.b16, span(A, batch));
    b = bf16_input(1, B.data, B.b16, span(B, batch));
  }
  const char opa = ta == Trans::N ? 'N' : 'T', opb = tb == Trans::N ? 'N' : 'T';
  const int lda = ld_of(A), ldb = ld_of(B);
  const std::int64_t sa = A.stride, sb = B.stride;
  auto product = [=](int i) {
    KokkosBlas::Impl::HostBlas<float>::gemm(opb, opa, n, m, ka, alpha, b + i * sb, ldb, a + i * sa,
                                            lda, beta, C + i * c_stride, ldc);
  };
  if (side_by_side) {
    host_items_side_by_side("gemm::strided_batch_host", batch, ctx.batch_threads,
                            [&](int i, int) { product(i); });
  } else {
    for (int i = 0; i < batch; ++i) product(i);
  }
}
#endif
}  // namespace

void gemm_on_host_thread(Trans ta, Trans tb, float alpha, const Operand& A, const Operand& B,
                         float beta, Mat C) {
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS) && !defined(KMOE_CUBLAS)
  if constexpr (kHostBlas) {
    const int m = ta == Trans::N ? A.rows : A.cols, ka = ta == Trans::N ? A.cols : A.rows;
    const int kb = tb == Trans::N ? B.rows : B.cols, n = tb == Trans::N ? B.cols : B.rows;
    KMOE_REQUIRE(
        ka == kb && m == static_cast<int>(C.extent(0)) && n == static_cast<int>(C.extent(1)),
        "gemm_on_host_thread: shape mismatch: op(A) " << m << "x" << ka << ", op(B) " << kb << "x"
                                                      << n << ", C " << C.extent(0) << "x"
                                                      << C.extent(1));
    KMOE_REQUIRE(A.f32 && B.f32 && !A.b16 && !B.b16,
                 "gemm_on_host_thread: fp32 operands only (a bf16 operand given)");
    if (m == 0 || n == 0) return;
    float* c = C.data();
    if (ka == 0) {  // C = beta C, as gemm() leaves it
      if (beta != 1.0f)
        for (std::int64_t i = 0; i < std::int64_t(m) * n; ++i)
          c[i] = beta == 0.0f ? 0.0f : beta * c[i];
      return;
    }
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's part comes first.
    KokkosBlas::Impl::HostBlas<float>::gemm(tb == Trans::N ? 'N' : 'T', ta == Trans::N ? 'N' : 'T',
                                            n, m, ka, alpha, B.f32, B.cols, A.f32, A.cols, beta, c,
                                            n);
    return;
  }
#endif
  (void)ta, (void)tb, (void)alpha, (void)A, (void)B, (void)beta, (void)C;
  KMOE_REQUIRE(false, "gemm_on_host_thread: this " << ExecSpace::name()
                                                   << " build has no host BLAS on host memory");
}

bool gemm_rows_apart() {
#if defined(KMOE_CUBLAS)
  return true;
#elif defined(KOKKOSKERNELS_ENABLE_TPL_BLAS)
  return kHostBlas;
#else
  return false;
#endif
}

void gemm_strided_batched(const RunContext& ctx, Trans ta, Trans tb, float alpha, Strided A,
                          Strided B, float beta, float* C, int c_rows, int c_cols,
                          std::int64_t c_stride, int batch, int c_ld) {
  KMOE_REQUIRE(ctx.bf16() || (!A.b16 && !B.b16),
               "gemm_strided_batched: a bf16 operand in a product with fp32 inputs");
  const int ka = ta == Trans::N ? A.cols : A.rows, kb = tb == Trans::N ? B.rows : B.cols;
  const int m = ta == Trans::N ? A.rows : A.cols, n = tb == Trans::N ? B.cols : B.rows;
  KMOE_REQUIRE(ka == kb && m == c_rows && n == c_cols,
               "gemm_strided_batched: shape mismatch: op(A) " << m << "x" << ka << ", op(B) " << kb
                                                              << "x" << n << ", C " << c_rows
                                                              << "x" << c_cols);
  const int lda = ld_of(A), ldb = ld_of(B), ldc = c_ld > 0 ? c_ld : c_cols;
  KMOE_REQUIRE(lda >= A.cols && ldb >= B.cols && ldc >= c_cols,
               "gemm_strided_batched: a leading dimension below its matrix's columns");
  if (batch == 0 || m == 0 || n == 0) return;
  const CountedCall counted("kmoe::gemm strided");
  if (ka == 0) {  // C = beta C: the libraries return early on an empty inner extent
    Kokkos::parallel_for(
        "gemm::scale_c_batch", Range2({0, 0}, {batch * m, n}), KOKKOS_LAMBDA(int r, int j) {
          float& c = C[(r / m) * c_stride + std::int64_t(r % m) * ldc + j];
          c = beta == 0.0f ? 0.0f : beta * c;
        });
    return;
  }
#if defined(KMOE_CUBLAS)
  {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's part comes first.
    const cublasOperation_t opb = tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T,
                            opa = ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
    cublasStatus_t st;
    if (ctx.bf16()) {
      const std::uint16_t* a = bf16_input(0, A.data, A.b16, span(A, batch));
      const std::uint16_t* b = bf16_input(1, B.data, B.b16, span(B, batch));
      CublasCall call(CUBLAS_DEFAULT_MATH);
      st = cublasGemmStridedBatchedEx(call.h, opb, opa, n, m, ka, &alpha, b, CUDA_R_16BF, ldb,
                                      B.stride, a, CUDA_R_16BF, lda, A.stride, &beta, C,
                                      CUDA_R_32F, ldc, c_stride, batch, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT);
    } else {
      CublasCall call(ctx.precision == Precision::Tf32 ? CUBLAS_TF32_TENSOR_OP_MATH
                                                        : CUBLAS_DEFAULT_MATH);
      st = cublasSgemmStridedBatched(call.h, opb, opa, n, m, ka, &alpha, B.data, ldb, B.stride,
                                     A.data, lda, A.stride, &beta, C, ldc, c_stride, batch);
    }
    KMOE_REQUIRE(st == CUBLAS_STATUS_SUCCESS, "strided batched GEMM failed (" << int(st) << ")");
    return;
  }
#endif
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS) && !defined(KMOE_CUBLAS)
  // Host threads: the products side by side, one single-threaded BLAS call each (the same
  // call Kokkos Kernels makes for each; a single-column N x N product is its gemv instead).
  if constexpr (kHostBlas) {
    if (ctx.batch_threads > 1 && batch > 1 && !(ta == Trans::N && tb == Trans::N && n == 1)) {
      host_batch(ctx, ta, tb, alpha, A, B, beta, C, m, n, ka, c_stride, ldc, batch, true);
      return;
    }
  }
#endif
  if (lda == A.cols && ldb == B.cols && ldc == c_cols) {
    auto part = [](const Strided& X, int b) {  // product b's operand
      return Operand{X.data ? X.data + b * X.stride : nullptr,
                     X.b16 ? X.b16 + b * X.stride : nullptr, X.rows, X.cols};
    };
    for (int b = 0; b < batch; ++b)
      gemm(ctx, ta, tb, alpha, part(A, b), part(B, b), beta,
           as_mat(C + b * c_stride, c_rows, c_cols));
    return;
  }
  KMOE_REQUIRE(gemm_rows_apart(),
               "gemm_strided_batched: rows apart (leading dimensions above the columns) need "
               "cuBLAS or a host BLAS; this "
                   << ExecSpace::name() << " build has neither");
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS) && !defined(KMOE_CUBLAS)
  if constexpr (kHostBlas)
    host_batch(ctx, ta, tb, alpha, A, B, beta, C, m, n, ka, c_stride, ldc, batch, false);
#endif
}

const void* const* GemmGroupTables::device(const std::vector<const void*>& ptrs) {
  std::vector<std::uintptr_t> words(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) words[i] = reinterpret_cast<std::uintptr_t>(ptrs[i]);
  if (words != last_ || uploads_ == 0) {
    if (uploads_ == kUploads) {
      varying_ = true;
      return nullptr;
    }
    ++uploads_;
    ensure_size(dev_, std::int64_t(words.size()), "gemm::group_tables");
    mark_host_sync("gemm group tables");
    Kokkos::deep_copy(
        Kokkos::subview(dev_, std::make_pair(std::size_t(0), words.size())),
        Kokkos::View<const std::uintptr_t*, HostSpace, Unmanaged>(words.data(), words.size()));
    last_ = std::move(words);
  }
  return reinterpret_cast<const void* const*>(dev_.data());
}

namespace {
// What grouped batches do on this build, once a call has decided it (CUDA: whether cuBLAS took
// the fp32 and the bf16 forms).
std::string g_grouped_note;

// A grouped batch's operand side (0: A, 1: B), each group's first element in the form the
// library takes: fp32 as given, or in bf16 runs the bf16 inputs (bf16_input) of the span the
// groups cover together, rounded once, each group's pointer moved onto them.
[[maybe_unused]] std::vector<const void*> group_inputs(const RunContext& ctx, int side,
                                                       const std::vector<GemmGroup>& groups) {
  auto operand = [side](const GemmGroup& g) -> const Strided& { return side == 0 ? g.A : g.B; };
  const bool b16 = operand(groups[0]).b16 != nullptr;  // one type a side (checked by the caller)
  std::vector<const void*> first;
  for (const GemmGroup& g : groups) {
    const Strided& x = operand(g);
    first.push_back(b16 ? static_cast<const void*>(x.b16) : static_cast<const void*>(x.data));
  }
  if (!ctx.bf16()) return first;
  const std::size_t size = b16 ? sizeof(std::uint16_t) : sizeof(float);
  const char* lo = nullptr;
  const char* hi = nullptr;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const char* p = static_cast<const char*>(first[i]);
    const char* end = p + span(operand(groups[i]), groups[i].count) * size;
    lo = lo && lo < p ? lo : p;
    hi = hi && hi > end ? hi : end;
  }
  const std::int64_t n = (hi - lo) / std::int64_t(size);
  const auto* rounded = b16 ? bf16_input(side, nullptr, reinterpret_cast<const std::uint16_t*>(lo), n)
                            : bf16_input(side, reinterpret_cast<const float*>(lo), nullptr, n);
  for (auto& p : first)
    p = rounded + (static_cast<const char*>(p) - lo) / std::int64_t(size);
  return first;
}
}  // namespace

std::string grouped_batch_note() { return g_grouped_note; }

void gemm_grouped_batched(const RunContext& ctx, Trans ta, Trans tb, float alpha, float beta,
                          const std::vector<GemmGroup>& groups_in, GemmGroupTables& tables) {
  // The groups with products; any with an empty inner extent go through the strided batch,
  // which sets C = beta C for them.
  std::vector<GemmGroup> groups;
  bool empty_inner = false;
  for (const GemmGroup& g : groups_in) {
    const int ka = ta == Trans::N ? g.A.cols : g.A.rows, kb = tb == Trans::N ? g.B.rows : g.B.cols;
    const int m = ta == Trans::N ? g.A.rows : g.A.cols, n = tb == Trans::N ? g.B.cols : g.B.rows;
    KMOE_REQUIRE(ka == kb && m == g.c_rows && n == g.c_cols && g.count >= 0,
                 "gemm_grouped_batched: group " << groups.size() << ": op(A) " << m << "x" << ka
                                                << ", op(B) " << kb << "x" << n << ", C "
                                                << g.c_rows << "x" << g.c_cols << ", "
                                                << g.count << " products");
    KMOE_REQUIRE(ld_of(g.A) >= g.A.cols && ld_of(g.B) >= g.B.cols &&
                     (g.c_ld > 0 ? g.c_ld : g.c_cols) >= g.c_cols,
                 "gemm_grouped_batched: a leading dimension below its matrix's columns");
    KMOE_REQUIRE(ctx.bf16() || (!g.A.b16 && !g.B.b16),
                 "gemm_grouped_batched: a bf16 operand in a product with fp32 inputs");
    if (g.count == 0 || m == 0 || n == 0) continue;
    empty_inner = empty_inner || ka == 0;
    groups.push_back(g);
  }
  if (groups.empty()) return;
  (void)tables;  // device pointer tables: CUDA builds only
  auto one_batch_each = [&] {
    for (const GemmGroup& g : groups)
      gemm_strided_batched(ctx, ta, tb, alpha, g.A, g.B, beta, g.C, g.c_rows, g.c_cols,
                           g.c_stride, g.count, g.c_ld);
  };
  if (empty_inner) return one_batch_each();
  // One type a side, bf16 or fp32 (a grouped call takes one), refused alike on every build.
  for (int side = 0; side < 2; ++side)
    for (const GemmGroup& g : groups) {
      const Strided& x = side == 0 ? g.A : g.B;
      const bool b16 = (side == 0 ? groups[0].A : groups[0].B).b16 != nullptr;
      KMOE_REQUIRE((x.b16 != nullptr) == b16 && (b16 || x.data),
                   "gemm_grouped_batched: groups whose " << (side == 0 ? "A" : "B")
                                                         << " operands are not all bf16 or all fp32");
    }
#if defined(KMOE_CUBLAS) && CUBLAS_VERSION >= 120500
  {
    // cuBLAS' grouped batch; whether it takes this call's types is known after the first call.
    static int taken[2] = {-1, -1};  // fp32/tf32, bf16: -1 not yet known, 0 refused, 1 taken
    const int kind = ctx.bf16() ? 1 : 0;
    if (taken[kind] != 0 && !tables.varying()) {
      const std::vector<const void*> a = group_inputs(ctx, 0, groups), b = group_inputs(ctx, 1, groups);
      const std::size_t size = ctx.bf16() ? sizeof(std::uint16_t) : sizeof(float);
      const int G = static_cast<int>(groups.size());
      std::vector<const void*> ptrs;  // every product's A, then B, then C
      std::vector<int> m(G), n(G), k(G), lda(G), ldb(G), ldc(G), count(G);
      for (int g = 0; g < G; ++g) {
        const GemmGroup& x = groups[g];
        for (int i = 0; i < x.count; ++i)
          ptrs.push_back(static_cast<const char*>(a[g]) + i * x.A.stride * std::int64_t(size));
        m[g] = x.c_rows;
        n[g] = x.c_cols;
        k[g] = ta == Trans::N ? x.A.cols : x.A.rows;
        lda[g] = ld_of(x.A);
        ldb[g] = ld_of(x.B);
        ldc[g] = x.c_ld > 0 ? x.c_ld : x.c_cols;
        count[g] = x.count;
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < groups[g].count; ++i)
          ptrs.push_back(static_cast<const char*>(b[g]) + i * groups[g].B.stride * std::int64_t(size));
      for (const GemmGroup& x : groups)
        for (int i = 0; i < x.count; ++i) ptrs.push_back(x.C + i * x.c_stride);
      const std::int64_t total = std::int64_t(ptrs.size()) / 3;
      const void* const* d = tables.device(ptrs);
      if (!d) return one_batch_each();  // tables that change from call to call
      const CountedCall counted("kmoe::gemm grouped");
      const std::vector<cublasOperation_t> opb(G, tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T),
          opa(G, ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T);
      const std::vector<float> alphas(G, alpha), betas(G, beta);
      const cudaDataType_t in = ctx.bf16() ? CUDA_R_16BF : CUDA_R_32F;
      const bool tf32 = ctx.precision == Precision::Tf32;
      CublasCall call(CUBLAS_DEFAULT_MATH);
      // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's part comes first.
      const cublasStatus_t st = cublasGemmGroupedBatchedEx(
          call.h, opb.data(), opa.data(), n.data(), m.data(), k.data(), alphas.data(),
          d + total, in, ldb.data(), d, in, lda.data(), betas.data(),
          const_cast<void* const*>(reinterpret_cast<const void* const*>(d + 2 * total)),
          CUDA_R_32F, ldc.data(), G, count.data(),
          tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
      const bool refused =
          st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE;
      if (taken[kind] == -1 && refused) {
        taken[kind] = 0;
        g_grouped_note += std::string(g_grouped_note.empty() ? "" : "; ") +
                          "cuBLAS refused a grouped batch with " +
                          (kind ? "bf16 inputs" : "fp32 inputs") + " (status " +
                          std::to_string(int(st)) + "): one strided batch per group instead";
      } else {
        KMOE_REQUIRE(st == CUBLAS_STATUS_SUCCESS,
                     "cublasGemmGroupedBatchedEx failed (" << int(st) << ")");
        if (taken[kind] == -1)
          g_grouped_note += std::string(g_grouped_note.empty() ? "" : "; ") +
                            "grouped batches with " + (kind ? "bf16" : "fp32") +
                            " inputs: one cublasGemmGroupedBatchedEx call each";
        taken[kind] = 1;
        return;
      }
    }
    return one_batch_each();
  }
#elif defined(KOKKOSKERNELS_ENABLE_TPL_BLAS) && !defined(KMOE_CUBLAS)
  if constexpr (kHostBlas) {
    const CountedCall counted("kmoe::gemm grouped");
    const std::vector<const void*> a = group_inputs(ctx, 0, groups), b = group_inputs(ctx, 1, groups);
    std::vector<int> start{0};  // the first product of each group, in one numbering
    for (const GemmGroup& g : groups) start.push_back(start.back() + g.count);
    const char opa = ta == Trans::N ? 'N' : 'T', opb = tb == Trans::N ? 'N' : 'T';
    auto product = [&](int item) {
      const int g = int(std::upper_bound(start.begin(), start.end(), item) - start.begin()) - 1;
      const GemmGroup& x = groups[g];
      const std::int64_t i = item - start[g];
      const int ka = ta == Trans::N ? x.A.cols : x.A.rows;
      // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's part comes first.
      KokkosBlas::Impl::HostBlas<float>::gemm(
          opb, opa, x.c_cols, x.c_rows, ka, alpha,
          static_cast<const float*>(b[g]) + i * x.B.stride, ld_of(x.B),
          static_cast<const float*>(a[g]) + i * x.A.stride, ld_of(x.A), beta,
          x.C + i * x.c_stride, x.c_ld > 0 ? x.c_ld : x.c_cols);
    };
    if (ctx.batch_threads > 1 && start.back() > 1)
      host_items_side_by_side("gemm::grouped_batch_host", start.back(), ctx.batch_threads,
                              [&](int i, int) { product(i); });
    else
      for (int i = 0; i < start.back(); ++i) product(i);
    return;
  }
#endif
  if (g_grouped_note.empty())
    g_grouped_note = "grouped batches: one strided batch per group (no grouped call on this build)";
  one_batch_each();
}

namespace {
// Checks that this build computes `p`; the line for the start-up log ("" if none).
std::string precision_note(Precision p) {
#if defined(KMOE_CUBLAS)
  if (p != Precision::Bf16) return "";
  return std::string(
             "train.precision = bf16 on CUDA: products through cuBLAS with bf16 inputs and "
             "fp32 sums; the grouped expert GEMMs on ") +
         (grouped_gemm_tensor_cores()
              ? "the tensor cores"
              : "CUDA cores (tensor cores need a build for compute capability 8.0 or later)");
#else
  // No cuBLAS (kmoe's CUDA builds require it): host backends and HIP. bf16 is the rounded
  // inputs through the fp32 vendor BLAS (on the device for HIP: rocBLAS behind Kokkos Kernels).
  constexpr bool host = Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
  KMOE_REQUIRE(p != Precision::Tf32,
               "train.precision = tf32: the "
                   << ExecSpace::name() << " backend has no TF32 GEMMs here ("
                   << (host ? "a GPU feature" : "cuBLAS' TF32 math mode, CUDA builds only")
                   << "); use fp32, or bf16 (emulated: bf16 inputs summed in fp32)");
  if (p != Precision::Bf16) return "";
  // The vendor GEMM behind Kokkos Kernels for this memory space, if it has one.
#if defined(KOKKOSKERNELS_ENABLE_TPL_ROCBLAS)
  constexpr bool device_vendor = true;
#else
  constexpr bool device_vendor = false;
#endif
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS)  // (MKL and ARMPL define it too)
  constexpr bool host_vendor = true;
#else
  constexpr bool host_vendor = false;
#endif
  const char* blas = !(host ? host_vendor : device_vendor)
                         ? "Kokkos Kernels' native fp32 GEMM (KMOE_ALLOW_NATIVE_GEMM: no vendor BLAS)"
                     : host ? "the fp32 BLAS"
                            : "rocBLAS' fp32 GEMM";
  return std::string("train.precision = bf16 on the ") + ExecSpace::name() +
         " backend: GEMM inputs rounded to bf16, summed by " + blas +
         (host ? " (the bf16 numerics of a GPU run, not its speed)"
               : "; the grouped expert GEMMs on kmoe's tiled kernel, bf16 rounded as loaded (no "
                 "WMMA here). bf16's numerics and activation memory, not its GEMM speed: kmoe has "
                 "no rocBLAS bf16 path yet");
#endif
}
}  // namespace

RunContext make_run_context(Precision precision, int batch_threads, std::string* note) {
  RunContext ctx;
  const std::string line = precision_note(precision);
  if (note) *note = line;
  ctx.precision = precision;
#if defined(KOKKOSKERNELS_ENABLE_TPL_BLAS) && !defined(KMOE_CUBLAS)
  // Device paths: one GEMM at a time, as on a GPU (no host threads beside each other).
  ctx.batch_threads = kHostBlas && !device_paths() && batch_threads > 1 ? batch_threads : 1;
#else
  ctx.batch_threads = 1;  // no host BLAS on host memory: nothing to run side by side
  (void)batch_threads;
#endif
  return ctx;
}

}  // namespace kmoe
