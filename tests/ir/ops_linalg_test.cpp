// Tests of the core contraction and pooling ops against hand-computed values.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {


const Tensor kX3x3 = f32({1, 1, 3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9});

}  // namespace

TEST_CASE("linalg: ops are registered with the contraction and reduction traits") {
  for (const char* name : {"matmul", "matmul_acc", "linear", "conv"}) {
    const OpDef* def = OpRegistry::global().find(name);
    REQUIRE(def != nullptr);
    CHECK(def->has(kTraitContraction));
  }
  for (const char* name : {"max_pool", "avg_pool"})
    REQUIRE(OpRegistry::global().find(name) != nullptr);
}

TEST_CASE("linalg: matmul 2-D") {
  check_values(
      run1("matmul", {f32({2, 3}, {1, 2, 3, 4, 5, 6}), f32({3, 2}, {7, 8, 9, 10, 11, 12})}), {2, 2},
      {58, 64, 139, 154});
}

TEST_CASE("linalg: matmul broadcasts batch dims on both sides") {
  // a: 2 batches of 1x2 rows, b: 3 batches of 2x1 columns; each output is a dot product.
  Tensor a = f32({2, 1, 1, 2}, {1, 2, 3, 4});
  Tensor b = f32({3, 2, 1}, {1, 0, 0, 1, 1, 1});
  check_values(run1("matmul", {a, b}), {2, 3, 1, 1}, {1, 2, 3, 3, 4, 7});
}

TEST_CASE("linalg: matmul 1-D promotion") {
  Tensor m = f32({3, 2}, {7, 8, 9, 10, 11, 12});
  check_values(run1("matmul", {f32({3}, {1, 2, 3}), m}), {2}, {58, 64});
  check_values(run1("matmul", {f32({2, 3}, {1, 2, 3, 4, 5, 6}), f32({3}, {1, 1, 1})}), {2},
               {6, 15});
  check_values(run1("matmul", {f32({3}, {1, 2, 3}), f32({3}, {4, 5, 6})}), {}, {32});
  // A vector against a batch of matrices keeps the batch dim.
  check_values(run1("matmul", {f32({2}, {1, 1}), f32({2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8})}), {2, 2},
               {4, 6, 12, 14});
}

TEST_CASE("linalg: matmul on integers accumulates exactly and wraps to the dtype") {
  const int64_t a[] = {1, 2, 3, 4}, b[] = {5, 6, 7, 8};
  Tensor y = run1("matmul", {Tensor::from_i64(DType::kI32, {2, 2}, a),
                             Tensor::from_i64(DType::kI32, {2, 2}, b)});
  CHECK(y.dtype() == DType::kI32);
  CHECK(y.to_i64() == std::vector<int64_t>{19, 22, 43, 50});
  // 100*2 + 100*2 = 400 does not fit in i8: it wraps to 400 - 512 = -112.
  const int64_t c[] = {100, 100}, d[] = {2, 2};
  Tensor z = run1(
      "matmul", {Tensor::from_i64(DType::kI8, {1, 2}, c), Tensor::from_i64(DType::kI8, {2, 1}, d)});
  CHECK(z.to_i64() == std::vector<int64_t>{-112});
}

TEST_CASE("linalg: matmul shape rule with symbolic dims") {
  auto r = infer_op(
      "matmul", {{DType::kF32, {Dim::symbol("B"), 2, 3}}, {DType::kF32, {3, Dim::symbol("N")}}});
  REQUIRE(r.ok());
  CHECK((*r)[0].str() == "f32[B, 2, N]");
  // A symbolic contraction dim is checked at run time, not refused.
  auto k = infer_op("matmul", {{DType::kF32, {2, Dim::symbol("K")}}, {DType::kF32, {3, 4}}});
  REQUIRE(k.ok());
  CHECK((*k)[0].str() == "f32[2, 4]");
}

