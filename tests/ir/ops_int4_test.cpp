// Tests of matmul_int4 (packed 4-bit weights with group scales) against hand-computed values.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

/// Packs nibbles (0..15) two per byte, element 2k in the low nibble of byte k.
Tensor pack(int64_t n, int64_t k, const std::vector<int>& nibbles) {
  std::vector<int64_t> bytes(static_cast<size_t>(n * k / 2));
  for (size_t i = 0; i < nibbles.size(); ++i) bytes[i / 2] |= int64_t{nibbles[i] & 0xF} << (i % 2 * 4);
  return ti(DType::kU8, {n, k / 2}, bytes);
}

AttrMap attrs(int64_t g, bool asym = false) {
  AttrMap a{{"group_size", Attribute(g)}};
  if (asym) a["asymmetric"] = Attribute(int64_t{1});
  return a;
}

}  // namespace

TEST_CASE("int4: matmul_int4 is registered as a contraction") {
  const OpDef* def = OpRegistry::global().find("matmul_int4");
  REQUIRE(def != nullptr);
  CHECK(def->has(kTraitContraction));
}

TEST_CASE("int4: symmetric nibbles are signed, low nibble first, one scale per group") {
  for (int64_t g : {32, 64, 128}) {
    CAPTURE(g);
    // K = 2 groups; N = 3 (odd). Row r holds nibble pattern chosen so the sum is checkable by hand:
    // row 0: all 1 (=+1), row 1: all 0xF (=-1), row 2: even k = 7, odd k = 8 (= -8).
    const int64_t k = 2 * g, n = 3;
    std::vector<int> q;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) q.push_back(r == 0 ? 1 : r == 1 ? 0xF : (c % 2 == 0 ? 7 : 8));
    // scales: group 0 = 0.5, group 1 = 2 (rows alike); x = 1 everywhere.
    const Tensor s = tf(DType::kF16, {n, 2}, {0.5, 2, 0.5, 2, 0.5, 2});
    const Tensor x = tf(DType::kF32, {1, k}, std::vector<double>(static_cast<size_t>(k), 1.0));
    const double gd = static_cast<double>(g);
    // row 0: g*0.5 + g*2; row 1: the negation; row 2: per group (g/2)(7 - 8) * scale.
    expect(run1("matmul_int4", {x, pack(n, k, q), s}, attrs(g)), DType::kF32, {1, n},
           {2.5 * gd, -2.5 * gd, -gd / 2 * 0.5 - gd / 2 * 2});
  }
}

TEST_CASE("int4: asymmetric nibbles are unsigned with a zero point per group; bias follows zeros") {
  const int64_t g = 32, k = 64, n = 1;
  std::vector<int> q;
  for (int64_t c = 0; c < k; ++c) q.push_back(c < g ? 15 : static_cast<int>(c % 16));
  const Tensor s = tf(DType::kBF16, {n, 2}, {0.25, 1});
  const Tensor z = tf(DType::kBF16, {n, 2}, {8, 7.5});
  // x = 1 for k < 32 and k even afterwards, 0 for odd k >= 32.
  std::vector<double> xv;
  for (int64_t c = 0; c < k; ++c) xv.push_back(c < g || c % 2 == 0 ? 1 : 0);
  const Tensor x = tf(DType::kBF16, {k}, xv);
  // group 0: 32 * (15 - 8) * 0.25 = 56; group 1: even k in 32..63 have nibbles 0,2,..,14 twice:
  // sum (q - 7.5) = 2 * (56 - 60) = -8.
  expect(run1("matmul_int4", {x, pack(n, k, q), s, z}, attrs(g, true)), DType::kBF16, {1}, {48});
  expect(run1("matmul_int4", {x, pack(n, k, q), s, z, tf(DType::kBF16, {1}, {2})}, attrs(g, true)),
         DType::kBF16, {1}, {50});
}

TEST_CASE("int4: batch dims of x are kept, bias is added per output column, result rounds once") {
  const int64_t g = 64, k = 64, n = 5;
  std::vector<int> q;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) q.push_back(c == r ? 1 : 0);  // row r picks x[r]
  const Tensor s = tf(DType::kF16, {n, 1}, {1, 2, 3, 4, 5});
  std::vector<double> xv(2 * 1 * k, 0.0);
  for (int64_t c = 0; c < 5; ++c) xv[static_cast<size_t>(c)] = 1 + c, xv[static_cast<size_t>(k + c)] = -1;
  const Tensor b = tf(DType::kF16, {n}, {0.5, 0, 0, 0, 1000});
  expect(run1("matmul_int4", {tf(DType::kF16, {2, 1, k}, xv), pack(n, k, q), s, b}, attrs(g)), DType::kF16,
         {2, 1, n}, {1.5, 4, 9, 16, 1025, -0.5, -2, -3, -4, 995});
}

TEST_CASE("int4: shape rule errors name what is wrong") {
  const TensorType x{DType::kF32, shape_of({2, 64})};
  const TensorType w{DType::kU8, shape_of({3, 32})};
  const TensorType s{DType::kF16, shape_of({3, 2})};
  auto err = [](std::vector<TensorType> t, AttrMap a) {
    auto r = infer_op("matmul_int4", std::move(t), std::move(a));
    REQUIRE_FALSE(r.ok());
    return r.status().message();
  };
  CHECK(err({x, w, s}, attrs(48)).find("attribute 'group_size' must be 32, 64 or 128, got 48") != std::string::npos);
  CHECK(err({x, w, s}, {}).find("group_size") != std::string::npos);
  CHECK(err({{DType::kI32, x.shape}, w, s}, attrs(32)).find("operand 'x' must be f32, f16 or bf16") !=
        std::string::npos);
  CHECK(err({x, {DType::kI8, w.shape}, s}, attrs(32)).find("operand 'w' must be u8[N, K/2]") != std::string::npos);
  CHECK(err({x, w, {DType::kF32, s.shape}}, attrs(32)).find("operand 'scales' must be f16 or bf16") !=
        std::string::npos);
  CHECK(err({{DType::kF32, shape_of({2, 96})}, {DType::kU8, shape_of({3, 48})}, s}, attrs(64))
            .find("in_features 96 of x f32[2, 96] is not a multiple of group_size 64") != std::string::npos);
  CHECK(err({x, {DType::kU8, shape_of({3, 64})}, s}, attrs(32)).find("must hold K/2 = 32 bytes per row") !=
        std::string::npos);
  CHECK(err({x, w, {DType::kF16, shape_of({3, 4})}}, attrs(32)).find("must have K/group_size = 2 columns") !=
        std::string::npos);
  CHECK(err({x, w, {DType::kF16, shape_of({4, 2})}}, attrs(32)).find("one row per row of w") != std::string::npos);
  CHECK(err({x, w, s}, attrs(32, true)).find("asymmetric matmul_int4 needs operand 'zeros'") != std::string::npos);
  CHECK(err({x, w, s, {DType::kBF16, s.shape}}, attrs(32, true)).find("operand 'zeros' must match scales") !=
        std::string::npos);
  CHECK(err({x, w, s, {DType::kF16, shape_of({4})}}, attrs(32)).find("operand 'bias' must be f32[3]") !=
        std::string::npos);
  CHECK(err({x, w, s, {DType::kF32, shape_of({3})}, {DType::kF32, shape_of({3})}}, attrs(32))
            .find("symmetric matmul_int4 takes no zeros") != std::string::npos);
  AttrMap bad = attrs(32);
  bad["asymmetric"] = Attribute(int64_t{2});
  CHECK(err({x, w, s}, bad).find("asymmetric") != std::string::npos);
}
