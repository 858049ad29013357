// Plan `conv` steps without a GPU: what the parser accepts, each refusal's message, and the
// error a conv plan gives where cuDNN cannot be loaded (simulated with KILN_CUDNN_LIBRARY).
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "../common/skip.h"
#include "conv.h"
#include "kiln/artifact_reader.h"

using namespace kiln::artifact;

namespace {

// x f32[2, 4, 8, 8], w f32[6, 2, 3, 3] (groups 2), y/z f32[2, 6, 4, 4], bias f32[6], h f16 x.
const std::string kConvHead =
    "kiln-plan 1\narena bytes=65536\nworkspace bytes=0\n"
    "buffer 0 kind=input dtype=f32 shape=2x4x8x8 bytes=2048 offset=0\n"
    "buffer 1 kind=weight dtype=f32 shape=6x2x3x3 bytes=432 offset=0\n"
    "buffer 2 kind=output dtype=f32 shape=2x6x4x4 bytes=768 offset=2048\n"
    "buffer 3 kind=weight dtype=f32 shape=6 bytes=24 offset=512\n"
    "buffer 4 kind=activation dtype=f32 shape=2x6x4x4 bytes=768 offset=4096\n"
    "buffer 5 kind=activation dtype=f16 shape=2x4x8x8 bytes=1024 offset=8192\n";

std::string conv_step(const std::string& fields) { return kConvHead + "step conv " + fields + "\n"; }

const std::string kGood =
    "x=b0 w=b1 y=b2 bias=b3 z=b4 n=2 c=4 k=6 spatial=8,8 kernel=3,3 pad=1,1 stride=2,2 dilation=1,1 groups=2 "
    "dtype=f32 math=tf32 activation=relu";

std::string plan_error(const std::string& text) {
  Plan p;
  std::string error;
  CHECK(!parse_plan(text, &p, &error));
  return error;
}

std::string replace(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  REQUIRE(at != std::string::npos);
  return s.replace(at, from.size(), to);
}

}  // namespace

TEST_CASE("conv steps: a 2-D conv with bias, residual and relu, and a 1-D one, parse with their fields kept") {
  Plan p;
  std::string error;
  const std::string text =
      conv_step(kGood) + "step conv x=b0 w=b1 y=b2 n=2 c=4 k=1 spatial=64 kernel=9 pad=0 stride=1 dilation=2 "
                         "groups=1 dtype=f32 math=f32 activation=none\n";
  REQUIRE_MESSAGE(parse_plan(text, &p, &error), error);
  REQUIRE(p.steps.size() == 2);
  CHECK(p.steps[0].kind == PlanStep::Kind::kConv);
  CHECK(p.steps[0].line == 10);
  CHECK(p.steps[0].attrs.at("z") == "b4");
  CHECK(p.steps[0].attrs.at("spatial") == "8,8");
  CHECK(p.steps[0].attrs.at("math") == "tf32");
  CHECK(p.steps[1].attrs.at("kernel") == "9");
  CHECK(p.steps[1].attrs.count("bias") == 0);
}

