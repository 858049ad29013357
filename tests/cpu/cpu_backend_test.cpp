// The cpu backend against the reference interpreter: JIT'd elementwise ops and fused groups
// (broadcasting, every lowered dtype), native kernels, the kernel cache, the backend's options
// (threads, winograd, profile) and error paths.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "kiln/core/driver.h"
#include "kiln/core/kernel_cache.h"
#include "kiln/ir/text.h"
#include "plugin_test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

/// A private, empty kernel cache for the test process (set before any cpu plan is built).
const std::string& test_cache_dir() {
  static const std::string dir = [] {
    fs::path p = fs::temp_directory_path() / ("kiln-cpu-test-cache-" + std::to_string(::getpid()));
    fs::remove_all(p);
    setenv("KILN_CACHE_DIR", p.c_str(), 1);
    return p.string();
  }();
  return dir;
}

/// Compiles `g` on the cpu backend with `threads` and the `given` options (resolved against the
/// backend's declarations, as a pipeline would).
std::unique_ptr<Executable> compile_cpu(const Graph& g, int64_t threads = 2,
                                        std::map<std::string, OptionValue> given = {}) {
  test_cache_dir();
  Registry& reg = test::registry_with({"kiln-plugin-backend-cpu.so", "kiln-plugin-backend-reference.so"});
  auto info = reg.backend("cpu");
  REQUIRE_MESSAGE(info.ok(), info.status().message());
  given["threads"] = threads;
  auto o = resolve_options((*info)->options, given, "backend 'cpu'");
  REQUIRE_MESSAGE(o.ok(), o.status().message());
  auto backend = (*info)->create(*o);
  REQUIRE(backend.ok());
  auto exe = (*backend)->compile(g);
  REQUIRE_MESSAGE(exe.ok(), exe.status().message());
  return std::move(exe).value();
}

/// Tolerances of PyTorch's assert_close for each dtype; integers and bools exact.
/// `loose`: contractions, which sum K products in f32 where the reference sums in f64.
void check_close(const Tensor& got, const Tensor& want, const std::string& what, bool loose = false) {
  REQUIRE(got.dtype() == want.dtype());
  REQUIRE(got.shape() == want.shape());
  double rtol = loose ? 1e-5 : 1.3e-6, atol = loose ? 1e-4 : 1e-5;
  if (want.dtype() == DType::kF16) rtol = 1e-3;
  if (want.dtype() == DType::kBF16) rtol = 1.6e-2;
  if (want.dtype() == DType::kF64) rtol = 1e-7, atol = 1e-7;
  for (int64_t i = 0; i < want.numel(); ++i) {
    if (!is_float(want.dtype())) {
      REQUIRE_MESSAGE(got.get_i64(i) == want.get_i64(i), what << " element " << i);
      continue;
    }
    const double a = got.get_f64(i), e = want.get_f64(i);
    const bool ok = (std::isnan(a) && std::isnan(e)) || a == e || std::fabs(a - e) <= atol + rtol * std::fabs(e);
    REQUIRE_MESSAGE(ok, what << " element " << i << ": got " << a << ", want " << e);
  }
}

/// Parses `kir`, runs it on cpu and reference with the same random inputs, compares.
void check_graph(const std::string& kir, int64_t threads = 2, bool loose = false) {
  auto g = parse_graph(kir);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  std::mt19937 rng(7);
  std::vector<Tensor> ins = test::random_inputs(**g, rng);
  Registry& reg = test::registry_with({"kiln-plugin-backend-reference.so"});
  std::vector<Tensor> want = test::run_reference(reg, **g, ins);
  auto exe = compile_cpu(**g, threads);
  auto got = exe->run(ins);
  REQUIRE_MESSAGE(got.ok(), got.status().message());
  REQUIRE(got->size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) check_close((*got)[i], want[i], kir, loose);
}

