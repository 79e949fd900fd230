#include "core/tensor_table.hpp"

#include <algorithm>

#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"

namespace kmoe {

std::int64_t TensorSpec::row_elements() const {
  std::int64_t n = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

std::vector<std::int64_t> TensorSpec::local_shape() const {
  std::vector<std::int64_t> s = shape;
  if (!s.empty()) s[0] = local_rows();
  return s;
}

TensorSpec TensorSpec::matrix(std::string name, std::vector<std::int64_t> shape, double init_std) {
  TensorSpec s;
  s.name = std::move(name);
  s.shape = std::move(shape);
  s.init = InitKind::Normal;
  s.init_std = init_std;
  s.weight_decay = true;
  return s;
}

TensorSpec TensorSpec::gain(std::string name, std::int64_t size) {
  TensorSpec s;
  s.name = std::move(name);
  s.shape = {size};
  s.init = InitKind::Ones;
  s.init_std = 0.0;
  return s;
}

TensorSpec TensorSpec::zeros(std::string name, std::vector<std::int64_t> shape) {
  TensorSpec s;
  s.name = std::move(name);
  s.shape = std::move(shape);
  s.init = InitKind::Zeros;
  s.init_std = 0.0;
  return s;
}

TensorSpec TensorSpec::buffer(std::string name, std::vector<std::int64_t> shape) {
  TensorSpec s = zeros(std::move(name), std::move(shape));
  s.trainable = false;
  return s;
}

TensorSpec TensorSpec::no_decay() const {
  TensorSpec s = *this;
  s.weight_decay = false;
  return s;
}

TensorSpec TensorSpec::with_lr_mult(double mult) const {
  TensorSpec s = *this;
  s.lr_mult = mult;
  return s;
}

TensorSpec TensorSpec::row_block(Shard how, std::int64_t first_row, std::int64_t n_rows) const {
  TensorSpec s = *this;
  s.shard = how;
  s.row_begin = first_row;
  s.rows = n_rows;
  return s;
}

TensorSpec TensorSpec::as_tied_copy() const {
  TensorSpec s = *this;
  s.tied_copy = true;
  return s;
}

TensorSpec TensorSpec::gemm_weight() const {
  TensorSpec s = *this;
  s.gemm_only = true;
  return s;
}

TensorSpec TensorSpec::in_host_memory() const {
  TensorSpec s = *this;
  s.host_resident = true;
  return s;
}

int TensorTable::add(TensorSpec spec) {
  if (allocated_) {  // a further instance of a module: share the declared tensor
    const int i = find(spec.name);
    KMOE_REQUIRE(i >= 0, "TensorTable: " << spec.name << " declared after allocation");
    KMOE_REQUIRE(entries_[i].spec.local_shape() == spec.local_shape() &&
                     entries_[i].spec.row_begin == spec.row_begin,
                 "TensorTable: " << spec.name << " shared with a different shape or shard");
    return i;
  }
  KMOE_REQUIRE(find(spec.name) < 0, "TensorTable: duplicate tensor " << spec.name);
  KMOE_REQUIRE(spec.row_begin >= 0 && spec.row_begin + spec.local_rows() <= spec.global_rows(),
               "TensorTable: " << spec.name << " rows [" << spec.row_begin << ", "
                               << spec.row_begin + spec.local_rows() << ") outside "
                               << spec.global_rows());
  KMOE_REQUIRE(!(spec.host_resident && (spec.gemm_only || !spec.trainable || spec.tied_copy)),
               "TensorTable: " << spec.name
                               << " in host memory must be a trainable table read by its layer");
  TensorEntry e;
  e.size = spec.local_rows() * spec.row_elements();
  std::int64_t& end = spec.host_resident ? host_total_ : total_;
  e.offset = end;
  e.spec = std::move(spec);
  end += e.size;
  entries_.push_back(std::move(e));
  return size() - 1;
}

void TensorTable::allocate(const std::vector<MomentSlice>* moments, bool bf16_copies) {
  KMOE_REQUIRE(!allocated_, "TensorTable: allocated twice");
  grads = View1F("grads", total_);
  std::int64_t n = total_;
  if (moments) {
    KMOE_REQUIRE(moments->size() == entries_.size(),
                 "TensorTable: " << moments->size() << " moment slices for " << entries_.size()
                                 << " tensors");
    n = 0;
    std::int64_t nh = 0;  // host tensors: whole, packed in the host moments
    for (std::size_t i = 0; i < moments->size(); ++i) {
      const MomentSlice& s = (*moments)[i];
      const TensorSpec& spec = entries_[i].spec;
      std::int64_t& at = spec.host_resident ? nh : n;
      KMOE_REQUIRE(s.first >= 0 && s.rows >= 0 && s.first + s.rows <= spec.local_rows() &&
                       s.offset == at &&
                       (!spec.host_resident || (s.rows == spec.local_rows() && !s.split)),
                   "TensorTable: moment slice of " << spec.name << " out of range");
      at += s.rows * spec.row_elements();
    }
    moments_ = *moments;
  } else {
    for (const auto& e : entries_) moments_.push_back({0, e.spec.local_rows(), e.offset, false});
  }
  exp_avg = View1F("exp_avg", n);
  exp_avg_sq = View1F("exp_avg_sq", n);
  if (host_total_ > 0) {
    host_params = HostFloats("params (host)", host_total_);
    host_grads = HostFloats("grads (host)", host_total_);
    host_exp_avg = HostFloats("exp_avg (host)", host_total_);
    host_exp_avg_sq = HostFloats("exp_avg_sq (host)", host_total_);
  }
  // fp32 values in table order: every row, or a compute copy's slice rows; the copies packed
  // in table order too, so tensors adjacent in a gradient bucket stay adjacent in both.
  std::int64_t np = 0, nc = 0;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const TensorEntry& e = entries_[i];
    if (e.spec.host_resident) {  // its values are in host_params at its offset
      param_at_.push_back(e.offset);
      copy_at_.push_back(-1);
      continue;
    }
    const bool copy = bf16_copies && e.spec.gemm_only && e.spec.trainable;
    param_at_.push_back(np);
    copy_at_.push_back(copy ? nc : -1);
    np += copy ? moments_[i].rows * e.spec.row_elements() : e.size;
    nc += copy ? e.size : 0;
  }
  params = View1F("params", np);
  if (nc > 0) weights_b16 = Kokkos::View<std::uint16_t*, Layout, MemSpace>("weights (bf16)", nc);
  allocated_ = true;
}

float* TensorTable::param(int i) const {
  KMOE_REQUIRE(!has_copy(i), "TensorTable: " << entries_[i].spec.name
                                             << " is kept as a bf16 compute copy, not read as fp32");
  KMOE_REQUIRE(!host(i), "TensorTable: " << entries_[i].spec.name << " lives in host memory");
  return params.data() + param_at_[i];
}

void TensorTable::host_tensor_as_weight(int i) const {
  KMOE_FAIL("TensorTable: " << entries_[i].spec.name << " lives in host memory, not a GEMM weight");
}

float* TensorTable::grad(int i) const {
  KMOE_REQUIRE(!host(i), "TensorTable: " << entries_[i].spec.name << " lives in host memory");
  return grads.data() + entries_[i].offset;
}

namespace {
float* host_part(const TensorTable& t, int i, const TensorTable::HostFloats& v,
                 std::int64_t offset) {
  KMOE_REQUIRE(t.host(i), "TensorTable: " << t.entry(i).spec.name << " lives in device memory");
  return v.data() + offset;
}
}  // namespace

float* TensorTable::host_param(int i) const {
  return host_part(*this, i, host_params, entries_[i].offset);
}
float* TensorTable::host_grad(int i) const {
  return host_part(*this, i, host_grads, entries_[i].offset);
}
float* TensorTable::host_m(int i) const {
  return host_part(*this, i, host_exp_avg, moments_[i].offset);
}
float* TensorTable::host_v(int i) const {
  return host_part(*this, i, host_exp_avg_sq, moments_[i].offset);
}

void TensorTable::zero_grads() {
  Kokkos::deep_copy(ExecSpace(), grads, 0.0f);
  if (host_total_ > 0) std::fill_n(host_grads.data(), host_total_, 0.0f);
}

int TensorTable::find(const std::string& name) const {
  for (int i = 0; i < size(); ++i)
    if (entries_[i].spec.name == name) return i;
  return -1;
}

namespace {

// Element j of a tensor keyed by `key`: Box-Muller on counter-based uniforms, resampled (next
// counter pair) while beyond 3 standard deviations.
KOKKOS_INLINE_FUNCTION float truncated_normal(std::uint64_t key, std::int64_t j, double std_dev) {
  constexpr double two_pi = 6.283185307179586476925;
  for (std::uint64_t attempt = 0;; ++attempt) {
    const std::uint64_t c = (static_cast<std::uint64_t>(j) << 6) + 2 * attempt;
    const double u1 = uniform_open01(splitmix64(key + c));
    const double u2 = uniform_open01(splitmix64(key + c + 1));
    const double z = math::sqrt(-2.0 * math::log(u1)) * math::cos(two_pi * u2);
    if ((z <= 3.0 && z >= -3.0) || attempt == 31) return static_cast<float>(std_dev * z);
  }
}

}  // namespace

void TensorTable::initialize(std::uint64_t seed) {
  KMOE_REQUIRE(allocated_, "TensorTable: initialize before allocate");
  for (int i = 0; i < size(); ++i) {
    const TensorEntry& e = entries_[i];
    if (e.spec.host_resident) {
      initialize_host(i, seed);
      continue;
    }
    // Element j of the local tensor goes to p(j - m0) when j in [m0, m1) (every element
    // without a compute copy), and rounded to its compute copy w(j) when it has one.
    auto p = Kokkos::subview(params, std::make_pair(param_at_[i], param_at_[i] + master_rows(i) *
                                                                      e.spec.row_elements()));
    const std::int64_t m0 = master_first(i) * e.spec.row_elements(), m1 = m0 + p.extent(0);
    using Words = Kokkos::View<std::uint16_t*, Layout, MemSpace, Unmanaged>;
    const Words w = has_copy(i) ? Words(weights_b16.data() + copy_at_[i], e.size) : Words();
    const int kind = e.spec.init == InitKind::Zeros ? 0 : e.spec.init == InitKind::Ones ? 1 : 2;
    const std::uint64_t key = splitmix64(seed ^ hash_name(e.spec.name));
    const double std_dev = e.spec.init_std;  // rounded to float only with z (CONVENTIONS.md)
    // Element j of the global tensor, whatever part of it this rank holds.
    const std::int64_t first = e.spec.row_begin * e.spec.row_elements();
    Kokkos::parallel_for(
        "init::tensor", flat_range(0, e.size), KOKKOS_LAMBDA(std::int64_t j) {
          const float v =
              kind == 0 ? 0.0f : kind == 1 ? 1.0f : truncated_normal(key, first + j, std_dev);
          if (j >= m0 && j < m1) p(j - m0) = v;
          if (w.extent(0) > 0) w(j) = bf16_bits(v);
        });
  }
  Kokkos::deep_copy(grads, 0.0f);
  Kokkos::deep_copy(exp_avg, 0.0f);
  Kokkos::deep_copy(exp_avg_sq, 0.0f);
  if (host_total_ > 0) {
    std::fill_n(host_grads.data(), host_total_, 0.0f);
    std::fill_n(host_exp_avg.data(), host_total_, 0.0f);
    std::fill_n(host_exp_avg_sq.data(), host_total_, 0.0f);
  }
  Kokkos::fence();
}

void TensorTable::initialize_host(int i, std::uint64_t seed) {
  // The same element values as a device tensor's (MODEL.md section 7), by host threads.
  const TensorEntry& e = entries_[i];
  float* p = host_param(i);
  const int kind = e.spec.init == InitKind::Zeros ? 0 : e.spec.init == InitKind::Ones ? 1 : 2;
  const std::uint64_t key = splitmix64(seed ^ hash_name(e.spec.name));
  const double std_dev = e.spec.init_std;
  const std::int64_t first = e.spec.row_begin * e.spec.row_elements();
  Kokkos::parallel_for(
      "init::host_tensor",
      Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace, Kokkos::IndexType<std::int64_t>>(
          0, e.size),
      [=](std::int64_t j) {
        p[j] = kind == 0 ? 0.0f : kind == 1 ? 1.0f : truncated_normal(key, first + j, std_dev);
      });
}

}  // namespace kmoe
