// Tuned algorithm fields of plan gemm and conv steps without a GPU: what the parser accepts and
// keeps, each refusal's message (naming the step's line), and the version-4 C API's checks.
#include <doctest/doctest.h>

#include <string>
#include <utility>

#include "kiln/artifact_reader.h"
#include "kiln/runtime.h"

using namespace kiln::artifact;

namespace {

const std::string kHead =
    "kiln-plan 1\narena bytes=65536\nworkspace bytes=0\n"
    "buffer 0 kind=input dtype=bf16 shape=2x8x4 bytes=128 offset=0\n"
    "buffer 1 kind=weight dtype=bf16 shape=4x6 bytes=48 offset=0\n"
    "buffer 2 kind=output dtype=bf16 shape=2x8x6 bytes=192 offset=256\n"
    "buffer 3 kind=input dtype=f32 shape=2x4x8x8 bytes=2048 offset=512\n"
    "buffer 4 kind=weight dtype=f32 shape=6x4x3x3 bytes=864 offset=64\n"
    "buffer 5 kind=output dtype=f32 shape=2x6x8x8 bytes=3072 offset=4096\n";
const std::string kGemm =
    "step gemm a=b0 b=b1 d=b2 m=8 n=6 k=4 batch=2 trans_a=0 trans_b=0 lda=4 ldb=6 ldd=6 stride_a=32 stride_b=0 "
    "stride_d=48 dtype=bf16 compute=f32 alpha=1 beta=0 epilogue=none";
const std::string kConv =
    "step conv x=b3 w=b4 y=b5 n=2 c=4 k=6 spatial=8,8 kernel=3,3 pad=1,1 stride=1,1 dilation=1,1 groups=1 "
    "dtype=f32 activation=none";

/// 64 bytes of a made-up cublasLtMatmulAlgo_t in hex.
std::string algo_hex() {
  std::string s;
  for (int i = 0; i < 64; ++i) s += "0123456789abcdef"[i % 16], s += "fedcba9876543210"[i % 16];
  return s;
}

std::string plan_error(const std::string& text) {
  Plan p;
  std::string error;
  CHECK(!parse_plan(text, &p, &error));
  return error;
}

std::pair<kiln_status_code, std::string> outcome(kiln_status* st) {
  std::pair<kiln_status_code, std::string> r{kiln_status_get_code(st), st ? kiln_status_get_message(st) : ""};
  kiln_status_release(st);
  return r;
}

}  // namespace

TEST_CASE("tuned algo fields: gemm algo= and conv algo= algo_math= parse and are kept as written") {
  Plan p;
  std::string error;
  const std::string text = kHead + kGemm + " algo=" + algo_hex() + "\n" + kConv +
                           " math=tf32 algo=implicit_precomp_gemm algo_math=tensor_op_allow_conversion\n" + kConv +
                           " math=f32 algo=direct algo_math=fma\n" + kGemm + "\n";
  REQUIRE_MESSAGE(parse_plan(text, &p, &error), error);
  REQUIRE(p.steps.size() == 4);
  CHECK(p.steps[0].attrs.at("algo") == algo_hex());
  CHECK(p.steps[1].attrs.at("algo") == "implicit_precomp_gemm");
  CHECK(p.steps[1].attrs.at("algo_math") == "tensor_op_allow_conversion");
  CHECK(p.steps[2].attrs.at("algo_math") == "fma");
  // A plan without the fields (every plan before autotuning) parses as before.
  CHECK(p.steps[3].attrs.count("algo") == 0);
  CHECK(std::size(kConvAlgoNames) == 8);
  CHECK(std::size(kConvMathNames) == 4);
}

TEST_CASE("tuned algo fields: a malformed choice is refused with the step's line") {
  const std::string hex = algo_hex();
  const std::pair<std::string, std::string> cases[] = {
      {kGemm + " algo=xyz", "plan:10: gemm: algo='xyz' is not 128 lowercase hex digits (a tuned cublasLtMatmulAlgo_t)"},
      {kGemm + " algo=" + hex.substr(2),
       "plan:10: gemm: algo='" + hex.substr(2) + "' is not 128 lowercase hex digits (a tuned cublasLtMatmulAlgo_t)"},
      {kGemm + " algo=" + hex.substr(1) + "G",
       "plan:10: gemm: algo='" + hex.substr(1) + "G' is not 128 lowercase hex digits (a tuned cublasLtMatmulAlgo_t)"},
      {kGemm + " algo_math=fma", "plan:10: unknown attribute 'algo_math' on 'step gemm'"},
      {kConv + " math=tf32 algo=direct", "plan:10: conv: algo= and algo_math= must be given together"},
      {kConv + " math=tf32 algo_math=fma", "plan:10: conv: algo= and algo_math= must be given together"},
      {kConv + " math=tf32 algo=cudnn_best algo_math=fma", "plan:10: conv: algo='cudnn_best' is not a cuDNN forward algorithm"},
      {kConv + " math=tf32 algo=direct algo_math=fast",
       "plan:10: conv: algo_math='fast' is not default, tensor_op, tensor_op_allow_conversion or fma"},
      {kConv + " math=f32 algo=winograd algo_math=fma",
       "plan:10: conv: algo=winograd algo_math=fma is not exact enough for math=f32"},
      {kConv + " math=f32 algo=implicit_gemm algo_math=tensor_op",
       "plan:10: conv: algo=implicit_gemm algo_math=tensor_op is not exact enough for math=f32"},
  };
  for (const auto& [step, want] : cases) {
    INFO(step);
    CHECK(plan_error(kHead + step + "\n") == want);
  }
}

TEST_CASE("the version-4 table appends step_problem and tune_step and both check their arguments") {
  CHECK(KILN_RUNTIME_API_VERSION >= 4);
  const kiln_api* v4 = kiln_get_api(4);
  REQUIRE(v4 != nullptr);
  CHECK((v4->model_profile_steps == &kiln_model_profile_steps));
  CHECK((v4->model_step_problem == &kiln_model_step_problem));
  CHECK((v4->model_tune_step == &kiln_model_tune_step));
  char buf[16];
  auto r = outcome(kiln_model_step_problem(nullptr, 0, buf, sizeof buf));
  CHECK(r.first == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(r.second == "kiln_model_step_problem: model is NULL");
  r = outcome(kiln_model_step_problem(reinterpret_cast<const kiln_model*>(8), 0, nullptr, 0));
  CHECK(r.second == "kiln_model_step_problem: out is NULL");
  kiln_tune_result t{};
  r = outcome(kiln_model_tune_step(nullptr, 0, 8, 5, &t));
  CHECK(r.second == "kiln_model_tune_step: model is NULL");
  r = outcome(kiln_model_tune_step(reinterpret_cast<kiln_model*>(8), 0, 8, 5, &t));
  CHECK(r.first == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(r.second == "kiln_model_tune_step: out_result->struct_size is 0; set it to sizeof(kiln_tune_result)");
}