TEST_CASE("linalg: matmul errors") {
  CHECK(error_of(run_op("matmul", {f32({2, 3}, {1, 2, 3, 4, 5, 6}), f32({2, 2}, {1, 2, 3, 4})}))
            .find("contraction dims differ: f32[2, 3] @ f32[2, 2]") != std::string::npos);
  const double h[] = {1, 2, 3};
  CHECK(error_of(run_op("matmul", {f32({1, 3}, {1, 2, 3}), Tensor::from_f64(DType::kF16, {3}, h)}))
            .find("must have the same dtype, got f32 and f16") != std::string::npos);
  CHECK(error_of(infer_op("matmul", {{DType::kF32, {2, 1, 3}}, {DType::kF32, {3, 3, 1}}}))
            .find("batch dims of f32[2, 1, 3] and f32[3, 3, 1] do not broadcast") !=
        std::string::npos);
  CHECK(error_of(infer_op("matmul", {{DType::kF32, {}}, {DType::kF32, {3}}})).find("rank >= 1") !=
        std::string::npos);
  CHECK(error_of(infer_op("matmul", {{DType::kBool, {2}}, {DType::kBool, {2}}}))
            .find("operand 'a' must be float or integer, got bool") != std::string::npos);
}

TEST_CASE("linalg: matmul_acc adds a @ b to c, rounding once to c's dtype") {
  check_values(run1("matmul_acc", {f32({2, 3}, {1, 2, 3, 4, 5, 6}), f32({3, 2}, {7, 8, 9, 10, 11, 12}),
                                   f32({2, 2}, {1, -1, 0.5, 0})}),
               {2, 2}, {59, 63, 139.5, 154});
  // 1 + 1/256 is not a bf16 (a bf16 matmul would round it to 1): the f32 sum keeps it.
  const double a[] = {1, 1}, b[] = {1, 1.0 / 256};
  Tensor y = run1("matmul_acc", {Tensor::from_f64(DType::kBF16, {1, 2}, a), Tensor::from_f64(DType::kBF16, {2, 1}, b),
                                 f32({1, 1}, {0.5})});
  CHECK(y.dtype() == DType::kF32);
  check_values(y, {1, 1}, {1.50390625});
}

TEST_CASE("linalg: matmul_acc errors") {
  CHECK(error_of(infer_op("matmul_acc", {{DType::kF32, {2, 3}}, {DType::kF32, {2, 2}}, {DType::kF32, {2, 2}}}))
            .find("contraction dims differ") != std::string::npos);
  CHECK(error_of(infer_op("matmul_acc", {{DType::kF32, {2, 2, 3}}, {DType::kF32, {3, 2}}, {DType::kF32, {2, 2}}}))
            .find("operands 'a' and 'b' must be matrices") != std::string::npos);
  CHECK(error_of(infer_op("matmul_acc", {{DType::kF32, {2, 3}}, {DType::kF32, {3, 4}}, {DType::kF32, {2, 5}}}))
            .find("operand 'c' must be [2, 4], got f32[2, 5]") != std::string::npos);
  CHECK(error_of(infer_op("matmul_acc", {{DType::kBF16, {2, 3}}, {DType::kBF16, {3, 4}}, {DType::kF16, {2, 4}}}))
            .find("operand 'c' must be bf16 (the dtype of a and b) or f32, got f16[2, 4]") != std::string::npos);
  CHECK(error_of(infer_op("matmul_acc", {{DType::kBF16, {2, 3}}, {DType::kF16, {3, 4}}, {DType::kF32, {2, 4}}}))
            .find("same dtype") != std::string::npos);
  CHECK(error_of(infer_op("matmul_acc", {{DType::kI32, {2, 3}}, {DType::kI32, {3, 4}}, {DType::kI32, {2, 4}}}))
            .find("must be float") != std::string::npos);
}

TEST_CASE("linalg: linear with and without bias") {
  Tensor x = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor w = f32({2, 3}, {1, 0, -1, 0.5, 0.5, 0.5});
  check_values(run1("linear", {x, w}), {2, 2}, {-2, 3, -2, 7.5});
  check_values(run1("linear", {x, w, f32({2}, {10, 20})}), {2, 2}, {8, 23, 8, 27.5});
  check_values(run1("linear", {x.reshaped({2, 1, 3}), w}), {2, 1, 2}, {-2, 3, -2, 7.5});
  check_values(run1("linear", {f32({3}, {1, 2, 3}), w}), {2}, {-2, 3});
}

