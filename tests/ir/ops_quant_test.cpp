// Tests of the FP8 ops (quantize, dequantize, scaled_matmul, amax) against hand-computed values,
// and of delayed_scaling_update against the core ops it stands for.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "kiln/ir/text.h"
#include "op_test_util.h"

using namespace kiln;
using namespace kiln::test;

namespace {

Tensor scale(double s) { return Tensor::scalar_f64(DType::kF32, s); }

Tensor f8(DType t, std::vector<int64_t> shape, std::vector<double> v) {
  return Tensor::from_f64(t, std::move(shape), v);
}

}  // namespace

TEST_CASE("quant: quantize divides by the scale, rounds to nearest even and saturates") {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor q = run1("quantize", {f32({8}, {1.0, 2.25, 1.0625, 1.1875, 1000, -1000, inf, -0.0}), scale(0.5)});
  CHECK(q.dtype() == DType::kF8E4M3FN);
  // Steps are 0.25 in [2, 4): 2.125 ties between 2.0 (even) and 2.25 -> 2.0; 2.375 ties between
  // 2.25 and 2.5 (even) -> 2.5; overflow and inf saturate to 448.
  check_values(q, {8}, {2, 4.5, 2, 2.5, 448, -448, 448, 0});
  CHECK(q.data_as<uint8_t>()[7] == 0x80);  // negative zero keeps its sign
  Tensor nan = run1("quantize", {f32({1}, {std::nan("")}), scale(1)});
  CHECK(std::isnan(nan.get_f64(0)));
  CHECK(nan.data_as<uint8_t>()[0] == 0x7f);

  Tensor e5 = run1("quantize", {f32({3}, {1e6, -inf, 3.5}), scale(1)}, {{"dtype", DType::kF8E5M2}});
  CHECK(e5.dtype() == DType::kF8E5M2);
  check_values(e5, {3}, {57344, -57344, 3.5});
}

TEST_CASE("quant: quantize divides in f32, as the GPU kernels and PyTorch do") {
  // 0.5 / 0.01f is 50.0000011 in f64 (rounds up to 52 in e4m3's steps of 4 on [32, 64)) but
  // exactly 50 in f32, a tie that rounds to the even 48. Scale 0.01 makes such ties common.
  check_values(run1("quantize", {f32({2}, {0.5, -0.5}), scale(0.01)}), {2}, {48, -48});
}

TEST_CASE("quant: dequantize multiplies by the scale into f32, bf16 or f16") {
  Tensor q = f8(DType::kF8E4M3FN, {3}, {448, -0.5, 0.015625});
  check_values(run1("dequantize", {q, scale(0.25)}), {3}, {112, -0.125, 0.00390625});
  Tensor bf = run1("dequantize", {q, scale(3)}, {{"dtype", DType::kBF16}});
  CHECK(bf.dtype() == DType::kBF16);
  check_values(bf, {3}, {1344, -1.5, 0.046875});
  Tensor round_trip = run1("dequantize", {run1("quantize", {f32({2}, {0.3, -7}), scale(0.02)}), scale(0.02)});
  check_values(round_trip, {2}, {0.3, -7}, 0.07);  // e4m3 keeps 3 mantissa bits: within 2^-4
}

TEST_CASE("quant: scaled_matmul is (a * sa) @ (b * sb)^T + bias") {
  Tensor a = f8(DType::kF8E4M3FN, {2, 2}, {1, 2, 3, 4});
  Tensor b = f8(DType::kF8E4M3FN, {3, 2}, {1, 0, 0, 1, 1, 1});
  check_values(run1("scaled_matmul", {a, b, scale(2), scale(0.5)}), {2, 3}, {1, 2, 3, 3, 4, 7});
  Tensor bias = f32({3}, {10, 20, 30});
  check_values(run1("scaled_matmul", {a, b, scale(2), scale(0.5), bias}), {2, 3}, {11, 22, 33, 13, 24, 37});
  // Leading dims of a are kept; an e5m2 operand mixes with e4m3.
  Tensor a3 = f8(DType::kF8E5M2, {1, 2, 2}, {1, 2, 3, 4});
  Tensor y = run1("scaled_matmul", {a3, b, scale(1), scale(1)}, {{"dtype", DType::kBF16}});
  CHECK(y.dtype() == DType::kBF16);
  check_values(y, {1, 2, 3}, {1, 2, 3, 3, 4, 7});
}