TEST_CASE("cpu: unary float ops match the reference in f32, f64, f16 and bf16") {
  for (const char* dt : {"f32", "f64", "f16", "bf16"})
    for (const char* op : {"neg", "abs", "exp", "tanh", "erf", "sigmoid", "relu", "silu", "sin", "cos",
                           "floor", "ceil", "round", "sign", "softplus", "gelu", "leaky_relu"}) {
      const std::string t = std::string(dt) + "[37, 129]";
      check_graph("graph @g(%x: " + t + ") -> (" + t + ") {\n  %y = " + op + "(%x) : " + t +
                  "\n  return %y\n}\n");
    }
  // Positive-domain ops.
  check_graph(R"(graph @g(%x: f32[64, 70]) -> (f32[64, 70]) {
  %a = abs(%x) : f32[64, 70]
  %c = constant() {value = dense<f32[]>[0.5]} : f32[]
  %p = add(%a, %c) : f32[64, 70]
  %l = log(%p) : f32[64, 70]
  %s = sqrt(%p) : f32[64, 70]
  %r = rsqrt(%p) : f32[64, 70]
  %q = reciprocal(%p) : f32[64, 70]
  %w = pow(%p, %x) : f32[64, 70]
  %t1 = add(%l, %s) : f32[64, 70]
  %t2 = add(%r, %q) : f32[64, 70]
  %t3 = add(%t1, %t2) : f32[64, 70]
  %y = add(%t3, %w) : f32[64, 70]
  return %y
})");
}

TEST_CASE("cpu: binary ops broadcast like numpy") {
  for (const char* op : {"add", "sub", "mul", "div", "maximum", "minimum"})
    check_graph(std::string("graph @g(%a: f32[4, 1, 33], %b: f32[5, 1]) -> (f32[4, 5, 33]) {\n  %y = ") + op +
                "(%a, %b) : f32[4, 5, 33]\n  return %y\n}\n");
  check_graph(R"(graph @g(%a: f32[3, 64, 9, 9], %b: f32[1, 64, 1, 1]) -> (f32[3, 64, 9, 9]) {
  %y = add(%a, %b) : f32[3, 64, 9, 9]
  return %y
})");
  check_graph(R"(graph @g(%a: f32[20000], %b: f32[]) -> (f32[20000]) {
  %y = mul(%a, %b) : f32[20000]
  return %y
})");
}

TEST_CASE("cpu: integer, bool, comparison, where, clip, mod and cast") {
  for (const char* dt : {"i64", "i32", "i16", "i8"})
    for (const char* op : {"add", "sub", "mul", "maximum", "minimum"})
      check_graph(std::string("graph @g(%a: ") + dt + "[6, 7], %b: " + dt + "[7]) -> (" + dt +
                  "[6, 7]) {\n  %y = " + op + "(%a, %b) : " + dt + "[6, 7]\n  return %y\n}\n");
  check_graph(R"(graph @g(%a: i32[6, 7], %b: i32[6, 7]) -> (bool[6, 7], i32[6, 7], i32[6, 7], i32[6, 7]) {
  %lt = less(%a, %b) : bool[6, 7]
  %ge = greater_equal(%a, %b) : bool[6, 7]
  %x = xor(%lt, %ge) : bool[6, 7]
  %w = where(%lt, %a, %b) : i32[6, 7]
  %c = clip(%a) {min = -2.5, max = 3.0} : i32[6, 7]
  %n = abs(%a) : i32[6, 7]
  return %x, %w, %c, %n
})");
  // One bound only: the other is the dtype's own limit (i64's does not round-trip through double).
  for (const char* dt : {"i64", "i32", "u8"})
    check_graph(std::string("graph @g(%a: ") + dt + "[6, 7]) -> (" + dt + "[6, 7], " + dt + "[6, 7]) {\n" +
                "  %lo = clip(%a) {min = 0.0} : " + dt + "[6, 7]\n  %hi = clip(%a) {max = 2.0} : " + dt +
                "[6, 7]\n  return %lo, %hi\n}\n");
  check_graph(R"(graph @g(%a: f32[8, 9], %b: f32[8, 9]) -> (f32[8, 9], f32[8, 9], bool[8, 9], i8[8, 9], f16[8, 9], u8[8, 9]) {
  %m = mod(%a, %b) : f32[8, 9]
  %f = mod(%a, %b) {fmod = 1} : f32[8, 9]
  %e = not_equal(%a, %b) : bool[8, 9]
  %k = mul(%a, %b) : f32[8, 9]
  %i = cast(%k) {to = i8} : i8[8, 9]
  %h = cast(%a) {to = f16} : f16[8, 9]
  %u = cast(%i) {to = u8} : u8[8, 9]
  return %m, %f, %e, %i, %h, %u
})");
}