TEST_CASE("linalg: linear errors") {
  CHECK(error_of(infer_op("linear", {{DType::kF32, {2, 3}}, {DType::kF32, {3}}}))
            .find("operand 'w' must be [out_features, in_features], got f32[3]") !=
        std::string::npos);
  CHECK(error_of(infer_op("linear", {{DType::kF32, {2, 3}}, {DType::kF32, {4, 2}}}))
            .find("in_features differ") != std::string::npos);
  CHECK(error_of(
            infer_op("linear", {{DType::kF32, {2, 3}}, {DType::kF32, {4, 3}}, {DType::kF32, {3}}}))
            .find("operand 'bias' must be [out_features] = [4], got f32[3]") != std::string::npos);
  auto sym = infer_op("linear", {{DType::kF32, {Dim::symbol("B"), 3}}, {DType::kF32, {4, 3}}});
  REQUIRE(sym.ok());
  CHECK((*sym)[0].str() == "f32[B, 4]");
}

TEST_CASE("linalg: conv 2-D, plain and with bias") {
  Tensor w = f32({1, 1, 2, 2}, {1, 0, 0, 1});  // top-left + bottom-right of each window
  check_values(run1("conv", {kX3x3, w}), {1, 1, 2, 2}, {6, 8, 12, 14});
  check_values(run1("conv", {kX3x3, w, f32({1}, {10})}), {1, 1, 2, 2}, {16, 18, 22, 24});
}

TEST_CASE("linalg: conv with stride, pads and dilation") {
  Tensor w = f32({1, 1, 2, 2}, {1, 0, 0, 1});
  // Padded by 1 all round, stride 2: windows start at rows/cols -1 and 1.
  check_values(
      run1("conv", {kX3x3, w},
           {{"pads", std::vector<int64_t>{1, 1, 1, 1}}, {"strides", std::vector<int64_t>{2, 2}}}),
      {1, 1, 2, 2}, {1, 3, 7, 14});
  // pads are all begins then all ends: [h_begin, w_begin, h_end, w_end] = one column on the left.
  check_values(run1("conv", {kX3x3, w}, {{"pads", std::vector<int64_t>{0, 1, 0, 0}}}), {1, 1, 2, 3},
               {4, 6, 8, 7, 12, 14});
  // Dilation 2 spreads the 2x2 kernel over the corners of the 3x3 input: 1*1 + 2*3 + 3*7 + 4*9.
  check_values(run1("conv", {kX3x3, f32({1, 1, 2, 2}, {1, 2, 3, 4})},
                    {{"dilations", std::vector<int64_t>{2, 2}}}),
               {1, 1, 1, 1}, {64});
}

