// Tests of the core shape and view ops against hand-computed values.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kiln/ir/interpreter.h"
#include "kiln/ir/op.h"
#include "kiln/ir/verifier.h"

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {


Tensor iota(std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<double> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(static_cast<double>(i));
  return f32(std::move(shape), v);
}

using Ints = std::vector<int64_t>;
const Dim B = Dim::symbol("B");
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

std::string type_of(StatusOr<std::vector<TensorType>> r, size_t i = 0) {
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  return (*r)[i].str();
}

}  // namespace

TEST_CASE("shape: ops are registered as views") {
  for (const char* name : {"reshape", "transpose", "slice", "concat", "split", "gather", "expand",
                           "pad", "squeeze", "unsqueeze", "flatten", "identity"}) {
    const OpDef* def = OpRegistry::global().find(name);
    REQUIRE_MESSAGE(def != nullptr, name);
    CHECK(def->has(kTraitView));
  }
}

TEST_CASE("shape: reshape with 0 and -1") {
  check_values(run1("reshape", {iota({2, 3})}, {{"shape", Ints{3, -1}}}), {3, 2},
               {0, 1, 2, 3, 4, 5});
  check_values(run1("reshape", {iota({2, 3, 2})}, {{"shape", Ints{0, -1}}}), {2, 6},
               {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  check_values(run1("reshape", {iota({6})}, {{"shape", Ints{1, 2, 3}}}), {1, 2, 3},
               {0, 1, 2, 3, 4, 5});
}

TEST_CASE("shape: reshape shape rule with symbolic dims") {
  const TensorType x{DType::kF32, {B, 3, 4}};
  CHECK(type_of(infer_op("reshape", {x}, {{"shape", Ints{0, -1}}})) == "f32[B, 12]");
  CHECK(type_of(infer_op("reshape", {x}, {{"shape", Ints{0, 12}}})) == "f32[B, 12]");
  CHECK(type_of(infer_op("reshape", {x}, {{"shape", Ints{-1, 4}}})) == "f32[?, 4]");
  // The only leftover symbol fills the -1 when the static sizes match.
  CHECK(type_of(infer_op("reshape", {{DType::kF32, {B, 4}}}, {{"shape", Ints{2, 2, -1}}})) ==
        "f32[2, 2, B]");
  CHECK(type_of(infer_op("reshape", {{DType::kF32, {2, Dim::unknown()}}}, {{"shape", Ints{-1}}})) ==
        "f32[?]");
  // Sizes that cannot match whatever B is are refused.
  CHECK(error_of(infer_op("reshape", {x}, {{"shape", Ints{0, 5}}}))
            .find("cannot reshape f32[B, 3, 4] to [0, 5]") != std::string::npos);
}

TEST_CASE("shape: reshape errors") {
  const TensorType x{DType::kF32, {2, 3}};
  CHECK(error_of(infer_op("reshape", {x}, {{"shape", Ints{4}}}))
            .find("reshape: cannot reshape f32[2, 3] to [4]") != std::string::npos);
  CHECK(
      error_of(infer_op("reshape", {x}, {{"shape", Ints{-1, -1}}})).find("has more than one -1") !=
      std::string::npos);
  CHECK(error_of(infer_op("reshape", {x}, {{"shape", Ints{-1, 4}}}))
            .find("cannot reshape f32[2, 3] to [-1, 4]") != std::string::npos);
  CHECK(error_of(infer_op("reshape", {x}, {{"shape", Ints{1, 6, 0}}}))
            .find("shape[2] = 0 copies a dim that f32[2, 3] does not have") != std::string::npos);
  CHECK(error_of(infer_op("reshape", {x}, {{"shape", Ints{-2, 3}}})).find("has invalid size -2") !=
        std::string::npos);
}

TEST_CASE("shape: transpose") {
  check_values(run1("transpose", {iota({2, 3})}), {3, 2}, {0, 3, 1, 4, 2, 5});
  // y[k, i, 0] = x[i, 0, k]
  check_values(run1("transpose", {iota({2, 1, 3})}, {{"perm", Ints{2, 0, 1}}}), {3, 2, 1},
               {0, 3, 1, 4, 2, 5});
  // i4 packs two values per byte; a transpose must move the nibbles, not the bytes.
  const int64_t v[] = {1, -2, 3, -4};
  Tensor y = run1("transpose", {Tensor::from_i64(DType::kI4, {2, 2}, v)});
  CHECK(y.to_i64() == Ints{1, 3, -2, -4});
  CHECK(type_of(infer_op("transpose", {{DType::kF32, {B, 3}}})) == "f32[3, B]");
  CHECK(error_of(infer_op("transpose", {{DType::kF32, {2, 3}}}, {{"perm", Ints{0, 0}}}))
            .find("perm [0, 0] is not a permutation of the 2 dims") != std::string::npos);
}

TEST_CASE("shape: slice with clamping and negative steps") {
  Tensor x = iota({5});
  check_values(run1("slice", {x}, {{"starts", Ints{-1}}, {"ends", Ints{-6}}, {"steps", Ints{-1}}}),
               {5}, {4, 3, 2, 1, 0});
  check_values(run1("slice", {x},
                    {{"starts", Ints{4}},
                     {"ends", Ints{std::numeric_limits<int64_t>::min()}},
                     {"steps", Ints{-2}}}),
               {3}, {4, 2, 0});
  check_values(run1("slice", {x}, {{"starts", Ints{-100}}, {"ends", Ints{100}}}), {5},
               {0, 1, 2, 3, 4});
  check_values(
      run1("slice", {x}, {{"starts", Ints{1}}, {"ends", Ints{kMax}}, {"steps", Ints{kMax}}}), {1},
      {1});
  check_values(run1("slice", {x}, {{"starts", Ints{3}}, {"ends", Ints{1}}}), {0}, {});
  Tensor m = iota({3, 4});
  check_values(run1("slice", {m},
                    {{"starts", Ints{0, 3}},
                     {"ends", Ints{2, 0}},
                     {"axes", Ints{0, 1}},
                     {"steps", Ints{1, -1}}}),
               {2, 3}, {3, 2, 1, 7, 6, 5});
  check_values(run1("slice", {m}, {{"starts", Ints{1}}, {"ends", Ints{100}}, {"axes", Ints{-1}}}),
               {3, 3}, {1, 2, 3, 5, 6, 7, 9, 10, 11});
}

TEST_CASE("shape: slice shape rule and errors") {
  const TensorType x{DType::kF32, {B, 4}};
  CHECK(type_of(
            infer_op("slice", {x}, {{"starts", Ints{1}}, {"ends", Ints{3}}, {"axes", Ints{1}}})) ==
        "f32[B, 2]");
  CHECK(type_of(infer_op("slice", {x}, {{"starts", Ints{0}}, {"ends", Ints{kMax}}})) ==
        "f32[B, 4]");
  CHECK(type_of(infer_op("slice", {x}, {{"starts", Ints{1}}, {"ends", Ints{kMax}}})) ==
        "f32[?, 4]");
  CHECK(
      error_of(infer_op("slice", {x}, {{"starts", Ints{0}}, {"ends", Ints{1}}, {"steps", Ints{0}}}))
          .find("slice: step of axis 0 is 0") != std::string::npos);
  CHECK(error_of(infer_op("slice", {x}, {{"starts", Ints{0}}, {"ends", Ints{1, 2}}}))
            .find("starts, ends, axes and steps must have the same length, got 1, 2, 1, 1") !=
        std::string::npos);
  CHECK(error_of(infer_op("slice", {x},
                          {{"starts", Ints{0, 0}}, {"ends", Ints{1, 1}}, {"axes", Ints{1, -1}}}))
            .find("axis -1 is sliced twice") != std::string::npos);
  CHECK(
      error_of(infer_op("slice", {x}, {{"starts", Ints{0}}, {"ends", Ints{1}}, {"axes", Ints{2}}}))
          .find("axis 2 is out of range for rank 2") != std::string::npos);
}

TEST_CASE("shape: concat") {
  Tensor a = f32({2, 1}, {1, 2});
  Tensor b = f32({2, 2}, {3, 4, 5, 6});
  check_values(run1("concat", {a, b}, {{"axis", 1}}), {2, 3}, {1, 3, 4, 2, 5, 6});
  check_values(run1("concat", {b, f32({1, 2}, {7, 8}), b}, {{"axis", -2}}), {5, 2},
               {3, 4, 5, 6, 7, 8, 3, 4, 5, 6});
  check_values(run1("concat", {a}, {{"axis", 0}}), {2, 1}, {1, 2});
  CHECK(type_of(infer_op("concat", {{DType::kF32, {B, 2}}, {DType::kF32, {B, 3}}},
                         {{"axis", 1}})) == "f32[B, 5]");
  CHECK(type_of(infer_op("concat", {{DType::kF32, {B, 2}}, {DType::kF32, {4, 2}}},
                         {{"axis", 0}})) == "f32[?, 2]");
  CHECK(type_of(infer_op("concat", {{DType::kF32, {B, 2}}, {DType::kF32, {4, 3}}},
                         {{"axis", 1}})) == "f32[4, 5]");
  CHECK(error_of(infer_op("concat", {{DType::kF32, {2, 2}}, {DType::kF32, {3, 2}}}, {{"axis", 1}}))
            .find("operand 1 f32[3, 2] does not match f32[2, 2] outside axis 1") !=
        std::string::npos);
  CHECK(error_of(infer_op("concat", {{DType::kF32, {2}}, {DType::kI32, {2}}}, {{"axis", 0}}))
            .find("must have the same dtype, got f32 and i32") != std::string::npos);
  CHECK(
      error_of(infer_op("concat", {}, {{"axis", 0}})).find("concat: needs at least one operand") !=
      std::string::npos);
}

TEST_CASE("shape: split") {
  StatusOr<std::vector<Tensor>> r = run_op("split", {iota({5})}, {{"sizes", Ints{2, 3}}}, 2);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  REQUIRE(r->size() == 2);
  check_values((*r)[0], {2}, {0, 1});
  check_values((*r)[1], {3}, {2, 3, 4});
  r = run_op("split", {iota({2, 3})}, {{"axis", 1}, {"sizes", Ints{1, 0, 2}}}, 3);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  check_values((*r)[0], {2, 1}, {0, 3});
  check_values((*r)[1], {2, 0}, {});
  check_values((*r)[2], {2, 2}, {1, 2, 4, 5});
  auto t = infer_op("split", {{DType::kF32, {B, 6}}}, {{"axis", 1}, {"sizes", Ints{2, 4}}}, 2);
  CHECK(type_of(t, 0) == "f32[B, 2]");
  CHECK(type_of(t, 1) == "f32[B, 4]");
}

TEST_CASE("shape: split errors") {
  const TensorType x{DType::kF32, {5}};
  CHECK(error_of(infer_op("split", {x}, {{"sizes", Ints{2, 3}}}, 3))
            .find("sizes [2, 3] make 2 pieces but the node has 3 results") != std::string::npos);
  CHECK(error_of(infer_op("split", {x}, {{"sizes", Ints{2, 2}}}, 2))
            .find("sizes [2, 2] add up to 4 but axis 0 of f32[5] has 5") != std::string::npos);
  CHECK(error_of(infer_op("split", {x}, {{"sizes", Ints{6, -1}}}, 2)).find("has a negative size") !=
        std::string::npos);
}

TEST_CASE("shape: gather with negative indices") {
  const int64_t idx[] = {2, -3};
  check_values(
      run1("gather", {f32({3, 2}, {1, 2, 3, 4, 5, 6}), Tensor::from_i64(DType::kI64, {2}, idx)}),
      {2, 2}, {5, 6, 1, 2});
  // axis 1 with 2-D indices: y[i, j, k] = data[i, indices[j, k]].
  const int64_t idx2[] = {0, 2, 1, -1};
  check_values(
      run1("gather", {iota({2, 3}), Tensor::from_i64(DType::kI32, {2, 2}, idx2)}, {{"axis", 1}}),
      {2, 2, 2}, {0, 2, 1, 2, 3, 5, 4, 5});
  // A scalar index drops the axis.
  check_values(run1("gather", {iota({2, 3}), Tensor::scalar_i64(DType::kI64, 1)}), {3}, {3, 4, 5});
  CHECK(type_of(infer_op("gather", {{DType::kF32, {B, 3}}, {DType::kI64, {Dim::symbol("S")}}},
                         {{"axis", 1}})) == "f32[B, S]");
}

TEST_CASE("shape: gather errors") {
  const int64_t bad[] = {0, 3};
  CHECK(error_of(run_op("gather", {iota({3}), Tensor::from_i64(DType::kI64, {2}, bad)}))
            .find("gather: index 3 is out of range for axis 0 of size 3") != std::string::npos);
  const int64_t neg[] = {-4};
  CHECK(error_of(run_op("gather", {iota({3}), Tensor::from_i64(DType::kI32, {1}, neg)}))
            .find("index -4 is out of range") != std::string::npos);
  CHECK(error_of(infer_op("gather", {{DType::kF32, {3}}, {DType::kF32, {1}}}))
            .find("operand 'indices' must be i32 or i64, got f32") != std::string::npos);
}

TEST_CASE("shape: expand") {
  check_values(run1("expand", {f32({2, 1}, {1, 2})}, {{"shape", Ints{2, 3}}}), {2, 3},
               {1, 1, 1, 2, 2, 2});
  check_values(run1("expand", {f32({3}, {1, 2, 3})}, {{"shape", Ints{2, 1}}}), {2, 3},
               {1, 2, 3, 1, 2, 3});
  CHECK(type_of(infer_op("expand", {{DType::kF32, {B, 1}}}, {{"shape", Ints{1, 4}}})) ==
        "f32[B, 4]");
  CHECK(error_of(infer_op("expand", {{DType::kF32, {3}}}, {{"shape", Ints{2}}}))
            .find("cannot expand f32[3] to [2]") != std::string::npos);
}

TEST_CASE("shape: pad modes") {
  Tensor x = f32({3}, {1, 2, 3});
  check_values(run1("pad", {x}, {{"pads", Ints{2, 1}}, {"value", 9.0}}), {6}, {9, 9, 1, 2, 3, 9});
  check_values(run1("pad", {x}, {{"pads", Ints{2, 1}}}), {6}, {0, 0, 1, 2, 3, 0});
  check_values(run1("pad", {x}, {{"pads", Ints{2, 1}}, {"mode", "reflect"}}), {6},
               {3, 2, 1, 2, 3, 2});
  check_values(run1("pad", {x}, {{"pads", Ints{2, 1}}, {"mode", "edge"}}), {6}, {1, 1, 1, 2, 3, 3});
  // Negative pads crop.
  check_values(run1("pad", {x}, {{"pads", Ints{-1, 0}}}), {2}, {2, 3});
  // 2-D: one row reflected above, one column reflected on the right.
  check_values(
      run1("pad", {f32({2, 2}, {1, 2, 3, 4})}, {{"pads", Ints{1, 0, 0, 1}}, {"mode", "reflect"}}),
      {3, 3}, {3, 4, 3, 1, 2, 1, 3, 4, 3});
  const int64_t v[] = {5, 6};
  Tensor y =
      run1("pad", {Tensor::from_i64(DType::kI32, {2}, v)}, {{"pads", Ints{1, 1}}, {"value", -1}});
  CHECK(y.to_i64() == Ints{-1, 5, 6, -1});
}

TEST_CASE("shape: pad shape rule and errors") {
  CHECK(type_of(infer_op("pad", {{DType::kF32, {B, 3}}}, {{"pads", Ints{0, 1, 0, 1}}})) ==
        "f32[B, 5]");
  CHECK(type_of(infer_op("pad", {{DType::kF32, {B, 3}}}, {{"pads", Ints{1, 0, 0, 0}}})) ==
        "f32[?, 3]");
  const TensorType x{DType::kF32, {3}};
  CHECK(error_of(infer_op("pad", {x}, {{"pads", Ints{3, 0}}, {"mode", "reflect"}}))
            .find("reflect pads of dim 0 must be smaller than its size 3") != std::string::npos);
  CHECK(error_of(infer_op("pad", {x}, {{"pads", Ints{1, 1}}, {"mode", "wrap"}}))
            .find("mode must be \"constant\", \"reflect\" or \"edge\", got \"wrap\"") !=
        std::string::npos);
  CHECK(error_of(infer_op("pad", {x}, {{"pads", Ints{1}}}))
            .find("pads must have 2 * rank = 2 values, got 1") != std::string::npos);
  CHECK(error_of(infer_op("pad", {x}, {{"pads", Ints{-2, -2}}})).find("crop more than dim 0") !=
        std::string::npos);
}

TEST_CASE("shape: squeeze and unsqueeze") {
  check_values(run1("squeeze", {iota({1, 3, 1})}), {3}, {0, 1, 2});
  check_values(run1("squeeze", {iota({1, 3, 1})}, {{"axes", Ints{-1}}}), {1, 3}, {0, 1, 2});
  check_values(run1("unsqueeze", {iota({3})}, {{"axes", Ints{0, -1}}}), {1, 3, 1}, {0, 1, 2});
  CHECK(type_of(infer_op("unsqueeze", {{DType::kF32, {B, 3}}}, {{"axes", Ints{1}}})) ==
        "f32[B, 1, 3]");
  CHECK(type_of(infer_op("squeeze", {{DType::kF32, {B, 1}}}, {{"axes", Ints{1}}})) == "f32[B]");
  CHECK(error_of(infer_op("squeeze", {{DType::kF32, {1, 3}}}, {{"axes", Ints{1}}}))
            .find("cannot squeeze dim 1 of f32[1, 3]: its size is not 1") != std::string::npos);
  CHECK(error_of(infer_op("squeeze", {{DType::kF32, {B, 1}}}))
            .find("cannot tell which dims of f32[B, 1] are 1") != std::string::npos);
  CHECK(error_of(infer_op("unsqueeze", {{DType::kF32, {3}}}, {{"axes", Ints{0, -3}}}))
            .find("axis -3 appears more than once (as axis 0)") != std::string::npos);
  CHECK(error_of(infer_op("unsqueeze", {{DType::kF32, {3}}}))
            .find("missing required attribute 'axes'") != std::string::npos);
}

TEST_CASE("shape: flatten and identity") {
  check_values(run1("flatten", {iota({2, 3, 2})}), {2, 6}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  check_values(run1("flatten", {iota({2, 3})}, {{"axis", 0}}), {1, 6}, {0, 1, 2, 3, 4, 5});
  check_values(run1("flatten", {iota({2, 3})}, {{"axis", 2}}), {6, 1}, {0, 1, 2, 3, 4, 5});
  check_values(run1("flatten", {iota({2, 3, 2})}, {{"axis", -1}}), {6, 2},
               {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  CHECK(type_of(infer_op("flatten", {{DType::kF32, {B, 3, 4}}})) == "f32[B, 12]");
  CHECK(type_of(infer_op("flatten", {{DType::kF32, {B, 3, 4}}}, {{"axis", 2}})) == "f32[?, 4]");
  CHECK(error_of(infer_op("flatten", {{DType::kF32, {2, 3}}}, {{"axis", 3}}))
            .find("axis 3 is out of range for rank 2") != std::string::npos);
  const double h[] = {1.5, -2};
  Tensor x = Tensor::from_f64(DType::kF16, {2}, h);
  CHECK(run1("identity", {x}).identical(x));
  CHECK(type_of(infer_op("identity", {{DType::kBool, {B}}})) == "bool[B]");
}