TEST_CASE("cpu: fused groups compile to one kernel each and match the reference") {
  auto g = parse_graph(R"(graph @g(%x: f32[16, 300], %b: f32[300]) -> (f32[16, 300], f32[16, 300]) {
  %y, %z = fused(%x, %b) : f32[16, 300], f32[16, 300] {
    graph @fused(%p: f32[16, 300], %q: f32[300]) -> (f32[16, 300], f32[16, 300]) {
      %h = constant() {value = dense<f32[]>[0.5]} : f32[]
      %s = add(%p, %q) : f32[16, 300]
      %t = tanh(%s) : f32[16, 300]
      %u = mul(%t, %h) : f32[16, 300]
      %v = cast(%u) {to = bf16} : bf16[16, 300]
      %w = cast(%v) {to = f32} : f32[16, 300]
      return %u, %w
    }
  }
  return %y, %z
})");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  std::mt19937 rng(3);
  std::vector<Tensor> ins = test::random_inputs(**g, rng);
  std::vector<Tensor> want = test::run_reference(test::registry_with({"kiln-plugin-backend-reference.so"}), **g, ins);
  auto exe = compile_cpu(**g);
  auto got = exe->run(ins);
  REQUIRE_MESSAGE(got.ok(), got.status().message());
  check_close((*got)[0], want[0], "fused u");
  check_close((*got)[1], want[1], "fused w");
}

TEST_CASE("cpu: native kernels match the reference") {
  check_graph(R"(graph @g(%a: f32[2, 3, 17, 33], %b: f32[33, 20], %c: f32[3, 20, 5]) -> (f32[2, 3, 17, 20], f32[2, 3, 17, 5]) {
  %m = matmul(%a, %b) : f32[2, 3, 17, 20]
  %n = matmul(%m, %c) : f32[2, 3, 17, 5]
  return %m, %n
})", 2, true);
  check_graph(R"(graph @g(%x: f32[5, 40], %w: f32[24, 40], %b: f32[24]) -> (f32[5, 24]) {
  %y = linear(%x, %w, %b) : f32[5, 24]
  return %y
})", 2, true);
  check_graph(R"(graph @g(%x: f32[2, 6, 13, 11], %w: f32[8, 3, 3, 3], %b: f32[8]) -> (f32[2, 8, 7, 6], f32[2, 6, 7, 6], f32[2, 6, 7, 6]) {
  %y = conv(%x, %w, %b) {strides = [2, 2], pads = [1, 1, 1, 1], groups = 2} : f32[2, 8, 7, 6]
  %p = max_pool(%x) {kernel_shape = [3, 3], strides = [2, 2], pads = [1, 1, 1, 1]} : f32[2, 6, 7, 6]
  %q = avg_pool(%x) {kernel_shape = [3, 3], strides = [2, 2], pads = [1, 1, 1, 1], count_include_pad = 1} : f32[2, 6, 7, 6]
  return %y, %p, %q
})", 2, true);
  check_graph(R"(graph @g(%x: f32[4, 7, 50], %s: f32[50], %b: f32[50]) -> (f32[4, 7, 50], f32[4, 7, 50], f32[4, 7, 50], f32[4, 7, 50], f32[4, 1, 50], f32[7, 50]) {
  %a = softmax(%x) {axis = -1} : f32[4, 7, 50]
  %l = log_softmax(%x) {axis = 1} : f32[4, 7, 50]
  %n = layer_norm(%x, %s, %b) {axis = -1, epsilon = 1e-5} : f32[4, 7, 50]
  %r = rms_norm(%x, %s) {axis = -1} : f32[4, 7, 50]
  %m = reduce_max(%x) {axes = [1]} : f32[4, 1, 50]
  %u = reduce_mean(%x) {axes = [0], keepdims = 0} : f32[7, 50]
  return %a, %l, %n, %r, %m, %u
})");
  check_graph(R"(graph @g(%x: f32[4, 6, 10], %y: f32[4, 2, 10], %i: i64[3, 2]) -> (f32[10, 6, 4], f32[4, 8, 10], f32[2, 3, 3], f32[4, 3, 2, 10], f32[4, 6, 10]) {
  %t = transpose(%x) {perm = [2, 1, 0]} : f32[10, 6, 4]
  %c = concat(%x, %y) {axis = 1} : f32[4, 8, 10]
  %s = slice(%x) {starts = [1, 5, 9], ends = [3, 0, 0], steps = [1, -2, -3]} : f32[2, 3, 3]
  %g = gather(%x, %i) {axis = 1} : f32[4, 3, 2, 10]
  %e = expand(%y) {shape = [4, 1, 1]} : f32[4, 2, 10]
  %a, %b = split(%x) {axis = 1, sizes = [2, 4]} : f32[4, 2, 10], f32[4, 4, 10]
  %j = concat(%e, %b) {axis = 1} : f32[4, 6, 10]
  return %t, %c, %s, %g, %j
})");
}

