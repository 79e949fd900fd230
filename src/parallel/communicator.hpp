// A duplicated MPI communicator owned by RAII, with the collectives kmoe uses on contiguous
// buffers. Callers fence the execution space before handing device data to MPI (done here).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

namespace kmoe {

// Wraps an MPI call so a failure names the call instead of aborting silently.
void mpi_check(int rc, const char* call);

class Communicator {
 public:
  Communicator() = default;
  // Duplicates `parent` (so tags never collide with other users); `name` appears in errors.
  Communicator(MPI_Comm parent, std::string name);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  Communicator(Communicator&& o) noexcept;
  Communicator& operator=(Communicator&& o) noexcept;

  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }

  void allreduce_sum(float* data, std::int64_t n) const;   // in place
  void allreduce_sum(double* data, std::int64_t n) const;  // in place
  void allreduce_sum(std::int32_t* data, std::int64_t n) const;  // in place
  double allreduce_max(double v) const;
  void barrier() const;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::string name_;
};

}  // namespace kmoe
