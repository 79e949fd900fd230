// Host helpers of the training-unit tests (test_optimizer, test_tensor_table, test_model_size).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/kokkos_types.hpp"
#include "core/tensor_table.hpp"

namespace kmoe::unit {

inline std::vector<float> to_host(const View1F& v) {
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

inline void from_host(const std::vector<float>& src, const View1F& v) {
  ASSERT_EQ(src.size(), v.extent(0));
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < src.size(); ++i) h(i) = src[i];
  Kokkos::deep_copy(v, h);
}

// The values of one tensor of a table, on the host.
inline std::vector<float> tensor_values(const TensorTable& t, const std::string& name) {
  const int i = t.find(name);
  EXPECT_GE(i, 0) << name;
  if (i < 0) return {};
  const auto all = to_host(t.params);
  const auto& e = t.entry(i);
  return std::vector<float>(all.begin() + e.offset, all.begin() + e.offset + e.size);
}

inline bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline TensorSpec spec(const std::string& name, std::vector<std::int64_t> shape,
                InitKind init = InitKind::Normal, double init_std = 0.02, bool wd = false,
                double lr_mult = 1.0) {
  TensorSpec s;
  s.name = name;
  s.shape = std::move(shape);
  s.init = init;
  s.init_std = init_std;
  s.weight_decay = wd;
  s.lr_mult = lr_mult;
  return s;
}

}  // namespace kmoe::unit
