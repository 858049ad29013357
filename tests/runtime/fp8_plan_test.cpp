// The plan parser on gemm steps whose operands are narrower than d: FP8 (a_dtype/b_dtype,
// a_scale/b_scale, amax_d) and bf16/f16 into an f32 d; what it accepts and each refusal's message.
#include <doctest/doctest.h>

#include <string>
#include <utility>

#include "kiln/artifact_reader.h"

using namespace kiln::artifact;

namespace {

// x f8[32, 64], w f8[16, 64] (linear layout), d bf16[32, 16], two f32 scales and an f32 d.
const std::string kFp8Head =
    "kiln-plan 1\narena bytes=8192\nworkspace bytes=0\n"
    "buffer 0 kind=input dtype=f8e4m3fn shape=32x64 bytes=2048 offset=0\n"
    "buffer 1 kind=weight dtype=f8e4m3fn shape=16x64 bytes=1024 offset=0\n"
    "buffer 2 kind=output dtype=bf16 shape=32x16 bytes=1024 offset=2048\n"
    "buffer 3 kind=weight dtype=f32 shape=scalar bytes=4 offset=1024\n"
    "buffer 4 kind=weight dtype=f32 shape=scalar bytes=4 offset=1280\n"
    "buffer 5 kind=activation dtype=bf16 shape=16 bytes=32 offset=4096\n"
    "buffer 6 kind=activation dtype=f32 shape=32x16 bytes=2048 offset=4352\n";

std::string fp8_step(const std::string& extra, const std::string& trans = "trans_a=0 trans_b=1",
                     const std::string& ld = "lda=64 ldb=64") {
  return kFp8Head + "step gemm a=b0 b=b1 d=b2 m=32 n=16 k=64 batch=1 " + trans + " " + ld +
         " ldd=16 stride_a=0 stride_b=0 stride_d=0 dtype=bf16 compute=f32 alpha=1 beta=0 epilogue=none" + extra + "\n";
}

std::string plan_error(const std::string& text) {
  Plan p;
  std::string error;
  CHECK(!parse_plan(text, &p, &error));
  return error;
}

}  // namespace

TEST_CASE("fp8 gemm steps: operand dtypes, scale pointers and amax_d are accepted and kept") {
  Plan p;
  std::string error;
  const std::string text = fp8_step(" a_dtype=f8e4m3fn b_dtype=f8e4m3fn a_scale=b3 b_scale=b4 amax_d=b3");
  REQUIRE_MESSAGE(parse_plan(text, &p, &error), error);
  REQUIRE(p.steps.size() == 1);
  CHECK(p.steps[0].attrs.at("a_scale") == "b3");
  CHECK(p.steps[0].attrs.at("b_dtype") == "f8e4m3fn");
  CHECK(p.steps[0].attrs.at("amax_d") == "b3");
  CHECK_MESSAGE(parse_plan(fp8_step(" a_dtype=f8e5m2 b_dtype=f8e4m3fn a_scale=b3 b_scale=b4"), &p, &error), error);
  REQUIRE_MESSAGE(parse_plan(fp8_step(" a_dtype=f8e5m2 b_dtype=f8e4m3fn a_scale=b3 b_scale=b4 fast_accum=0"), &p, &error),
                  error);
  CHECK(p.steps[0].attrs.at("fast_accum") == "0");
}

