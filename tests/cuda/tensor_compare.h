// The shared comparator (tests/common/compare.h) on kiln Tensors: what the GPU tests call to
// check a cuda-sm90 output against the reference interpreter's. Needs no GPU.
#pragma once

#include <string>

#include "common/compare.h"
#include "kiln/ir/tensor.h"

namespace kiln::test {

/// Reads a tensor's elements as doubles (`t` must outlive the result).
inline Read read(const Tensor& t) {
  return [&t](int64_t i) { return t.get_f64(i); };
}

/// torch.testing.assert_close's default tolerance for `t`; exact for the other dtypes (integers,
/// bools, FP8).
inline Tolerance assert_close_tolerance(DType t) {
  switch (t) {
    case DType::kF64: return kAssertCloseF64;
    case DType::kF32: return kAssertCloseF32;
    case DType::kF16: return kAssertCloseF16;
    case DType::kBF16: return kAssertCloseBF16;
    default: return kExact;
  }
}

/// The tolerance for a conv whose epilogue is fused (cuDNN, the depthwise kernel, a GEMM): for f32
/// assert_close's, for TF32 1e-2 both ways (10-bit mantissa operands, sums of at most ~150
/// products of [-1, 1) values); the half types get atol = rtol, since the fused result is
/// rounded once where the reference rounds the conv first, and a one-ulp difference carries
/// through a residual add that may cancel to near zero.
inline Tolerance fused_conv_tolerance(DType t, bool tf32) {
  if (tf32) return {1e-2, 1e-2};
  if (t == DType::kF16) return {1e-3, 1e-3};
  if (t == DType::kBF16) return {1.6e-2, 1.6e-2};
  return assert_close_tolerance(t);
}

/// A failed verdict when `got`'s type (dtype and shape) is not `want`'s, else ok().
inline Verdict same_type(const Tensor& want, const Tensor& got) {
  if (want.type() == got.type()) return {};
  return {"type " + got.type().str() + ", expected " + want.type().str()};
}

/// `got` has `want`'s type and every element is within `tol` of `want`'s.
inline Verdict allclose(const Tensor& want, const Tensor& got, Tolerance tol,
                        bool equal_nan = false) {
  if (Verdict t = same_type(want, got); !t.ok()) return t;
  return allclose(want.numel(), read(want), read(got), tol, equal_nan);
}

/// allclose with assert_close's default tolerance for `want`'s dtype.
inline Verdict assert_close(const Tensor& want, const Tensor& got) {
  return allclose(want, got, assert_close_tolerance(want.dtype()));
}

/// `got` has `want`'s type and an SQNR against it of at least `floor_db`.
inline Verdict sqnr_at_least(const Tensor& want, const Tensor& got, double floor_db) {
  if (Verdict t = same_type(want, got); !t.ok()) return t;
  return sqnr_at_least(want.numel(), read(want), read(got), floor_db);
}

/// `got` has `want`'s type and a normwise relative error against it of at most `limit`.
inline Verdict rel_l2_within(const Tensor& want, const Tensor& got, double limit) {
  if (Verdict t = same_type(want, got); !t.ok()) return t;
  return rel_l2_within(want.numel(), read(want), read(got), limit);
}

}  // namespace kiln::test