TEST_CASE("quant: amax is the largest magnitude, nan when any element is nan") {
  check_values(run1("amax", {f32({4}, {1, -7.5, 3, 0})}), {}, {7.5});
  CHECK(std::isnan(run1("amax", {f32({3}, {1, std::nan(""), 2})}).get_f64(0)));
}

TEST_CASE("quant: ill-typed operands are refused naming the operand") {
  Tensor a = f8(DType::kF8E4M3FN, {2, 2}, {1, 2, 3, 4});
  CHECK(error_of(run_op("quantize", {f32({2}, {1, 2}), f32({2}, {1, 1})}))
            .find("operand 'scale' must be a per-tensor scale f32[] or f32[1], got f32[2]") != std::string::npos);
  CHECK(error_of(run_op("quantize", {f32({1}, {1}), scale(1)}, {{"dtype", DType::kBF16}}))
            .find("attribute 'dtype' must be one of f8e4m3fn, f8e5m2, got bf16") != std::string::npos);
  CHECK(error_of(run_op("dequantize", {f32({1}, {1}), scale(1)}))
            .find("operand 'q' must be f8e4m3fn or f8e5m2, got f32[1]") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, f8(DType::kF8E4M3FN, {2, 3}, {1, 2, 3, 4, 5, 6}), scale(1), scale(1)}))
            .find("contraction dims differ") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, a, scale(1), scale(1), f32({3}, {1, 2, 3})}))
            .find("operand 'bias' must be f32[2], got f32[3]") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, a, scale(1), scale(1)}, {{"fallback", "int8"}}))
            .find("attribute 'fallback' must be none or bf16, got 'int8'") != std::string::npos);
  CHECK(error_of(run_op("scaled_matmul", {a, a, scale(1), scale(1)}, {{"fast_accumulation", int64_t{2}}}))
            .find("attribute 'fast_accumulation' must be 0 or 1, got 2") != std::string::npos);
}