TEST_CASE("cpu: contractions split across the pool match the reference") {
  // Row vectors (gemv), wide and tall products split by columns or rows, batched products
  // one per worker, and a 1x1 convolution with no im2col.
  check_graph(R"(graph @g(%x: f32[1, 512], %w: f32[256, 512], %b: f32[256], %m: f32[300, 70], %n: f32[70, 400]) -> (f32[1, 256], f32[300, 400], f32[1, 400]) {
  %y = linear(%x, %w, %b) : f32[1, 256]
  %p = matmul(%m, %n) : f32[300, 400]
  %s = slice(%m) {starts = [0], ends = [1], axes = [0]} : f32[1, 70]
  %v = matmul(%s, %n) : f32[1, 400]
  return %y, %p, %v
})", 2, true);
  check_graph(R"(graph @g(%a: f32[12, 40, 24], %b: f32[12, 24, 40], %c: f32[600, 12], %d: f32[12, 3]) -> (f32[12, 40, 40], f32[600, 3]) {
  %p = matmul(%a, %b) : f32[12, 40, 40]
  %q = matmul(%c, %d) : f32[600, 3]
  return %p, %q
})", 2, true);
  check_graph(R"(graph @g(%x: f32[1, 16, 20, 30], %w: f32[64, 16, 1, 1], %v: f32[8, 16, 3, 3]) -> (f32[1, 64, 20, 30], f32[1, 8, 10, 15]) {
  %y = conv(%x, %w) : f32[1, 64, 20, 30]
  %z = conv(%x, %v) {strides = [2, 2], pads = [1, 1, 1, 1]} : f32[1, 8, 10, 15]
  return %y, %z
})", 2, true);
}

TEST_CASE("cpu: FP8 quantize is bit for bit the reference's, scaled_matmul and bf16 contractions close to it") {
  // quantize: an f32 quotient rounded to nearest even, saturating (x / 0.004 reaches past 448);
  // scaled_matmul sums exact f8 products in f32 (the reference in f64), then scales and adds bias.
  const std::string kir = R"(graph @g(%x: f32[40, 48], %w: f32[24, 48], %b: f32[24], %g: f32[40, 24]) -> (f8e4m3fn[40, 48], f8e5m2[40, 24], f32[40, 24], f32[24, 48], bf16[40, 24]) {
  %sx = constant() {value = dense<f32[]>[0.004]} : f32[]
  %sw = constant() {value = dense<f32[]>[0.0123]} : f32[]
  %sg = constant() {value = dense<f32[]>[3e-5]} : f32[]
  %xq = quantize(%x, %sx) {dtype = f8e4m3fn} : f8e4m3fn[40, 48]
  %wq = quantize(%w, %sw) {dtype = f8e4m3fn} : f8e4m3fn[24, 48]
  %gq = quantize(%g, %sg) {dtype = f8e5m2} : f8e5m2[40, 24]
  %y = scaled_matmul(%xq, %wq, %sx, %sw, %b) : f32[40, 24]
  %gt = transpose(%gq) {perm = [1, 0]} : f8e5m2[24, 40]
  %xt = transpose(%xq) {perm = [1, 0]} : f8e4m3fn[48, 40]
  %dw = scaled_matmul(%gt, %xt, %sg, %sx) {fast_accumulation = 0} : f32[24, 48]
  %bb = cast(%b) {to = bf16} : bf16[24]
  %yb = scaled_matmul(%xq, %wq, %sx, %sw, %bb) {dtype = bf16} : bf16[40, 24]
  return %xq, %gq, %y, %dw, %yb
})";
  auto g = parse_graph(kir);
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  std::mt19937 rng(3);
  std::vector<Tensor> ins = test::random_inputs(**g, rng);
  std::vector<Tensor> want = test::run_reference(test::registry_with({"kiln-plugin-backend-reference.so"}), **g, ins);
  auto got = compile_cpu(**g)->run(ins);
  REQUIRE_MESSAGE(got.ok(), got.status().message());
  for (size_t i = 0; i < 2; ++i) {
    REQUIRE((*got)[i].nbytes() == want[i].nbytes());
    CHECK(std::memcmp((*got)[i].data(), want[i].data(), want[i].nbytes()) == 0);
  }
  check_close((*got)[2], want[2], "scaled_matmul with bias", true);
  check_close((*got)[3], want[3], "scaled_matmul e5m2 x e4m3", true);
  check_close((*got)[4], want[4], "scaled_matmul to bf16 (autocast's FP8 GEMM)", true);
  // autocast's bf16 contractions: f32 sums, one rounding to bf16.
  check_graph(R"(graph @g(%a: bf16[3, 17, 33], %b: bf16[33, 20], %x: bf16[5, 40], %w: bf16[24, 40], %c: bf16[24]) -> (bf16[3, 17, 20], bf16[5, 24]) {
  %m = matmul(%a, %b) : bf16[3, 17, 20]
  %y = linear(%x, %w, %c) : bf16[5, 24]
  return %m, %y
})", 2, true);
  // accumulate-gemm's sums: bf16 or f32 products added to an f32 c in one sgemm (beta 1).
  check_graph(R"(graph @g(%a: bf16[40, 33], %b: bf16[33, 20], %c: f32[40, 20], %x: f32[7, 90], %w: f32[90, 30], %s: f32[7, 30]) -> (f32[40, 20], f32[7, 30]) {
  %at = transpose(%a) {perm = [1, 0]} : bf16[33, 40]
  %a2 = transpose(%at) {perm = [1, 0]} : bf16[40, 33]
  %y = matmul_acc(%a2, %b, %c) : f32[40, 20]
  %z = matmul_acc(%x, %w, %s) : f32[7, 30]
  return %y, %z
})", 2, true);
}

