// Sizes computed from deck values (parameter counts, bytes): 64-bit integers whose every
// addition and multiplication is checked, so an absurd deck (model.d_model = 10^9) is a clear
// error instead of a negative size.
#pragma once

#include <cstdint>

#include "core/error.hpp"

namespace kmoe {

// Thrown by a Size operation that leaves the 64-bit range; the caller names the deck keys.
class SizeOverflow : public Error {
 public:
  SizeOverflow() : Error("a size exceeds 64 bits") {}
};

class Size {
 public:
  constexpr Size(std::int64_t v = 0) : v_(v) {}  // NOLINT: sizes mix with plain integers
  constexpr std::int64_t get() const { return v_; }

  friend Size operator+(Size a, Size b) {
    std::int64_t r;
    if (__builtin_add_overflow(a.v_, b.v_, &r)) throw SizeOverflow();
    return r;
  }
  friend Size operator-(Size a, Size b) {
    std::int64_t r;
    if (__builtin_sub_overflow(a.v_, b.v_, &r)) throw SizeOverflow();
    return r;
  }
  friend Size operator*(Size a, Size b) {
    std::int64_t r;
    if (__builtin_mul_overflow(a.v_, b.v_, &r)) throw SizeOverflow();
    return r;
  }
  Size& operator+=(Size b) { return *this = *this + b; }

 private:
  std::int64_t v_;
};

}  // namespace kmoe
