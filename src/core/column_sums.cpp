#include "core/column_sums.hpp"

#include "core/buffers.hpp"

namespace kmoe {

float* column_sums_workspace(std::int64_t n) {
  static View1F* workspace = nullptr;
  if (!workspace) {
    workspace = new View1F();
    Kokkos::push_finalize_hook([] {
      delete workspace;
      workspace = nullptr;
    });
  }
  ensure_size(*workspace, n, "column_sums::partial");
  return workspace->data();
}

}  // namespace kmoe