TEST_CASE("cpu: 3x3 convolutions by Winograd match the reference") {
  // Odd sizes (partial tiles), a batch of 2, bias; weights as an input and as a constant
  // (whose transform the plan keeps: the second run must reuse it correctly).
  check_graph(R"(graph @g(%x: f32[2, 16, 15, 17], %w: f32[24, 16, 3, 3], %b: f32[24]) -> (f32[2, 24, 15, 17]) {
  %y = conv(%x, %w, %b) {pads = [1, 1, 1, 1]} : f32[2, 24, 15, 17]
  return %y
})", 2, true);
  std::string w;
  for (int i = 0; i < 16 * 16 * 9; ++i) w += (i ? ", " : "") + std::to_string(std::sin(i * 0.37) * 0.3);
  auto g = parse_graph("graph @g(%x: f32[1, 16, 14, 14]) -> (f32[1, 16, 14, 14]) {\n"
                       "  %w = constant() {value = dense<f32[16, 16, 3, 3]>[" + w + "]} : f32[16, 16, 3, 3]\n"
                       "  %y = conv(%x, %w) {pads = [1, 1, 1, 1]} : f32[1, 16, 14, 14]\n  return %y\n}\n");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  std::mt19937 rng(9);
  auto exe = compile_cpu(**g);
  Registry& reg = test::registry_with({"kiln-plugin-backend-reference.so"});
  for (int run = 0; run < 2; ++run) {
    std::vector<Tensor> ins = test::random_inputs(**g, rng);
    auto got = exe->run(ins);
    REQUIRE(got.ok());
    check_close((*got)[0], test::run_reference(reg, **g, ins)[0], "winograd run " + std::to_string(run), true);
  }
}

/// The largest |got - want| over the elements.
double max_abs_diff(const Tensor& got, const Tensor& want) {
  double d = 0;
  for (int64_t i = 0; i < want.numel(); ++i)
    d = std::max(d, std::fabs(got.get_f64(i) - want.get_f64(i)));
  return d;
}

TEST_CASE("cpu: option winograd = false computes the 3x3 convolutions by im2col instead") {
  auto g = parse_graph(
      R"(graph @g(%x: f32[2, 32, 15, 17], %w: f32[24, 32, 3, 3], %b: f32[24]) -> (f32[2, 24, 15, 17]) {
  %y = conv(%x, %w, %b) {pads = [1, 1, 1, 1]} : f32[2, 24, 15, 17]
  return %y
})");
  REQUIRE_MESSAGE(g.ok(), g.status().message());
  std::mt19937 rng(11);
  std::vector<Tensor> ins = test::random_inputs(**g, rng);
  Registry& reg = test::registry_with({"kiln-plugin-backend-reference.so"});
  const Tensor want = test::run_reference(reg, **g, ins)[0];
  auto wino = compile_cpu(**g)->run(ins);
  auto im2col = compile_cpu(**g, 2, {{"winograd", false}})->run(ins);
  REQUIRE(wino.ok());
  REQUIRE(im2col.ok());
  check_close((*wino)[0], want, "winograd", true);
  check_close((*im2col)[0], want, "im2col", true);
  // Two different computations: Winograd's transforms round differently from im2col's dot products.
  CHECK_FALSE((*wino)[0].identical((*im2col)[0]));
  CHECK(max_abs_diff((*im2col)[0], (*wino)[0]) > 0);
}

