#include "backend/bf16_widen.h"

namespace tpsim {

void widen_bf16(float* dst, const bf16* src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

void round_to_bf16(bf16* dst, const float* src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_from_f32(src[i]);
}

bool any_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && t->dtype() == DType::BF16) return true;
  return false;
}

Tensor Bf16Widened::shadow(const Tensor& t, bool read) {
  Tensor s = Tensor::empty(t.shape(), DType::F32, scratch_, MemCategory::Temporary, t.tag());
  if (read) {
    if (convert_)
      convert_->widen(s.data<float>(), t.data<bf16>(), t.numel());
    else
      widen_bf16(s.data<float>(), t.data<bf16>(), t.numel());
  }
  return s;
}

Tensor Bf16Widened::in(const Tensor& t) {
  return t.dtype() == DType::BF16 ? shadow(t, true) : t;
}

Tensor Bf16Widened::out(const Tensor& t) {
  if (t.dtype() != DType::BF16) return t;
  pending_.push_back({t, shadow(t, false)});
  return pending_.back().shadow;
}

Tensor Bf16Widened::inout(const Tensor& t) {
  if (t.dtype() != DType::BF16) return t;
  pending_.push_back({t, shadow(t, true)});
  return pending_.back().shadow;
}

void Bf16Widened::store() {
  for (auto& p : pending_) {
    if (convert_)
      convert_->round(p.dst.data<bf16>(), p.shadow.data<float>(), p.dst.numel());
    else
      round_to_bf16(p.dst.data<bf16>(), p.shadow.data<float>(), p.dst.numel());
  }
  pending_.clear();
}

}  // namespace tpsim
