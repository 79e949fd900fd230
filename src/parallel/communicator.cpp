#include "parallel/communicator.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <climits>
#include <utility>

#include "core/error.hpp"

namespace kmoe {

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  KMOE_FAIL(call << " failed: " << std::string(msg, len));
}

Communicator::Communicator(MPI_Comm parent, std::string name) : name_(std::move(name)) {
  mpi_check(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

Communicator::~Communicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

Communicator::Communicator(Communicator&& o) noexcept
    : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), rank_(o.rank_), size_(o.size_),
      name_(std::move(o.name_)) {}

Communicator& Communicator::operator=(Communicator&& o) noexcept {
  std::swap(comm_, o.comm_);
  std::swap(rank_, o.rank_);
  std::swap(size_, o.size_);
  std::swap(name_, o.name_);
  return *this;
}

namespace {
// MPI counts are int: split large buffers into chunks.
template <class T>
void allreduce_chunks(T* data, std::int64_t n, MPI_Datatype type, MPI_Comm comm) {
  Kokkos::fence();
  constexpr std::int64_t chunk = INT_MAX / 2;
  for (std::int64_t off = 0; off < n; off += chunk) {
    const int count = static_cast<int>(std::min(chunk, n - off));
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, data + off, count, type, MPI_SUM, comm),
              "MPI_Allreduce");
  }
}
}  // namespace

void Communicator::allreduce_sum(float* data, std::int64_t n) const {
  if (size_ > 1) allreduce_chunks(data, n, MPI_FLOAT, comm_);
}

void Communicator::allreduce_sum(double* data, std::int64_t n) const {
  if (size_ > 1) allreduce_chunks(data, n, MPI_DOUBLE, comm_);
}

void Communicator::allreduce_sum(std::int32_t* data, std::int64_t n) const {
  if (size_ > 1) allreduce_chunks(data, n, MPI_INT32_T, comm_);
}

double Communicator::allreduce_max(double v) const {
  double out = v;
  if (size_ > 1) mpi_check(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, comm_), "MPI_Allreduce");
  return out;
}

void Communicator::barrier() const { mpi_check(MPI_Barrier(comm_), "MPI_Barrier"); }

}  // namespace kmoe