TEST_CASE("cpu: option profile = true reports the plan and per-op times on stderr") {
  auto g = parse_graph(R"(graph @g(%a: f32[8, 16], %w: f32[4, 16]) -> (f32[8, 4]) {
  %y = linear(%a, %w) : f32[8, 4]
  %z = relu(%y) : f32[8, 4]
  return %z
})");
  REQUIRE(g.ok());
  std::mt19937 rng(3);
  std::vector<Tensor> ins = test::random_inputs(**g, rng);
  // stderr into a file while the profiled executable builds its plan and runs.
  auto captured = [&](std::map<std::string, OptionValue> given) {
    const fs::path file =
        fs::temp_directory_path() / ("kiln-cpu-profile-" + std::to_string(::getpid()));
    std::fflush(stderr);
    const int saved = ::dup(2);
    FILE* f = std::fopen(file.c_str(), "w");
    REQUIRE(f != nullptr);
    ::dup2(::fileno(f), 2);
    auto out = compile_cpu(**g, 1, std::move(given))->run(ins);
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    std::fclose(f);
    REQUIRE(out.ok());
    std::ifstream in(file);
    std::stringstream text;
    text << in.rdbuf();
    fs::remove(file);
    return text.str();
  };
  const std::string on = captured({{"profile", true}});
  CHECK(on.find("kiln cpu: plan of 2 steps") != std::string::npos);
  CHECK(on.find("kiln cpu: linear[native]") != std::string::npos);
  CHECK(captured({}).find("kiln cpu:") == std::string::npos);
}

TEST_CASE("cpu: the pipeline's [runtime] threads is the default of the backend's threads") {
  Registry& reg =
      test::registry_with({"kiln-plugin-backend-cpu.so", "kiln-plugin-frontend-kir.so"});
  auto threads_of = [&](const std::string& line) {
    auto p = parse_pipeline_string("kir" + line, reg);
    REQUIRE_MESSAGE(p.ok(), p.status().message());
    REQUIRE(resolve_pipeline_defaults(*p, reg, "model.kir", false).ok());
    return p->backend.options.get_int("threads");
  };
  CHECK(threads_of(" | | cpu | runtime{threads=3}") == 3);
  CHECK(threads_of(" | | cpu{threads=2} | runtime{threads=3}") == 2);  // the backend's own wins
  CHECK(threads_of(" | | cpu") == 0);
}

TEST_CASE("cpu: a wrong option value is refused naming the option") {
  Registry& reg = test::registry_with({"kiln-plugin-backend-cpu.so"});
  auto info = reg.backend("cpu");
  REQUIRE(info.ok());
  auto bad = [&](const std::string& name, OptionValue v) {
    auto o = resolve_options((*info)->options, {{name, std::move(v)}}, "backend 'cpu'");
    REQUIRE_FALSE(o.ok());
    return o.status().message();
  };
  CHECK(bad("winograd", int64_t{0}) ==
        "option 'winograd' for backend 'cpu' expects bool, got int 0");
  CHECK(bad("profile", std::string("yes")) ==
        "option 'profile' for backend 'cpu' expects bool, got string \"yes\"");
  CHECK(bad("threads", true) == "option 'threads' for backend 'cpu' expects int, got bool true");
  auto line = parse_pipeline_string("| | cpu{winograd=no}", reg);
  REQUIRE_FALSE(line.ok());
  CHECK(line.status().message().find("option 'winograd' for backend 'cpu' expects bool") !=
        std::string::npos);
}

TEST_CASE("cpu: max_pool keeps NaN and -inf as the reference does") {
  auto g = parse_graph(R"(graph @g(%x: f32[1, 1, 4, 4]) -> (f32[1, 1, 2, 2]) {
  %p = max_pool(%x) {kernel_shape = [2, 2], strides = [2, 2]} : f32[1, 1, 2, 2]
  return %p
})");
  REQUIRE(g.ok());
  const double inf = INFINITY;
  std::vector<double> v = {1, NAN, -inf, -inf, 2, 5, -inf, -inf, 0, 0, 7, 7, -1, 0, 7, NAN};
  std::vector<Tensor> ins = {Tensor::from_f64(DType::kF32, {1, 1, 4, 4}, v)};
  auto got = compile_cpu(**g)->run(ins);
  REQUIRE(got.ok());
  const Tensor want = test::run_reference(test::registry_with({"kiln-plugin-backend-reference.so"}), **g, ins)[0];
  check_close((*got)[0], want, "max_pool");
  CHECK(std::isnan((*got)[0].get_f64(0)));
  CHECK((*got)[0].get_f64(1) == -inf);
}

