// Deterministic column reductions with enough parallelism for a GPU: out(c) += sum_r f(r, c)
// over rows r of an (rows, cols) operand, in two fixed-order stages. Stage 1: each block of
// kRowBlock rows sums its rows in order, per column (a work item takes a chunk of columns:
// contiguous row segments and vector accumulators on CPUs, one column per thread on GPUs so a
// warp reads one row); stage 2: each column sums the blocks in order. Every column's sum thus
// has the same order on every backend, thread count and chunking: bit-identical results.
#pragma once

#include <cstdint>

#include "core/kokkos_types.hpp"

namespace kmoe {

constexpr int kRowBlock = 128;  // rows per first-stage partial sum

// A workspace of at least n floats for the first stage, grown on first use and kept (one per
// process; released when Kokkos finalizes).
float* column_sums_workspace(std::int64_t n);

namespace detail {
template <int chunk, class F>
void column_sums_in_chunks(const char* name, int rows, int cols, const F& f, Vec out) {
  const int blocks = (rows + kRowBlock - 1) / kRowBlock, chunks = (cols + chunk - 1) / chunk;
  Kokkos::View<float**, Layout, MemSpace, Unmanaged> part(
      column_sums_workspace(std::int64_t(blocks) * cols), blocks, cols);
  Kokkos::parallel_for(
      name, Range2({0, 0}, {blocks, chunks}), KOKKOS_LAMBDA(int b, int k) {
        const int c0 = k * chunk, n = cols - c0 < chunk ? cols - c0 : chunk;
        const int r1 = (b + 1) * kRowBlock < rows ? (b + 1) * kRowBlock : rows;
        float acc[chunk] = {};
        for (int r = b * kRowBlock; r < r1; ++r)
          for (int j = 0; j < n; ++j) acc[j] += f(r, c0 + j);
        for (int j = 0; j < n; ++j) part(b, c0 + j) = acc[j];
      });
  Kokkos::parallel_for(
      "column_sums::blocks", Range(0, cols), KOKKOS_LAMBDA(int c) {
        float acc = 0.0f;
        for (int b = 0; b < blocks; ++b) acc += part(b, c);
        out(c) += acc;
      });
}
}  // namespace detail

// f(r, c) -> float, callable on the device; out: cols floats, added to. Chunks of 16 columns
// on host backends, one column per work item on GPUs (and with device paths).
template <class F>
void column_sums(const char* name, int rows, int cols, const F& f, Vec out) {
  if (rows == 0 || cols == 0) return;
  if constexpr (Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible) {
    if (!device_paths()) return detail::column_sums_in_chunks<16>(name, rows, cols, f, out);
  }
  detail::column_sums_in_chunks<1>(name, rows, cols, f, out);
}

}  // namespace kmoe
