// How one run computes: the settings read once from the deck (train.precision) and the
// execution plan (host threads for batched products), and the activation memory the run's
// stages share. Built once by the program (make_run_context), passed explicitly to Stage, the
// layers and the GEMM entry points, as the stage plan and the communicators are; a layer keeps
// the copy it was built with. There is no process-wide setting behind it: two contexts of
// different precision live side by side in one process and each computes as it says.
#pragma once

#include <string>

#include "core/config.hpp"

namespace kmoe {

class ActivationPool;

struct RunContext {
  // train.precision: how GEMMs treat their inputs (gemm.hpp, MODEL.md section 8), and whether
  // kept operands are stored as bf16 (kept_operand.hpp).
  Precision precision = Precision::Fp32;
  // Host threads that run the products of one strided batch, or the MoE experts, side by side
  // (gemm.hpp: gemm_strided_batched). make_run_context keeps 1 where the build has no host
  // BLAS on host memory.
  int batch_threads = 1;
  // bf16 grouped products through the tensor-core kernel's tiling on any build (tests of that
  // tiling on CPUs; grouped_gemm.hpp). Builds with tensor cores always take it in bf16.
  bool fragment_tiles = false;
  // train.attention: the attention core the blocks ask for (attention_core.hpp decides).
  AttentionKernel attention = AttentionKernel::Auto;
  // The activation memory of a rank's Stage instances (kept_operand.hpp); null: every layer
  // allocates its own. Not owned.
  ActivationPool* pool = nullptr;

  bool bf16() const { return precision == Precision::Bf16; }
  // This context with fp32 inputs: products that stay exact whatever train.precision (the MoE
  // router, MODEL.md section 8).
  RunContext exact_fp32() const {
    RunContext c = *this;
    c.precision = Precision::Fp32;
    return c;
  }
  // This context without the pool (layers outside the blocks: their buffers are their own).
  RunContext unpooled() const {
    RunContext c = *this;
    c.pool = nullptr;
    return c;
  }
};

// A context for `precision` and `batch_threads` (the execution plan's), checked against this
// build: throws, naming train.precision, where the build cannot compute it (tf32 without
// cuBLAS); batch threads drop to 1 without a host BLAS on host memory. `note`, when given,
// receives a line for the start-up log ("" if none). Defined in gemm.cpp.
RunContext make_run_context(Precision precision, int batch_threads = 1,
                            std::string* note = nullptr);

}  // namespace kmoe