TEST_CASE("cpu: softmax handles masked (-inf) and large entries as the reference does") {
  auto g = parse_graph(R"(graph @g(%x: f32[3, 37]) -> (f32[3, 37], f32[3, 37]) {
  %s = softmax(%x) {axis = -1} : f32[3, 37]
  %l = log_softmax(%x) {axis = -1} : f32[3, 37]
  return %s, %l
})");
  REQUIRE(g.ok());
  std::vector<double> v(3 * 37);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(static_cast<double>(i)) * 30.0;
  for (size_t i = 20; i < 37; ++i) v[i] = -INFINITY;   // a causal mask
  v[40] = 88.0, v[41] = 87.5, v[80] = -200.0;          // beyond expf's range once shifted
  std::vector<Tensor> ins = {Tensor::from_f64(DType::kF32, {3, 37}, v)};
  auto got = compile_cpu(**g)->run(ins);
  REQUIRE(got.ok());
  const auto want = test::run_reference(test::registry_with({"kiln-plugin-backend-reference.so"}), **g, ins);
  check_close((*got)[0], want[0], "softmax");
  check_close((*got)[1], want[1], "log_softmax");
  CHECK((*got)[0].get_f64(30) == 0.0);
}

TEST_CASE("cpu: attention matches the reference (causal, grouped heads, broadcast mask)") {
  check_graph(R"(graph @g(%q: f32[2, 4, 5, 8], %k: f32[2, 2, 7, 8], %v: f32[2, 2, 7, 6], %m: f32[5, 7]) -> (f32[2, 4, 5, 6], f32[2, 4, 5, 6]) {
  %y = attention(%q, %k, %v) {scale = 0.35, causal = 1} : f32[2, 4, 5, 6]
  %z = attention(%q, %k, %v, %m) {scale = 0.5} : f32[2, 4, 5, 6]
  return %y, %z
})", 2, true);
  // Sq > Skv with causal: the first query rows see no key and are NaN, as in the reference.
  check_graph(R"(graph @g(%q: f32[1, 2, 6, 4], %k: f32[1, 2, 3, 4], %v: f32[1, 2, 3, 4]) -> (f32[1, 2, 6, 4]) {
  %y = attention(%q, %k, %v) {scale = 0.5, causal = 1} : f32[1, 2, 6, 4]
  return %y
})", 2, true);
}

TEST_CASE("cpu: small integer powers match the reference") {
  check_graph(R"(graph @g(%x: f32[40, 50]) -> (f32[40, 50]) {
  %y = fused(%x) : f32[40, 50] {
    graph @fused(%p: f32[40, 50]) -> (f32[40, 50]) {
      %c1 = constant() {value = dense<f32[]>[1.0]} : f32[]
      %c2 = constant() {value = dense<f32[]>[2.0]} : f32[]
      %c3 = constant() {value = dense<f32[]>[3.0]} : f32[]
      %c4 = constant() {value = dense<f32[]>[4.0]} : f32[]
      %a = pow(%p, %c1) : f32[40, 50]
      %b = pow(%p, %c2) : f32[40, 50]
      %c = pow(%p, %c3) : f32[40, 50]
      %d = pow(%p, %c4) : f32[40, 50]
      %e = add(%a, %b) : f32[40, 50]
      %f = add(%c, %d) : f32[40, 50]
      %g = add(%e, %f) : f32[40, 50]
      return %g
    }
  }
  return %y
})");
}

TEST_CASE("cpu: a fused group with a reduction inside runs its body node by node") {
  // The shape fuse-rows gives a softmax-like row group: not one elementwise kernel.
  check_graph(R"(graph @g(%x: f32[6, 130], %b: f32[130]) -> (f32[6, 130], f32[6, 1]) {
  %y, %m = fused(%x, %b) : f32[6, 130], f32[6, 1] {
    graph @fused(%p: f32[6, 130], %q: f32[130]) -> (f32[6, 130], f32[6, 1]) {
      %s = add(%p, %q) : f32[6, 130]
      %mx = reduce_max(%s) {axes = [1]} : f32[6, 1]
      %d = sub(%s, %mx) : f32[6, 130]
      %e = exp(%d) : f32[6, 130]
      %z = reduce_sum(%e) {axes = [1]} : f32[6, 1]
      %r = div(%e, %z) : f32[6, 130]
      return %r, %mx
    }
  }
  return %y, %m
})");
}

