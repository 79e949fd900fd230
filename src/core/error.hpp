// Errors: one exception type and one check macro. A user mistake ends in a message that names
// the file, key or value, never in a segfault or an abort trace.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// An error every rank throws alike (the ranks agreed on it, e.g. over a collective): the
// drivers report it once, on rank 0.
class SharedError : public Error {
 public:
  using Error::Error;
};

// A non-finite loss or gradient norm: the run stops (exit code 3) without a checkpoint.
class NonFiniteError : public SharedError {
 public:
  using SharedError::SharedError;
};

// A clean stop every rank agreed on, with its exit code: 85 after SIGUSR1 (checkpointed,
// "requeue me"), 86 after SIGTERM (checkpointed, resumable, do not requeue).
class StopRequest : public std::exception {
 public:
  StopRequest(int code, std::string what) : code_(code), what_(std::move(what)) {}
  int code() const { return code_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  int code_;
  std::string what_;
};

}  // namespace kmoe

// KMOE_REQUIRE(h > 0, "model.n_heads must be positive, got " << h);
#define KMOE_REQUIRE(cond, msg)                    \
  do {                                             \
    if (!(cond)) {                                 \
      std::ostringstream kmoe_require_os_;         \
      kmoe_require_os_ << msg;                     \
      throw ::kmoe::Error(kmoe_require_os_.str()); \
    }                                              \
  } while (0)

#define KMOE_FAIL(msg) KMOE_REQUIRE(false, msg)
