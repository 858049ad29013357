// GPU check of the depthwise conv kernel (conv_depthwise.cpp) and the ops it applies before its
// store (conv_tail.cpp) against the reference interpreter: f32, f16 and bf16; 3x3 to 7x7 kernels,
// strides 1 and 2, dilation, asymmetric pads, a channel multiplier, 1-D; row tiles, column tiles
// and blocks of several whole planes with a partial last block; bias, batch norm, relu, swish +
// residual and hardswish groups; channels last, the pointwise node before the conv (silu, sigmoid)
// applied to the staged inputs, with halos shared by row and column tiles, partial channel
// blocks and partial row groups. Exits 77 without a GPU.
#include <cstdio>
#include <string>

#include "conv_depthwise_graphs.h"
#include "gpu_test_util.h"

using namespace kiln;

int main() {
  if (const int rc = start_gpu_test(); rc != 0) return rc;
  int failures = 0, cases = 0;
  for (const char* t : {"f32", "f16", "bf16"})
    for (const auto& c : test::kDepthwiseCases) {
      const test::Tolerance tol = test::fused_conv_tolerance(*parse_dtype(t), false);
      const std::string text = test::replace_all(c[1], "T[", std::string(t) + "[");
      failures += report_case(std::string(c[0]) + " " + t,
                              gpu_matches_reference(text, "conv_depthwise", 11, [&](const Tensor& want, const Tensor& got) {
                                return test::allclose(want, got, tol).why;
                              }));
      ++cases;
    }
  for (const char* t : {"f32", "f16", "bf16"})
    for (const auto& c : test::kDepthwiseNhwcCases) {
      const test::Tolerance tol = test::fused_conv_tolerance(*parse_dtype(t), false);
      const std::string text = test::replace_all(c[1], "T[", std::string(t) + "[");
      failures += report_case(std::string(c[0]) + " " + t,
                              gpu_matches_reference(text, "conv_depthwise_nhwc", 11, [&](const Tensor& want, const Tensor& got) {
                                return test::allclose(want, got, tol).why;
                              }));
      ++cases;
    }
  for (const char* t : {"f32", "f16", "bf16"}) {
    const test::Tolerance tol = test::fused_conv_tolerance(*parse_dtype(t), false);
    failures += report_case(std::string("nhwc constant filters: 3x3 stride 2 + swish + residual, 5x5 + relu, 1-D ") + t,
                            gpu_matches_reference(test::depthwise_nhwc_constant_graph(t), "conv_depthwise_nhwc", 12,
                                                  [&](const Tensor& want, const Tensor& got) {
                                                    return test::allclose(want, got, tol).why;
                                                  }));
    ++cases;
  }
  std::printf("%d of %d cases failed\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