TEST_CASE("cpu: results outlive the next run (the plan reuses its buffers)") {
  // %r aliases %e's buffer and is an output; %t is an intermediate whose buffer is reused.
  auto g = parse_graph(R"(graph @g(%a: f32[8, 16]) -> (f32[128], f32[8, 16]) {
  %t = exp(%a) : f32[8, 16]
  %e = mul(%t, %a) : f32[8, 16]
  %r = reshape(%e) {shape = [128]} : f32[128]
  %y = add(%e, %a) : f32[8, 16]
  return %r, %y
})");
  REQUIRE(g.ok());
  std::mt19937 rng(5);
  std::vector<Tensor> in1 = test::random_inputs(**g, rng), in2 = test::random_inputs(**g, rng);
  Registry& reg = test::registry_with({"kiln-plugin-backend-reference.so"});
  std::vector<Tensor> want1 = test::run_reference(reg, **g, in1), want2 = test::run_reference(reg, **g, in2);
  auto exe = compile_cpu(**g);
  auto got1 = exe->run(in1);
  REQUIRE(got1.ok());
  auto got2 = exe->run(in2);
  REQUIRE(got2.ok());
  for (size_t i = 0; i < 2; ++i) {
    check_close((*got1)[i], want1[i], "first run");
    check_close((*got2)[i], want2[i], "second run");
  }
}

TEST_CASE("cpu: one thread gives the same results") {
  check_graph(R"(graph @g(%a: f32[300, 200], %b: f32[200]) -> (f32[300, 200]) {
  %s = add(%a, %b) : f32[300, 200]
  %y = gelu(%s) {approximate = "tanh"} : f32[300, 200]
  return %y
})", 1);
}

TEST_CASE("cpu: the second build of a graph takes its object code from the kernel cache") {
  const char* kir = R"(graph @g(%a: f32[33, 65]) -> (f32[33, 65]) {
  %e = exp(%a) : f32[33, 65]
  %y = mul(%e, %a) : f32[33, 65]
  return %y
})";
  auto g = parse_graph(kir);
  REQUIRE(g.ok());
  std::mt19937 rng(1);
  std::vector<Tensor> ins = test::random_inputs(**g, rng);
  auto count = [] {
    auto s = KernelCache(test_cache_dir()).stats();
    REQUIRE(s.ok());
    return s->entries;
  };
  REQUIRE(KernelCache(test_cache_dir()).clear().ok());
  auto first = compile_cpu(**g)->run(ins);
  REQUIRE(first.ok());
  CHECK(count() == 1);
  auto second = compile_cpu(**g)->run(ins);  // a new executable: only the cache can help it
  REQUIRE(second.ok());
  CHECK(count() == 1);
  CHECK((*first)[0].identical((*second)[0]));
}

TEST_CASE("cpu: errors name what is at fault") {
  auto g = parse_graph(R"(graph @g(%d: f32[5, 3], %i: i64[2]) -> (f32[2, 3]) {
  %y = gather(%d, %i) : f32[2, 3]
  return %y
})");
  REQUIRE(g.ok());
  auto exe = compile_cpu(**g);
  std::vector<Tensor> ins = {Tensor(DType::kF32, {5, 3}), Tensor::from_i64(DType::kI64, {2}, std::vector<int64_t>{1, 7})};
  auto r = exe->run(ins);
  REQUIRE(!r.ok());
  CHECK(r.status().message() == "cpu: 'gather': index 7 is out of range for axis 0 of size 5");

  std::vector<Tensor> wrong = {Tensor(DType::kF32, {5}), ins[1]};
  auto w = exe->run(wrong);
  REQUIRE(!w.ok());
  CHECK(w.status().message() == "cpu: input 0 must be f32[5, 3], got f32[5]");

  Registry& reg = test::registry_with({"kiln-plugin-backend-cpu.so"});
  Options o;
  o.set("threads", int64_t{-1});
  auto b = (*reg.backend("cpu"))->create(o);
  REQUIRE(!b.ok());
  CHECK(b.status().message() == "cpu: option 'threads' must be 0..4096, got -1");
}

}  // namespace
}  // namespace kiln
