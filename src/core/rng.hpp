// Counter-based random numbers: every value is a pure function of its key and counter, so
// initialization and data order never depend on the rank count or thread count.
#pragma once

#include <cstdint>
#include <string>

#include "core/kokkos_types.hpp"

namespace kmoe {

// One splitmix64 output for the state `x` (Steele, Lea, Flood 2014), used as a hash/mixer.
KOKKOS_INLINE_FUNCTION std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1) from the top 53 bits.
KOKKOS_INLINE_FUNCTION double uniform_open01(std::uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// FNV-1a 64 of a name: the per-tensor key of initialization.
inline std::uint64_t hash_name(const std::string& name) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

}  // namespace kmoe
