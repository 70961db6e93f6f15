#include "core/autocast.h"

#include "core/ops_conv.h"

namespace trainer {

namespace {

thread_local std::optional<DType> t_autocast_dtype;

bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }

// Rank of a floating dtype for promotion; bf16 and f16 share one (their mix goes to f32).
int width_rank(DType t) {
  switch (t) {
    case DType::f64:
      return 2;
    case DType::f32:
      return 1;
    default:
      return 0;
  }
}

// x.to(t) (recorded), keeping a channels-last image channels-last: the
// image ops downstream then take it without another copy.
Tensor cast(const Tensor& x, DType t) {
  if (x.dim() == 4 && !x.is_contiguous() && is_channels_last(x))
    return x.permute({0, 2, 3, 1}).to(t).permute({0, 3, 1, 2});
  return x.to(t);
}

}  // namespace

std::optional<DType> autocast_dtype() { return t_autocast_dtype; }

AutocastGuard::AutocastGuard(DType dtype) : previous_(t_autocast_dtype) {
  CHECK(dtype == DType::f32 || is_half(dtype))
      << "AutocastGuard: dtype " << dtype << " (bf16 or f16 turn autocast on, f32 off)";
  t_autocast_dtype = is_half(dtype) ? std::optional<DType>(dtype) : std::nullopt;
}

AutocastGuard::~AutocastGuard() { t_autocast_dtype = previous_; }

Tensor autocast_lower(const Tensor& x) {
  if (!t_autocast_dtype || !x.defined()) return x;
  DType t = x.dtype();
  if (t != DType::f32 && !is_half(t)) return x;
  return cast(x, *t_autocast_dtype);
}

Tensor autocast_fp32(const Tensor& x) {
  if (!t_autocast_dtype || !x.defined() || !is_half(x.dtype())) return x;
  return cast(x, DType::f32);
}

void autocast_promote(Tensor& a, Tensor& b) {
  if (!t_autocast_dtype || !a.defined() || !b.defined()) return;
  DType ta = a.dtype(), tb = b.dtype();
  if (ta == tb || !is_floating(ta) || !is_floating(tb)) return;
  int ra = width_rank(ta), rb = width_rank(tb);
  DType wide = ra == rb ? DType::f32 : (ra > rb ? ta : tb);
  a = cast(a, wide);
  b = cast(b, wide);
}

}  // namespace trainer