namespace {

/// One recipe of delayed scaling for the test below.
struct Recipe {
  int64_t history;
  std::string algorithm;
  int64_t margin;
  DType format;
  bool due;
};

std::string zeros_list(int64_t n) {
  std::string s;
  for (int64_t i = 0; i < n; ++i) s += i ? ", 0.0" : "0.0";
  return s;
}

/// Three tensors' state updated two ways in one graph: by delayed_scaling_update (variables
/// new.I.*) and by the core ops it stands for (old.I.*: the roll as reshape, slice and concat,
/// the max as reduce_max, the formula as mul, compare, and, where), from amaxes a0, a1, a2.
/// Returns each tensor's step scale both ways (delayed_scaling_step_scale and its core ops).
std::string delayed_scaling_graph(const Recipe& r) {
  const std::string h = std::to_string(r.history), hist = "f32[" + h + "]";
  const std::string fmt = r.format == DType::kF8E4M3FN ? "f8e4m3fn" : "f8e5m2";
  const double factor = std::ldexp(1.0, static_cast<int>(r.margin)) / (r.format == DType::kF8E4M3FN ? 448.0 : 57344.0);
  char fl[64];
  std::snprintf(fl, sizeof fl, "%.17g", static_cast<double>(static_cast<float>(factor)));
  std::string g = "graph @ds(%a0: f32[], %a1: f32[], %a2: f32[], %due: bool[]) -> (f32[], f32[], f32[], f32[], f32[], "
                  "f32[]) {\n";
  g += "  %factor = constant() {value = dense<f32[]>[" + std::string(fl) + "]} : f32[]\n";
  g += "  %zero = constant() {value = dense<f32[]>[0.0]} : f32[]\n";
  g += "  %big = constant() {value = dense<f32[]>[3.4028234663852886e+38]} : f32[]\n";
  for (int i = 0; i < 3; ++i) {
    const std::string k = std::to_string(i), a = "%a" + k;
    for (const std::string way : {"old", "new"}) {
      const std::string p = "%" + way + k;
      g += "  " + p + "h = variable() {init = dense<" + hist + ">[" + zeros_list(r.history) + "], name = \"" + way + "." +
           k + ".h\"} : " + hist + "\n";
      g += "  " + p + "s = variable() {init = dense<f32[]>[1.0], name = \"" + way + "." + k + ".s\"} : f32[]\n";
    }
    g += "  %new" + k + "ho, %new" + k + "so = delayed_scaling_update(" + a + ", %new" + k + "h, %new" + k + "s" +
         (r.due ? ", %due" : "") + ") {algorithm = \"" + r.algorithm + "\", dtype = " + fmt + ", margin = " +
         std::to_string(r.margin) + "} : " + hist + ", f32[]\n";
    g += "  assign(%new" + k + "ho) {name = \"new." + k + ".h\"}\n";
    g += "  assign(%new" + k + "so) {name = \"new." + k + ".s\"}\n";
    const std::string o = "%old" + k;
    g += "  " + o + "r = reshape(" + a + ") {shape = [1]} : f32[1]\n";
    std::string rolled = o + "r";
    if (r.history > 1) {
      const std::string kept = std::to_string(r.history - 1);
      g += "  " + o + "k = slice(" + o + "h) {ends = [" + kept + "], starts = [0]} : f32[" + kept + "]\n";
      g += "  " + o + "c = concat(" + o + "r, " + o + "k) {axis = 0} : " + hist + "\n";
      rolled = o + "c";
    }
    std::string m = a;
    if (r.algorithm == "max") {
      g += "  " + o + "m = reduce_max(" + rolled + ") {keepdims = 0} : f32[]\n";
      m = o + "m";
    }
    g += "  " + o + "cand = mul(" + m + ", %factor) : f32[]\n";
    g += "  " + o + "pos = greater(" + m + ", %zero) : bool[]\n";
    g += "  " + o + "fin = less_equal(" + m + ", %big) : bool[]\n";
    g += "  " + o + "up = and(" + o + "pos, " + o + "fin) : bool[]\n";
    std::string up = o + "up";
    if (r.due) {
      g += "  " + o + "upd = and(" + up + ", %due) : bool[]\n";
      up = o + "upd";
    }
    g += "  " + o + "next = where(" + up + ", " + o + "cand, " + o + "s) : f32[]\n";
    g += "  %new" + k + "now = delayed_scaling_step_scale(" + a + ", %new" + k + "h, %new" + k + "s) {dtype = " + fmt +
         ", margin = " + std::to_string(r.margin) + "} : f32[]\n";
    g += "  " + o + "seen = reduce_max(" + o + "h) {keepdims = 0} : f32[]\n";
    g += "  " + o + "warm = greater(" + o + "seen, %zero) : bool[]\n";
    g += "  " + o + "own = mul(" + a + ", %factor) : f32[]\n";
    g += "  " + o + "opos = greater(" + a + ", %zero) : bool[]\n";
    g += "  " + o + "ofin = less_equal(" + a + ", %big) : bool[]\n";
    g += "  " + o + "ook = and(" + o + "opos, " + o + "ofin) : bool[]\n";
    g += "  " + o + "first = where(" + o + "ook, " + o + "own, " + o + "s) : f32[]\n";
    g += "  " + o + "now = where(" + o + "warm, " + o + "s, " + o + "first) : f32[]\n";
    g += "  assign(" + (r.history > 1 ? rolled : o + "r") + ") {name = \"old." + k + ".h\"}\n";
    g += "  assign(" + o + "next) {name = \"old." + k + ".s\"}\n";
  }
  return g + "  return %new0now, %old0now, %new1now, %old1now, %new2now, %old2now\n}\n";
}

/// Bitwise equal f32 tensors (every nan alike).
void check_same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  REQUIRE(a.numel() == b.numel());
  for (int64_t i = 0; i < a.numel(); ++i) {
    const float x = static_cast<float>(a.get_f64(i)), y = static_cast<float>(b.get_f64(i));
    INFO(what << " element " << i << ": " << x << " vs " << y);
    CHECK(((std::isnan(x) && std::isnan(y)) || std::memcmp(&x, &y, sizeof x) == 0));
  }
}

}  // namespace