TEST_CASE("fp8 gemm steps: each malformed one is refused, naming the line and the rule") {
  const std::string scales = " a_scale=b3 b_scale=b4";
  const std::pair<std::string, std::string> cases[] = {
      {fp8_step(" a_dtype=f8e4m3fn b_dtype=f8e4m3fn"), "plan:11: gemm: fp8 needs a_scale= and b_scale="},
      {fp8_step(" a_dtype=f8e4m3fn b_dtype=bf16" + scales),
       "plan:11: gemm: fp8 needs both a_dtype and b_dtype to be f8e4m3fn or f8e5m2"},
      {fp8_step(" a_dtype=f8e5m2 b_dtype=f8e5m2" + scales), "plan:11: gemm: fp8 cannot multiply f8e5m2 by f8e5m2"},
      {fp8_step(" a_dtype=i8 b_dtype=f8e4m3fn" + scales),
       "plan:11: gemm: a_dtype='i8' is not allowed (the gemm's dtype, f8e4m3fn or f8e5m2; bf16 or f16 into an f32 d)"},
      {fp8_step(" a_dtype=f8e4m3fn b_dtype=f8e4m3fn" + scales, "trans_a=0 trans_b=0", "lda=64 ldb=16"),
       "plan:11: gemm: fp8 needs trans_a=0 trans_b=1 (cuBLASLt's TN layout)"},
      {fp8_step(" a_dtype=f8e4m3fn b_dtype=f8e4m3fn" + scales, "trans_a=0 trans_b=1", "lda=72 ldb=65"),
       "plan:11: gemm: fp8 needs lda and ldb to be multiples of 16"},
      {fp8_step(" a_dtype=f8e4m3fn b_dtype=f8e4m3fn a_scale=b5 b_scale=b4"),
       "plan:11: gemm: a_scale buffer 5 must hold an f32, it is bf16"},
      {fp8_step(" a_dtype=f8e4m3fn b_dtype=f8e4m3fn a_scale=b9 b_scale=b4"), "plan:11: buffer 9 is not declared"},
      {fp8_step(scales), "plan:11: gemm: a_scale= is only for fp8 operands (a_dtype/b_dtype)"},
      {fp8_step(" fast_accum=0"), "plan:11: gemm: fast_accum= is only for fp8 operands (a_dtype/b_dtype)"},
      {fp8_step(" a_dtype=f8e4m3fn b_dtype=f8e4m3fn fast_accum=2" + scales), "plan:11: gemm: fast_accum='2' is not 0 or 1"},
  };
  for (const auto& [text, message] : cases) {
    CAPTURE(text);
    CHECK(plan_error(text) == message);
  }
}

namespace {

// a bf16[32, 64], b bf16[64, 16], c/d f32[32, 16]: a bf16 gradient GEMM accumulated into f32.
std::string mixed_step(const std::string& types, const std::string& tail = "compute=f32 alpha=1 beta=1 epilogue=none") {
  return "kiln-plan 1\narena bytes=8192\nworkspace bytes=0\n"
         "buffer 0 kind=input dtype=bf16 shape=32x64 bytes=4096 offset=0\n"
         "buffer 1 kind=input dtype=bf16 shape=64x16 bytes=2048 offset=4096\n"
         "buffer 2 kind=output dtype=f32 shape=32x16 bytes=2048 offset=6144\n"
         "step gemm a=b0 b=b1 d=b2 c=b2 ldc=16 m=32 n=16 k=64 batch=1 trans_a=0 trans_b=0 lda=64 ldb=16 ldd=16 "
         "stride_a=0 stride_b=0 stride_d=0 " + types + " " + tail + "\n";
}

}  // namespace

TEST_CASE("gemm steps: bf16/f16 operands into an f32 d are accepted; other mixes are refused") {
  Plan p;
  std::string error;
  REQUIRE_MESSAGE(parse_plan(mixed_step("dtype=f32 a_dtype=bf16 b_dtype=bf16"), &p, &error), error);
  CHECK(p.steps[0].attrs.at("a_dtype") == "bf16");
  CHECK_MESSAGE(parse_plan(mixed_step("dtype=f32 a_dtype=f16 b_dtype=f16"), &p, &error), error);
  CHECK(plan_error(mixed_step("dtype=f32 a_dtype=bf16 b_dtype=f16")) ==
        "plan:7: gemm: a bf16/f16 a_dtype needs the same b_dtype");
  CHECK(plan_error(mixed_step("dtype=f32 a_dtype=bf16 b_dtype=bf16", "compute=tf32 alpha=1 beta=1 epilogue=none")) ==
        "plan:7: gemm: bf16/f16 operands into an f32 d need compute=f32");
  CHECK(plan_error(mixed_step("dtype=f32 a_dtype=bf16 b_dtype=bf16", "compute=f32 alpha=1 beta=1 epilogue=relu")) ==
        "plan:7: gemm: bf16/f16 operands into an f32 d take no epilogue");
  CHECK(plan_error(mixed_step("dtype=bf16 a_dtype=f16 b_dtype=f16")) ==
        "plan:7: gemm: a_dtype='f16' is not allowed (the gemm's dtype, f8e4m3fn or f8e5m2; bf16 or f16 into an f32 d)");
}