TEST_CASE("conv steps: each malformed one is refused, naming the line and the field") {
  const std::pair<std::string, std::string> cases[] = {
      {conv_step(replace(kGood, " groups=2", "")), "plan:10: 'step conv' needs groups="},
      {conv_step(kGood + " beta=1"), "plan:10: unknown attribute 'beta' on 'step conv'"},
      {conv_step(replace(kGood, "dtype=f32", "dtype=f8e4m3fn")), "plan:10: conv: dtype='f8e4m3fn' is not allowed"},
      {conv_step(replace(kGood, "activation=relu", "activation=gelu")), "plan:10: conv: activation='gelu' is not allowed"},
      {conv_step(replace(replace(kGood, "dtype=f32", "dtype=f16"), "x=b0", "x=b5")),
       "plan:10: conv: math=tf32 needs dtype=f32"},
      {conv_step(replace(kGood, "groups=2", "groups=4")), "plan:10: conv: groups=4 does not divide c=4 and k=6"},
      {conv_step(replace(kGood, "n=2", "n=0")), "plan:10: conv: n, c, k and groups must be positive"},
      {conv_step(replace(kGood, "kernel=3,3", "kernel=3")),
       "plan:10: conv: spatial, kernel, pad, stride and dilation must have the same number of dims"},
      {conv_step(replace(kGood, "stride=2,2", "stride=2,0")), "plan:10: conv: stride='2,0' is not a list of integers >= 1"},
      {conv_step(replace(kGood, "pad=1,1", "pad=1,x")), "plan:10: conv: pad='1,x' is not a list of integers >= 0"},
      {conv_step(replace(replace(replace(replace(replace(kGood, "spatial=8,8", "spatial=2,2,2,2"), "kernel=3,3", "kernel=1,1,1,1"),
                                         "pad=1,1", "pad=0,0,0,0"), "stride=2,2", "stride=1,1,1,1"), "dilation=1,1", "dilation=1,1,1,1")),
       "plan:10: conv: spatial='2,2,2,2' has more than 3 spatial dims"},
      {conv_step(replace(kGood, "dilation=1,1", "dilation=5,1")),
       "plan:10: conv: kernel dim 0 (11 with dilation) exceeds the padded input (10)"},
      {conv_step(replace(kGood, "x=b0", "x=b5")), "plan:10: conv: x buffer 5 is f16, the conv is f32"},
      {conv_step(replace(kGood, "c=4", "c=8")), "plan:10: conv: x needs 1024 elements, buffer 0 has 2048 bytes"},
      {conv_step(replace(kGood, "z=b4", "z=b3")), "plan:10: conv: z needs 192 elements, buffer 3 has 24 bytes"},
      {conv_step(replace(kGood, "bias=b3", "bias=b9")), "plan:10: buffer 9 is not declared"},
  };
  for (const auto& [text, message] : cases) {
    CAPTURE(text);
    CHECK(plan_error(text) == message);
  }
}

TEST_CASE("a conv plan where cuDNN cannot be loaded fails naming the library and the step") {
  Plan p;
  std::string error;
  REQUIRE_MESSAGE(parse_plan(conv_step(kGood), &p, &error), error);
  const char* saved = std::getenv("KILN_CUDNN_LIBRARY");
  const std::string restore = saved ? saved : "";
  setenv("KILN_CUDNN_LIBRARY", "/nonexistent/libcudnn.so.9", 1);
  std::unique_ptr<kiln::rt::CudnnContext> ctx;
  kiln_status* st = kiln::rt::CudnnContext::create(p.steps[0], nullptr, &ctx);
  REQUIRE(st != nullptr);
  CHECK(st->code == KILN_STATUS_UNSUPPORTED);
  CHECK(st->message.rfind("plan:10: conv needs cuDNN 9 (/nonexistent/libcudnn.so.9): /nonexistent/libcudnn.so.9: ", 0) == 0);
  CHECK(st->message.find("No such file") != std::string::npos);
  kiln_status_release(st);
  // A library that loads but is not cuDNN.
  setenv("KILN_CUDNN_LIBRARY", "libc.so.6", 1);
  CHECK(kiln::rt::load_cudnn(&error) == nullptr);
  CHECK(error == "libc.so.6 has no function cudnnGetVersion");
  if (saved) setenv("KILN_CUDNN_LIBRARY", restore.c_str(), 1);
  else unsetenv("KILN_CUDNN_LIBRARY");
}

TEST_CASE("libcudnn.so.9, where the loader finds it, is cuDNN 9 with every function the conv steps call") {
  std::string error;
  const kiln::rt::CudnnApi* api = kiln::rt::load_cudnn(&error);
  if (!api) {
    kiln::test::skip("cuDNN 9 not found (" + error + "); set LD_LIBRARY_PATH to check the real library");
    return;
  }
  CHECK(api->version / 10000 == 9);
  const bool resolved = api->cudnnConvolutionBiasActivationForward != nullptr;
  CHECK(resolved);
  CHECK(kiln::rt::load_cudnn(&error) == api);  // loaded once
}