TEST_CASE("quant: delayed_scaling_update and _step_scale match the core ops of delayed scaling, step by step") {
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  // a0: ordinary amaxes with a zero, a nan and an inf among them; a1: always zero (the scale
  // must stay 1); a2: a nan first, then values (a nan poisons the max while it is in the history).
  const std::vector<double> a0 = {0, 3.5, 1e-30, 100, nan, 2, 0, inf, 7, 0.25, 1e30, 5, 5, 3, 2, 1, 0.5, 9, 0, 4};
  const std::vector<double> a2 = {nan, 1, 2, 3, 4, 0.5, 0.25, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  const Recipe recipes[] = {{16, "max", 0, DType::kF8E4M3FN, false},
                            {1, "max", 2, DType::kF8E5M2, false},
                            {16, "most_recent", -1, DType::kF8E4M3FN, false},
                            {4, "max", 0, DType::kF8E5M2, true}};
  for (const Recipe& r : recipes) {
    INFO("history " << r.history << ", " << r.algorithm << ", margin " << r.margin << ", due " << r.due);
    auto g = parse_graph(delayed_scaling_graph(r));
    REQUIRE_MESSAGE(g.ok(), g.status().message());
    Interpreter interp;
    for (size_t step = 0; step < a0.size(); ++step) {
      const Tensor in[] = {Tensor::scalar_f64(DType::kF32, a0[step]), Tensor::scalar_f64(DType::kF32, 0.0),
                           Tensor::scalar_f64(DType::kF32, a2[step]), Tensor::scalar_f64(DType::kBool, step % 3 == 1)};
      auto out = interp.run(**g, {in, 4});
      REQUIRE_MESSAGE(out.ok(), out.status().message());
      for (int i = 0; i < 3; ++i)  // the step scales, from the state before this step
        check_same_bits((*out)[2 * i], (*out)[2 * i + 1], "step " + std::to_string(step) + " step scale " + std::to_string(i));
      for (int i = 0; i < 3; ++i)
        for (const char* part : {".h", ".s"}) {
          const std::string k = std::to_string(i) + part;
          check_same_bits(*interp.variable_value("new." + k), *interp.variable_value("old." + k),
                          "step " + std::to_string(step) + " tensor " + k);
        }
    }
    CHECK(interp.variable_value("new.1.s")->get_f64(0) == 1.0);  // an all-zero amax never moves the scale
  }
  // With history 16 and max, tensor 0's nan (step 4) stays in the history to the last step and
  // keeps the scale the steps before it gave: 100 / 448, not 1e30's.
  auto g = parse_graph(delayed_scaling_graph(recipes[0]));
  REQUIRE(g.ok());
  Interpreter interp;
  for (size_t step = 0; step < a0.size(); ++step) {
    const Tensor in[] = {Tensor::scalar_f64(DType::kF32, a0[step]), Tensor::scalar_f64(DType::kF32, 0.0),
                         Tensor::scalar_f64(DType::kF32, a2[step]), Tensor::scalar_f64(DType::kBool, false)};
    REQUIRE(interp.run(**g, {in, 4}).ok());
  }
  CHECK(interp.variable_value("new.0.s")->get_f64(0) == doctest::Approx(100.0 / 448.0).epsilon(1e-6));
  CHECK(interp.variable_value("new.0.h")->get_f64(0) == 4.0);  // newest first
}

TEST_CASE("quant: delayed_scaling_update's shape rule names what is wrong") {
  const TensorType s{DType::kF32, {}}, h{DType::kF32, {16}};
  auto t = infer_op("delayed_scaling_update", {s, h, s}, {}, 2);
  REQUIRE(t.ok());
  CHECK((*t)[0].str() == "f32[16]");
  CHECK((*t)[1].str() == "f32[]");
  CHECK(error_of(infer_op("delayed_scaling_update", {s, TensorType{DType::kF32, {4, 4}}, s}, {}, 2)) ==
        "delayed_scaling_update: operand 'history' must be f32[H] with a static H >= 1, got f32[4, 4]");
  CHECK(error_of(infer_op("delayed_scaling_update", {s, h, s, TensorType{DType::kF32, {}}}, {}, 2)) ==
        "delayed_scaling_update: operand 'due' must be one bool, got f32[]");
  CHECK(error_of(infer_op("delayed_scaling_update", {s, h, s}, {{"algorithm", "mean"}}, 2)) ==
        "delayed_scaling_update: attribute 'algorithm' must be max or most_recent, got 'mean'");
  CHECK(error_of(infer_op("delayed_scaling_update", {s, h, s}, {{"dtype", DType::kBF16}}, 2)) ==
        "delayed_scaling_update: attribute 'dtype' must be f8e4m3fn or f8e5m2, got bf16");
}
