// Tests of the FP8 lowering: scaled_matmul as one cuBLASLt FP8 gemm step with scale pointers,
// the f32 bias kernel, the dequantize fallback (shapes cuBLASLt cannot take, targets without
// FP8), the refusal naming the target, and NVRTC compilation of the q/dq kernels per target.
#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/interpreter.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"
#include "state_graphs.h"

namespace kiln::cuda {
namespace {

/// quantize(x) then scaled_matmul by a constant-free weight input %w f8e4m3fn[n, k].
std::string fp8_graph(int64_t m, int64_t n, int64_t k, const std::string& out, bool bias, const std::string& extra = "",
                      const std::string& act = "f8e4m3fn") {
  const std::string M = std::to_string(m), N = std::to_string(n), K = std::to_string(k);
  const std::string yt = out + "[" + M + ", " + N + "]";
  std::string args = "%x: " + out + "[" + M + ", " + K + "], %w: f8e4m3fn[" + N + ", " + K + "], %sx: f32[], %sw: f32[]";
  std::string ops = "%xq, %w, %sx, %sw";
  if (bias) args += ", %b: " + out + "[" + N + "]", ops += ", %b";
  return "graph @g(" + args + ") -> (" + yt + ") {\n  %xq = quantize(%x, %sx) {dtype = " + act + "} : " + act + "[" +
         M + ", " + K + "]\n  %y = scaled_matmul(" + ops + ") {dtype = " + out + extra + "} : " + yt +
         "\n  return %y\n}\n";
}

StatusOr<LoweredGraph> try_lower(const std::string& text, const LoweringOptions& o = {}) {
  auto g = parse_graph(text);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  return lower_graph(**g, o);
}

LoweredGraph lower(const std::string& text, const LoweringOptions& o = {}) {
  auto l = try_lower(text, o);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  return *l;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

LoweringOptions no_fp8() {
  LoweringOptions o;
  o.fp8 = false;
  o.target = "cuda-sm80: target sm_80";
  return o;
}

TEST_CASE("fp8: scaled_matmul is one cuBLASLt FP8 gemm (TN, scale pointers) after a quantize kernel") {
  const LoweredGraph l = lower(fp8_graph(32, 64, 128, "bf16", true));
  const std::vector<std::string> s = steps(l.plan);
  REQUIRE(s.size() == 2);
  CHECK(has(s[0], "kernel=k0_quantize"));
  CHECK(has(s[1], "step gemm "));
  for (const char* part : {" m=32 n=64 k=128 ", " trans_a=0 trans_b=1 lda=128 ldb=128 ", " dtype=bf16 compute=f32 ",
                           " epilogue=bias ", " a_dtype=f8e4m3fn b_dtype=f8e4m3fn a_scale=b2 b_scale=b3"})
    CHECK_MESSAGE(has(s[1], part), part);
  CHECK(has(l.source, "#include <cuda_fp8.h>"));
  // 32 x 128 elements: eight a thread from one 16-byte load.
  CHECK(has(l.source, "const uint4 raw = reinterpret_cast<const uint4*>(x)[i];"));
  CHECK(has(l.source, "__nv_cvt_float_to_fp8(v[j] / s[0], __NV_SATFINITE, __NV_E4M3)"));
  CHECK(has(s[0], "grid=2,1,1 "));  // 4096 / 8 threads
  // An odd count takes one element a thread.
  const LoweredGraph odd = lower(fp8_graph(3, 16, 21, "bf16", false));
  CHECK(has(odd.source, "__nv_cvt_float_to_fp8(__bfloat162float(x[i]) / s[0], __NV_SATFINITE, __NV_E4M3)"));
}

TEST_CASE("fp8: an f32 result adds its bias in a kernel (cuBLASLt's FP8 bias is bf16); e5m2 activations") {
  const std::vector<std::string> s = steps(lower(fp8_graph(16, 32, 64, "f32", true, "", "f8e5m2")).plan);
  REQUIRE(s.size() == 3);
  CHECK(has(s[1], " epilogue=none "));
  CHECK_FALSE(has(s[1], " bias="));
  CHECK(has(s[1], " a_dtype=f8e5m2 b_dtype=f8e4m3fn "));
  CHECK(has(s[2], "kernel=k1_bias_add"));
}

TEST_CASE("fp8: fast_accumulation = 0 (training's backward GEMMs) asks cuBLASLt for f32 accumulation") {
  CHECK(has(steps(lower(fp8_graph(16, 32, 64, "f32", false)).plan)[1], " fast_accum=1"));
  const std::vector<std::string> s =
      steps(lower(fp8_graph(16, 32, 64, "f32", false, ", fast_accumulation = 0", "f8e5m2")).plan);
  CHECK(has(s[1], " a_dtype=f8e5m2 b_dtype=f8e4m3fn a_scale=b2 b_scale=b3 fast_accum=0"));
}

TEST_CASE("fp8: shapes cuBLASLt's FP8 kernels cannot take dequantize both operands into a 16-bit gemm") {
  const std::vector<std::string> s = steps(lower(fp8_graph(4, 24, 40, "f16", true)).plan);
  REQUIRE(s.size() == 4);  // quantize, dequantize w, dequantize x, gemm
  CHECK(has(s[1], "k1_dequantize"));
  CHECK(has(s[2], "k2_dequantize"));
  CHECK(has(s[3], " dtype=f16 "));
  CHECK(has(s[3], " epilogue=bias"));
  CHECK_FALSE(has(s[3], "a_dtype"));
}

TEST_CASE("fp8: a target without FP8 refuses scaled_matmul by name unless it may fall back") {
  auto refused = try_lower(fp8_graph(16, 32, 64, "bf16", false), no_fp8());
  REQUIRE_FALSE(refused.ok());
  CHECK(has(refused.status().message(),
            "cuda-sm80: target sm_80 has no FP8 tensor cores; scaled_matmul %y needs them (quantize with "
            "fallback=bf16 to run a GEMM on dequantized weights there)"));
  const LoweredGraph l = lower(fp8_graph(16, 32, 64, "bf16", false, ", fallback = \"bf16\""), no_fp8());
  const std::vector<std::string> s = steps(l.plan);
  REQUIRE(s.size() == 4);
  CHECK(has(s[3], " dtype=bf16 "));
  CHECK_FALSE(has(s[3], "a_scale"));
}

TEST_CASE("fp8: a constant f8 weight dequantizes at compile time on the fallback path") {
  const std::string text =
      "graph @g(%x: f32[2, 16]) -> (f32[2, 16]) {\n"
      "  %sx = constant() {value = dense<f32[]>[0.5]} : f32[]\n"
      "  %sw = constant() {value = dense<f32[]>[0.25]} : f32[]\n"
      "  %w = constant() {value = dense<f8e4m3fn[16, 16]>[" + [] {
        std::string v;
        for (int i = 0; i < 256; ++i) v += (i ? ", " : "") + std::to_string(i % 7 - 3);
        return v;
      }() + "]} : f8e4m3fn[16, 16]\n"
      "  %xq = quantize(%x, %sx) : f8e4m3fn[2, 16]\n"
      "  %y = scaled_matmul(%xq, %w, %sx, %sw) {fallback = \"bf16\"} : f32[2, 16]\n"
      "  return %y\n}\n";
  const LoweredGraph l = lower(text, no_fp8());
  const std::vector<std::string> s = steps(l.plan);
  REQUIRE(s.size() == 3);  // quantize, dequantize x, gemm: the weight was dequantized here
  CHECK(has(s[2], " dtype=f32 "));
}

TEST_CASE("fp8: a quantize ending a fused row or pointwise group is stored by that group's kernel") {
  // tests/lit/fuse-quantize-epilogue.kir after fuse-rows,fuse-pointwise.
  const LoweredGraph l = lower(R"(graph @block(%x: bf16[4, 64], %d: bf16[4, 64], %g: bf16[64], %a: bf16[4, 128], %b: bf16[4, 128]) -> (bf16[4, 64], f8e4m3fn[4, 64], f8e4m3fn[4, 128], f32[4, 64], f8e4m3fn[4, 64]) {
  %s = constant() {value = dense<f32[]>[0.25]} : f32[]
  %r, %hq = fused(%x, %d, %g) : bf16[4, 64], f8e4m3fn[4, 64] {
    graph @fused(%x: bf16[4, 64], %d: bf16[4, 64], %g: bf16[64]) -> (bf16[4, 64], f8e4m3fn[4, 64]) {
      %s = constant() {value = dense<f32[]>[0.25]} : f32[]
      %r = add(%x, %d) : bf16[4, 64]
      %h = rms_norm(%r, %g) {axis = -1, epsilon = 1e-05} : bf16[4, 64]
      %hq = quantize(%h, %s) {dtype = f8e4m3fn} : f8e4m3fn[4, 64]
      return %r, %hq
    }
  }
  %pq = fused(%a, %b) : f8e4m3fn[4, 128] {
    graph @fused(%a: bf16[4, 128], %b: bf16[4, 128]) -> (f8e4m3fn[4, 128]) {
      %s2 = constant() {value = dense<f32[]>[0.5]} : f32[]
      %sa = silu(%a) : bf16[4, 128]
      %p = mul(%sa, %b) : bf16[4, 128]
      %pq = quantize(%p, %s2) {dtype = f8e4m3fn} : f8e4m3fn[4, 128]
      return %pq
    }
  }
  %dq = dequantize(%hq, %s) : f32[4, 64]
  %xq = quantize(%x, %s) {dtype = f8e4m3fn} : f8e4m3fn[4, 64]
  return %r, %hq, %pq, %dq, %xq
})");
  // RMSNorm + residual + quantize, SwiGLU + quantize: one kernel each; the dequantize and the
  // quantize of a graph input keep theirs.
  CHECK(l.kernels == std::vector<std::string>{"k0_fused_rms_norm", "k1_fused", "k2_dequantize", "k3_quantize"});
  CHECK(has(l.source, "#include <cuda_fp8.h>"));
  // x / scale in f32, rounded to f8 (saturating) only by the store, as the quantize kernel does.
  CHECK(has(l.source, "(unsigned char)__nv_cvt_float_to_fp8(v"));
  compiles_everywhere(l);
}

TEST_CASE("fp8: an amax ending a fused group is reduced by that group's kernel (memset, atomic max)") {
  // tests/lit/fuse-amax-epilogue.kir after fuse-rows,fuse-pointwise.
  const LoweredGraph l = lower(R"(graph @delayed(%x: bf16[8, 64], %g: bf16[64], %s: f32[], %u: bf16[8, 128], %v: bf16[8, 128]) -> (f8e4m3fn[8, 64], f8e4m3fn[8, 128], f32[], f32[]) {
  %k = constant() {value = dense<f32[]>[2.0]} : f32[]
  %a, %hq = fused(%x, %g, %s) : f32[], f8e4m3fn[8, 64] {
    graph @fused(%x: bf16[8, 64], %g: bf16[64], %s: f32[]) -> (f32[], f8e4m3fn[8, 64]) {
      %h = rms_norm(%x, %g) {axis = -1, epsilon = 1e-05} : bf16[8, 64]
      %a = amax(%h) : f32[]
      %hq = quantize(%h, %s) {dtype = f8e4m3fn} : f8e4m3fn[8, 64]
      return %a, %hq
    }
  }
  %a2, %pq = fused(%u, %v, %s) : f32[], f8e4m3fn[8, 128] {
    graph @fused(%u: bf16[8, 128], %v: bf16[8, 128], %s: f32[]) -> (f32[], f8e4m3fn[8, 128]) {
      %su = silu(%u) : bf16[8, 128]
      %p = mul(%su, %v) : bf16[8, 128]
      %a2 = amax(%p) : f32[]
      %pq = quantize(%p, %s) {dtype = f8e4m3fn} : f8e4m3fn[8, 128]
      return %a2, %pq
    }
  }
  %n = mul(%a, %k) : f32[]
  return %hq, %pq, %n, %a2
})");
  CHECK(l.kernels == std::vector<std::string>{"k0_fused_rms_norm", "k1_fused", "k2_mul"});
  const std::vector<std::string> s = steps(l.plan);
  REQUIRE(s.size() == 5);
  // Each amax result is zeroed, then combined from the blocks' maxima of |x| as f32 bits.
  CHECK(s[0].rfind("step memset ", 0) == 0);
  CHECK(has(s[0], " bytes=4"));
  CHECK(has(s[1], "kernel=k0_fused_rms_norm "));
  CHECK(s[2].rfind("step memset ", 0) == 0);
  CHECK(has(s[2], " bytes=4"));
  CHECK(has(s[3], "kernel=k1_fused "));
  CHECK(has(l.source, "atomicMax(out0, "));
  CHECK(has(l.source, "__float_as_uint(fabsf((float)"));
  compiles_everywhere(l);
}

TEST_CASE("fp8: delayed scaling with a just-in-time first step: quantize stored by x's kernel, requantize in place") {
  const std::string text = jit_delayed_quantize_graph();
  const LoweredGraph l = lower(text);
  INFO(l.plan);
  // y's group stores y, amax(y) and y quantized with its delayed scale; the weight's amax and
  // quantize are one kernel; no standalone amax or quantize is left.
  int fused = 0, requantize = 0, quantize_amax = 0, other_fp8 = 0;
  for (const std::string& k : l.kernels) {
    fused += has(k, "_fused");
    requantize += has(k, "_requantize");
    quantize_amax += has(k, "_quantize_amax");
    other_fp8 += has(k, "_amax") + has(k, "_quantize");
  }
  CHECK(fused >= 1);
  CHECK(requantize == 2);
  CHECK(quantize_amax == 1);
  CHECK(other_fp8 == 2 * quantize_amax);  // its "_quantize" and "_amax"
  // Each requantize writes over the f8 tensor its delayed quantize made (a view of it; the
  // graph's output is a copy), and returns at once while the run's scale is the delayed one.
  auto bufs = named_buffers(l.plan);
  for (const char* t : {"y", "w"}) {
    CAPTURE(t);
    const std::string qd = bufs[std::string(t) + ".qd"].second;
    CHECK(has(qd, " kind=activation "));
    const std::string view = " kind=alias dtype=f8e4m3fn ";
    const std::string base = " base=" + bufs[std::string(t) + ".qd"].first.substr(1) + " name=" + t + ".q";
    int views = 0;
    for (const std::string& line : plan_lines(l.plan, "buffer ")) views += has(line, view) && has(line, base);
    CHECK(views == 1);
  }
  CHECK(has(l.source, "if (__float_as_uint(unless[0]) == __float_as_uint(s[0])) return;"));
  CHECK(has(l.source, "atomicMax(amax, "));
  compiles_everywhere(l);
  // The graph itself: the reference runs it (the GPU test compares against these runs).
  auto g = parse_graph(text);
  REQUIRE(g.ok());
  Interpreter ref;
  Tensor x(DType::kF32, {64, 256});
  for (int64_t i = 0; i < x.numel(); ++i) x.set_f64(i, 0.01 * static_cast<double>(i % 23) - 0.1);
  auto first = ref.run(**g, {&x, 1});
  REQUIRE_MESSAGE(first.ok(), first.status().message());
  CHECK((*first)[2].get_f64(0) == doctest::Approx(3 * 0.12));
  CHECK(ref.variable_value("y.scale")->get_f64(0) == doctest::Approx(3 * 0.12 / 448));
}

TEST_CASE("fp8: fp8-training's delayed-scaling ops: each step scale computed by its requantize, the state by one kernel") {
  const LoweredGraph l = lower(jit_delayed_quantize_graph(true));
  INFO(l.plan);
  int requantize = 0, step_scale = 0, reduce = 0, updates = 0;
  for (const std::string& k : l.kernels) {
    requantize += has(k, "_requantize");
    step_scale += has(k, "_step_scale");
    reduce += has(k, "reduce_max");
    updates += has(k, "_delayed_scaling");
  }
  CHECK(requantize == 2);
  CHECK(step_scale == 0);
  CHECK(reduce == 0);
  CHECK(updates == 1);
  // Each requantize computes the step's scale from the delayed one, the amax and the history,
  // stores it (block 0) and returns at once when it is the delayed one.
  CHECK(has(l.source, "const float s_step = kiln_step_scale(step_amax, step_history, 4, s, (0.00223214296f));"));
  CHECK(has(l.source, "if (__float_as_uint(unless[0]) == __float_as_uint(s_step)) return;"));
  const std::vector<std::string> s = steps(l.plan);
  REQUIRE_FALSE(s.empty());
  CHECK(has(s.back(), "_delayed_scaling grid=2,1,1 "));
  compiles_everywhere(l);

  // A step scale read before its requantize is a kernel of its own.
  const LoweredGraph early = lower(R"(graph @s(%x: f32[64, 256]) -> (f32[], f8e4m3fn[64, 256]) {
  %s = variable() {init = dense<f32[]>[1.0], name = "s"} : f32[]
  %h = variable() {init = dense<f32[4]>[0.0, 0.0, 0.0, 0.0], name = "h"} : f32[4]
  %a = amax(%x) : f32[]
  %qd = quantize(%x, %s) {dtype = f8e4m3fn} : f8e4m3fn[64, 256]
  %now = delayed_scaling_step_scale(%a, %h, %s) {dtype = f8e5m2, margin = 1} : f32[]
  %twice = add(%now, %now) : f32[]
  %q = requantize(%x, %qd, %s, %now) : f8e4m3fn[64, 256]
  return %twice, %q
}
)");
  INFO(early.plan);
  int own = 0;
  for (const std::string& k : early.kernels) own += has(k, "_step_scale");
  CHECK(own == 1);
  CHECK_FALSE(has(early.source, "s_step"));
  compiles_everywhere(early);
}

TEST_CASE("fp8: quantize/dequantize kernels compile with NVRTC for every target") {
  const std::string text =
      "graph @g(%x: bf16[8, 64], %s: f32[], %f: f32[3, 5]) -> (f32[8, 64], f16[8, 64], f8e4m3fn[3, 5], f8e5m2[8, 64]) {\n"
      "  %q = quantize(%x, %s) : f8e4m3fn[8, 64]\n"
      "  %q3 = quantize(%f, %s) : f8e4m3fn[3, 5]\n"
      "  %xf = cast(%x) {to = f32} : f32[8, 64]\n"
      "  %q4 = quantize(%xf, %s) {dtype = f8e5m2} : f8e5m2[8, 64]\n"
      "  %q2 = quantize(%x, %s) {dtype = f8e5m2} : f8e5m2[8, 64]\n"
      "  %y = dequantize(%q, %s) : f32[8, 64]\n"
      "  %z = dequantize(%q2, %s) {dtype = f16} : f16[8, 64]\n"
      "  return %y, %z, %q3, %q4\n}\n";
  const LoweredGraph l = lower(text);
  CHECK(l.kernels.size() == 7);
  compiles_everywhere(l);
}

}  // namespace
}  // namespace kiln::cuda