TEST_CASE("linalg: conv with channels and groups") {
  Tensor x = f32({1, 2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  // One output channel summing both input channels (c0 + 10 * c1).
  check_values(run1("conv", {x, f32({1, 2, 1, 1}, {1, 10})}), {1, 1, 2, 2}, {51, 62, 73, 84});
  // groups 2, 4 output channels: channels 0-1 read input channel 0, channels 2-3 read channel 1.
  check_values(run1("conv", {x, f32({4, 1, 1, 1}, {1, 2, 3, 4})}, {{"groups", 2}}), {1, 4, 2, 2},
               {1, 2, 3, 4, 2, 4, 6, 8, 15, 18, 21, 24, 20, 24, 28, 32});
  // Batch of two: each image is convolved on its own.
  Tensor x2 = f32({2, 1, 1, 2}, {1, 2, 3, 4});
  check_values(run1("conv", {x2, f32({1, 1, 1, 2}, {1, 1})}), {2, 1, 1, 1}, {3, 7});
}

TEST_CASE("linalg: conv channels last (layout nhwc)") {
  // The grouped case above, channels last: x [1, 2, 2, 2] NHWC holds the same image as the
  // NCHW x with channels interleaved; w [4, 1, 1, 1]; y comes out [1, 2, 2, 4].
  Tensor x = f32({1, 2, 2, 2}, {1, 5, 2, 6, 3, 7, 4, 8});
  check_values(run1("conv", {x, f32({4, 1, 1, 1}, {1, 2, 3, 4})}, {{"groups", 2}, {"layout", std::string("nhwc")}}),
               {1, 2, 2, 4}, {1, 2, 15, 20, 2, 4, 18, 24, 3, 6, 21, 28, 4, 8, 24, 32});
  // A 2x2 kernel over two channels: w [1, 2, 2, 2] is [k, kh, kw, c] (c0 weights 1, c1 weights 10).
  check_values(run1("conv", {x, f32({1, 2, 2, 2}, {1, 10, 1, 10, 1, 10, 1, 10})}, {{"layout", std::string("nhwc")}}),
               {1, 1, 1, 1}, {10 + 260});
}

TEST_CASE("linalg: conv rejects an unknown layout") {
  auto r = infer_op("conv", {TensorType{DType::kF32, {Dim(1), Dim(1), Dim(2), Dim(2)}},
                             TensorType{DType::kF32, {Dim(1), Dim(1), Dim(1), Dim(1)}}},
                    {{"layout", std::string("nchwc")}});
  CHECK_FALSE(r.ok());
  CHECK(r.status().message().find("layout") != std::string::npos);
}

TEST_CASE("linalg: conv 1-D and 3-D") {
  // Padded [0 1 2 3 4 5 0], kernel [1 0 -1], stride 2.
  check_values(run1("conv", {f32({1, 1, 5}, {1, 2, 3, 4, 5}), f32({1, 1, 3}, {1, 0, -1})},
                    {{"pads", std::vector<int64_t>{1, 1}}, {"strides", std::vector<int64_t>{2}}}),
               {1, 1, 3}, {-2, -2, 4});
  check_values(run1("conv", {f32({1, 1, 2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8}),
                             f32({1, 1, 2, 2, 2}, {1, 1, 1, 1, 1, 1, 1, 1})}),
               {1, 1, 1, 1, 1}, {36});
}

TEST_CASE("linalg: conv shape rule and errors") {
  auto sym = infer_op(
      "conv",
      {{DType::kF32, {Dim::symbol("N"), 3, Dim::symbol("H"), 7}}, {DType::kF32, {8, 3, 3, 3}}},
      {{"strides", std::vector<int64_t>{2, 2}}});
  REQUIRE(sym.ok());
  CHECK((*sym)[0].str() == "f32[N, 8, ?, 3]");
  CHECK(error_of(infer_op("conv", {{DType::kF32, {1, 3, 4, 4}}, {DType::kF32, {2, 1, 1, 1}}},
                          {{"groups", 2}}))
            .find("input channels 3 are not divisible by groups 2") != std::string::npos);
  CHECK(error_of(infer_op("conv", {{DType::kF32, {1, 4, 4, 4}}, {DType::kF32, {3, 2, 1, 1}}},
                          {{"groups", 2}}))
            .find("output channels 3 are not divisible by groups 2") != std::string::npos);
  CHECK(error_of(infer_op("conv", {{DType::kF32, {1, 2, 4, 4}}, {DType::kF32, {1, 3, 1, 1}}}))
            .find("expects 3 input channels") != std::string::npos);
  CHECK(error_of(infer_op("conv", {{DType::kF32, {1, 1, 2, 2}}, {DType::kF32, {1, 1, 3, 3}}}))
            .find("window of size 3 is larger than the padded input of size 2") !=
        std::string::npos);
  CHECK(error_of(infer_op("conv", {{DType::kF32, {1, 1, 4, 4}}, {DType::kF32, {1, 1, 1, 1}}},
                          {{"strides", std::vector<int64_t>{1}}}))
            .find("attribute 'strides' must have 2 values, got 1") != std::string::npos);
  CHECK(error_of(infer_op("conv", {{DType::kF32, {1, 4}}, {DType::kF32, {1, 4}}}))
            .find("operand 'x' must be [N, C, spatial...]") != std::string::npos);
}

TEST_CASE("linalg: max_pool floor and ceil mode") {
  check_values(
      run1("max_pool", {kX3x3},
           {{"kernel_shape", std::vector<int64_t>{2, 2}}, {"strides", std::vector<int64_t>{2, 2}}}),
      {1, 1, 1, 1}, {5});
  check_values(run1("max_pool", {kX3x3},
                    {{"kernel_shape", std::vector<int64_t>{2, 2}},
                     {"strides", std::vector<int64_t>{2, 2}},
                     {"ceil_mode", 1}}),
               {1, 1, 2, 2}, {5, 6, 8, 9});
  // ceil_mode drops a last window that would start in the end padding: 4 windows fit the
  // arithmetic, 3 remain.
  check_values(run1("max_pool", {f32({1, 1, 5}, {1, 2, 3, 4, 5})},
                    {{"kernel_shape", std::vector<int64_t>{2}},
                     {"strides", std::vector<int64_t>{2}},
                     {"pads", std::vector<int64_t>{1, 1}},
                     {"ceil_mode", 1}}),
               {1, 1, 3}, {1, 3, 5});
}

TEST_CASE("linalg: max_pool ignores padding, honours dilation, takes integers") {
  // All values negative: a padding value of 0 would win if padding were counted.
  Tensor neg = f32({1, 1, 3, 3}, {-1, -2, -3, -4, -5, -6, -7, -8, -9});
  check_values(run1("max_pool", {neg},
                    {{"kernel_shape", std::vector<int64_t>{2, 2}},
                     {"strides", std::vector<int64_t>{2, 2}},
                     {"pads", std::vector<int64_t>{1, 1, 1, 1}}}),
               {1, 1, 2, 2}, {-1, -2, -4, -5});
  // Dilation 2 looks only at the corners, so the 9 in the middle of the top row is skipped.
  check_values(run1("max_pool", {f32({1, 1, 3, 3}, {1, 9, 2, 3, 4, 5, 6, 7, 0})},
                    {{"kernel_shape", std::vector<int64_t>{2, 2}},
                     {"dilations", std::vector<int64_t>{2, 2}}}),
               {1, 1, 1, 1}, {6});
  const int64_t v[] = {3, -1, 7, 2};
  Tensor y = run1("max_pool", {Tensor::from_i64(DType::kI32, {1, 1, 4}, v)},
                  {{"kernel_shape", std::vector<int64_t>{2}}});
  CHECK(y.to_i64() == std::vector<int64_t>{3, 7, 7});
}

TEST_CASE("linalg: avg_pool with count_include_pad and ceil_mode") {
  check_values(run1("avg_pool", {kX3x3}, {{"kernel_shape", std::vector<int64_t>{2, 2}}}),
               {1, 1, 2, 2}, {3, 4, 6, 7});
  AttrMap padded = {{"kernel_shape", std::vector<int64_t>{2, 2}},
                    {"strides", std::vector<int64_t>{2, 2}},
                    {"pads", std::vector<int64_t>{1, 1, 1, 1}}};
  check_values(run1("avg_pool", {kX3x3}, padded), {1, 1, 2, 2}, {1, 2.5, 5.5, 7});
  padded["count_include_pad"] = 1;
  check_values(run1("avg_pool", {kX3x3}, padded), {1, 1, 2, 2}, {0.25, 1.25, 2.75, 7});
  // A ceil_mode window hanging past the input (no padding there) is averaged over what it covers.
  check_values(run1("avg_pool", {kX3x3},
                    {{"kernel_shape", std::vector<int64_t>{2, 2}},
                     {"strides", std::vector<int64_t>{2, 2}},
                     {"ceil_mode", 1},
                     {"count_include_pad", 1}}),
               {1, 1, 2, 2}, {3, 4.5, 7.5, 9});
  // 1-D, kernel 3, stride 2, pads 1/1, ceil: windows [-1,2) [1,4) [3,6); the last is clipped
  // to the padded end (5), so count_include_pad divides it by 2.
  AttrMap ceil = {{"kernel_shape", std::vector<int64_t>{3}},
                  {"strides", std::vector<int64_t>{2}},
                  {"pads", std::vector<int64_t>{1, 1}},
                  {"ceil_mode", 1}};
  Tensor x = f32({1, 1, 4}, {1, 2, 3, 4});
  check_values(run1("avg_pool", {x}, ceil), {1, 1, 3}, {1.5, 3, 4});
  ceil["count_include_pad"] = 1;
  check_values(run1("avg_pool", {x}, ceil), {1, 1, 3}, {1, 3, 2});
}

TEST_CASE("linalg: pooling errors") {
  const TensorType x{DType::kF32, {1, 1, 4, 4}};
  CHECK(error_of(infer_op("max_pool", {x})).find("missing required attribute 'kernel_shape'") !=
        std::string::npos);
  CHECK(error_of(infer_op("max_pool", {x}, {{"kernel_shape", std::vector<int64_t>{2}}}))
            .find("attribute 'kernel_shape' must have 2 values, got 1") != std::string::npos);
  CHECK(error_of(infer_op("avg_pool", {x},
                          {{"kernel_shape", std::vector<int64_t>{2, 2}},
                           {"pads", std::vector<int64_t>{2, 0, 0, 0}}}))
            .find("pads of spatial dim 0 must be smaller than the window size 2") !=
        std::string::npos);
  CHECK(error_of(infer_op("avg_pool", {{DType::kI32, {1, 1, 4}}},
                          {{"kernel_shape", std::vector<int64_t>{2}}}))
            .find("operand 'x' must be float, got i32") != std::string::npos);
  CHECK(error_of(infer_op("avg_pool", {x},
                          {{"kernel_shape", std::vector<int64_t>{2, 2}}, {"count_include_pad", 2}}))
            .find("attribute 'count_include_pad' must be 0 or 1, got 2") != std::string::npos);
  CHECK(error_of(infer_op("avg_pool", {x},
                          {{"kernel_shape", std::vector<int64_t>{2, 2}},
                           {"dilations", std::vector<int64_t>{1, 1}}}))
            .find("unknown attribute 'dilations'") != std::string::npos);
  auto sym = infer_op(
      "max_pool", {{DType::kF32, {Dim::symbol("N"), 3, Dim::symbol("H"), 8}}},
      {{"kernel_shape", std::vector<int64_t>{2, 2}}, {"strides", std::vector<int64_t>{2, 2}}});
  REQUIRE(sym.ok());
  CHECK((*sym)[0].str() == "f32[N, 3, ?, 4]");
}

TEST_CASE("linalg: large matmul and linear (rows split across threads) equal in-order f64 sums exactly") {
  // 64 x 1024 x 512 is enough work for parallel_ranges to use several threads on a machine
  // with more than one core; every output must still be its k products added in order.
  const int64_t m = 64, k = 1024, n = 512;
  std::vector<double> av(static_cast<size_t>(m * k)), bv(static_cast<size_t>(k * n));
  uint32_t state = 12345;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return static_cast<double>(static_cast<int32_t>(state >> 8) % 2001) / 997.0;
  };
  for (double& v : av) v = static_cast<float>(next());
  for (double& v : bv) v = static_cast<float>(next());
  const Tensor a = f32({m, k}, av), b = f32({k, n}, bv);
  const Tensor y = run1("matmul", {a, b});
  // linear takes w as [out, in]: the transpose of b.
  std::vector<double> wt(static_cast<size_t>(n * k));
  for (int64_t p = 0; p < k; ++p)
    for (int64_t j = 0; j < n; ++j) wt[static_cast<size_t>(j * k + p)] = bv[static_cast<size_t>(p * n + j)];
  const Tensor yl = run1("linear", {a, f32({n, k}, wt)});
  int64_t mismatches = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p)
        acc += static_cast<double>(static_cast<float>(av[static_cast<size_t>(i * k + p)])) *
               static_cast<double>(static_cast<float>(bv[static_cast<size_t>(p * n + j)]));
      const float want = static_cast<float>(acc);
      mismatches += y.get_f64(i * n + j) != want;
      mismatches += yl.get_f64(i * n + j) != want;
    }
  CHECK(mismatches == 0);
}
