#include "core/kept_operand.hpp"

#include "core/buffers.hpp"
#include "core/error.hpp"

namespace kmoe {

namespace {
void allocate(KeptStorage& s, const std::string& label, std::int64_t n, bool bf16) {
  if (bf16)
    s.b16 = Kokkos::View<std::uint16_t*, Layout, MemSpace>(label + " (bf16)", n);
  else
    s.f32 = View1F(label, n);
}

template <class V>
V pooled(std::map<std::string, V>& buffers, const std::string& key, const std::string& label,
         std::int64_t n) {
  V& v = buffers[key];
  if (std::int64_t(v.extent(0)) < n) v = V(label + " (pooled)", n);
  return Kokkos::subview(v, std::make_pair(std::int64_t(0), n));
}
}  // namespace

std::string ActivationPool::key(const std::string& label) {
  return label + "#" + std::to_string(seen_[label]++);
}

std::shared_ptr<KeptStorage> ActivationPool::kept(const std::string& label, std::int64_t n,
                                                  bool bf16) {
  auto& s = kept_[key(label + (bf16 ? " (bf16)" : ""))];
  if (!s) s = std::make_shared<KeptStorage>();
  const std::int64_t have = bf16 ? s->b16.extent(0) : s->f32.extent(0);
  if (have < n) allocate(*s, label + " (pooled)", n, bf16);
  return s;
}

View1F ActivationPool::floats(const std::string& label, std::int64_t n) {
  return pooled(floats_, key(label), label, n);
}

View1I ActivationPool::ints(const std::string& label, std::int64_t n) {
  return pooled(ints_, key(label), label, n);
}

std::int64_t ActivationPool::bytes() const {
  std::int64_t b = 0;
  for (const auto& [k, s] : kept_) b += 4 * s->f32.extent(0) + 2 * s->b16.extent(0);
  for (const auto& [k, v] : floats_) b += 4 * v.extent(0);
  for (const auto& [k, v] : ints_) b += 4 * v.extent(0);
  return b;
}

namespace {
// The pool a block's saved buffers come from: ctx's, when its blocks share.
ActivationPool* sharing_pool(const RunContext& ctx) {
  return ctx.pool && ctx.pool->blocks_share() ? ctx.pool : nullptr;
}
}  // namespace

View1F saved_floats(const RunContext& ctx, const std::string& label, std::int64_t n) {
  if (ActivationPool* p = sharing_pool(ctx)) return p->floats(label, n);
  return View1F(label, n);
}

View1I saved_ints(const RunContext& ctx, const std::string& label, std::int64_t n) {
  if (ActivationPool* p = sharing_pool(ctx)) return p->ints(label, n);
  return View1I(label, n);
}

KeptOperand::KeptOperand(const RunContext& ctx, const std::string& label, std::int64_t n,
                         bool may_be_bf16)
    : label_(label), bf16_(may_be_bf16 && ctx.bf16()) {
  if (ActivationPool* p = sharing_pool(ctx))
    s_ = p->kept(label, n, bf16_);
  else
    allocate(*s_, label, n, bf16_);
}

void KeptOperand::ensure(std::int64_t n) {
  if (bf16_)
    ensure_size(s_->b16, n, label_ + " (bf16)");
  else
    ensure_size(s_->f32, n, label_);
}

float* KeptOperand::f32() const {
  KMOE_REQUIRE(!bf16_, label_ << ": kept as bf16, read as fp32");
  return f32p();
}

std::uint16_t* KeptOperand::b16() const {
  KMOE_REQUIRE(bf16_, label_ << ": kept as fp32, read as bf16");
  return b16p();
}

}  // namespace kmoe
