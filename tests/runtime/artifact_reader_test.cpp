// Tests for the artifact reader: header and section checks, the plan parser and its reference
// checks, and `describe`. Artifacts come from artifact_builder.h, independent of core's writer.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "artifact_builder.h"
#include "host_round.h"
#include "kiln/artifact_reader.h"

using namespace kiln::artifact;
using kiln::test::build_artifact;
using kiln::test::TestSection;

namespace {

const std::string kHead = "kiln-plan 1\narena bytes=1024\nworkspace bytes=0\n";
const std::string kX = "buffer 0 kind=input dtype=f32 shape=2x3 bytes=24 offset=0 name=x\n";

/// Uses every kind of line, buffer and step.
const std::string kPlan =
    "kiln-plan 1\n"
    "# a comment line\n"
    "arena bytes=1024   # trailing comment\n"
    "workspace bytes=64\n"
    "buffer 0 kind=input dtype=f32 shape=2x3 bytes=24 offset=0 name=x\n"
    "buffer 1 kind=activation dtype=f32 shape=2x3 bytes=24 offset=256\n"
    "buffer 2 kind=output dtype=f32 shape=2x3 bytes=24 offset=512 name=y\n"
    "buffer 3 kind=weight dtype=f32 shape=3 bytes=12 offset=256 name=w\n"
    "buffer 4 kind=alias dtype=f32 shape=3 bytes=12 offset=12 base=1\n"
    "buffer 5 kind=weight dtype=bf16 shape=scalar bytes=2 offset=0\n"
    "input x buffer=0\n"
    "output y buffer=2\n"
    "kernel add_k\n"
    "\n"
    "step launch kernel=add_k grid=2,1,1 block=128,1,1 smem=48 args=b0,b3,b1,i-6,f0.5\n"
    "step gemm a=b0 b=b3 d=b1 m=2 n=1 k=3 batch=1 trans_a=0 trans_b=0 lda=3 ldb=1 ldd=1 stride_a=0 stride_b=0 "
    "stride_d=0 dtype=f32 compute=tf32 alpha=1 beta=0 epilogue=none\n"
    "step copy src=b1 dst=b2 bytes=24\n"
    "step memset dst=b1 bytes=24\n";

std::vector<TestSection> sections(const std::string& plan = kPlan, const std::string& weights = std::string(512, 'w')) {
  return {{kSectionMeta, "meta", "kiln_version=0.1.0\nformat_version=1\ntargets=sm_80,sm_90a\ncreated_by=kiln compile\n"},
          {kSectionPlan, "plan", plan},
          {kSectionImage, "sm_80.cubin", "CUBIN80"},
          {kSectionImage, "compute_90a.ptx", "PTX90A"},
          {kSectionSource, "sm_80.cu", "// src"},
          {kSectionWeights, "weights", weights}};
}

std::string read_error(const std::string& bytes) {
  std::string error;
  CHECK(read_artifact(bytes, "m.kiln", &error) == nullptr);
  return error;
}

std::string plan_error(const std::string& text) {
  Plan p;
  std::string error;
  CHECK(!parse_plan(text, &p, &error));
  return error;
}

uint64_t le(const std::string& s, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}

/// Rewrites entry `i` of the section table (offset, size, checksum) and re-seals the table,
/// so only the entry's contents are wrong.
std::string patch_entry(std::string f, int i, uint64_t offset, uint64_t size, uint64_t checksum) {
  const uint64_t t = le(f, 16), count = le(f, 12) & 0xffffffff;
  const size_t at = t + static_cast<size_t>(i) * sizeof(SectionEntry);
  std::memcpy(f.data() + at + 8, &offset, 8);
  std::memcpy(f.data() + at + 16, &size, 8);
  std::memcpy(f.data() + at + 24, &checksum, 8);
  const uint64_t sum = fnv1a64(f.data() + t, count * sizeof(SectionEntry));
  std::memcpy(f.data() + 32, &sum, 8);
  return f;
}

uint64_t entry_field(const std::string& f, int i, int field_offset) {
  return le(f, le(f, 16) + static_cast<size_t>(i) * sizeof(SectionEntry) + static_cast<size_t>(field_offset));
}

}  // namespace

TEST_CASE("read_artifact accepts a well-formed artifact and exposes its parts") {
  const std::string bytes = build_artifact(sections());
  std::string error;
  auto a = read_artifact(bytes, "m.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  CHECK(a->format_version == 1);
  CHECK(a->storage->size() == bytes.size());
  CHECK(a->sections.size() == 6);
  CHECK(a->meta.at("targets") == "sm_80,sm_90a");
  CHECK(a->meta.at("created_by") == "kiln compile");
  CHECK(a->plan_text == kPlan);
  CHECK(a->weights == std::string(512, 'w'));
  CHECK(a->images.size() == 2);
  CHECK(a->images.at("sm_80.cubin") == "CUBIN80");
  CHECK(a->images.at("compute_90a.ptx") == "PTX90A");
  CHECK(a->sources.at("sm_80") == "// src");
  // Views point into the shared storage, so they outlive the bytes passed in.
  CHECK(a->plan_text.data() >= a->storage->data());
  CHECK(a->plan_text.data() + a->plan_text.size() <= a->storage->data() + a->storage->size());
}

TEST_CASE("parse_plan reads every line kind") {
  Plan p;
  std::string error;
  REQUIRE_MESSAGE(parse_plan(kPlan, &p, &error), error);
  CHECK(p.arena_bytes == 1024);
  CHECK(p.workspace_bytes == 64);
  REQUIRE(p.buffers.size() == 6);
  const PlanBuffer& x = p.buffers[0];
  CHECK(x.id == 0);
  CHECK(x.kind == PlanBuffer::Kind::kInput);
  CHECK(x.dtype == "f32");
  CHECK(x.shape == std::vector<int64_t>{2, 3});
  CHECK(x.bytes == 24);
  CHECK(x.name == "x");
  CHECK(p.buffers[1].kind == PlanBuffer::Kind::kActivation);
  CHECK(p.buffers[1].offset == 256);
  CHECK(p.buffers[2].kind == PlanBuffer::Kind::kOutput);
  CHECK(p.buffers[3].kind == PlanBuffer::Kind::kWeight);
  CHECK(p.buffers[4].kind == PlanBuffer::Kind::kAlias);
  CHECK(p.buffers[4].base == 1);
  CHECK(p.buffers[4].offset == 12);
  CHECK(p.buffers[5].shape.empty());
  CHECK(p.buffers[5].dtype == "bf16");
  CHECK(p.inputs == std::vector<std::pair<std::string, int>>{{"x", 0}});
  CHECK(p.outputs == std::vector<std::pair<std::string, int>>{{"y", 2}});
  CHECK(p.kernels == std::vector<std::string>{"add_k"});
  REQUIRE(p.steps.size() == 4);
  const PlanStep& l = p.steps[0];
  CHECK(l.kind == PlanStep::Kind::kLaunch);
  CHECK(l.line == 15);
  CHECK(l.kernel == "add_k");
  CHECK(l.grid[0] == 2);
  CHECK(l.grid[1] == 1);
  CHECK(l.block[0] == 128);
  CHECK(l.smem == 48);
  REQUIRE(l.args.size() == 5);
  CHECK(l.args[0].kind == LaunchArg::Kind::kBuffer);
  CHECK(l.args[1].buffer == 3);
  CHECK(l.args[3].kind == LaunchArg::Kind::kInt64);
  CHECK(l.args[3].i64 == -6);
  CHECK(l.args[4].kind == LaunchArg::Kind::kFloat32);
  CHECK(l.args[4].f32 == 0.5f);
  CHECK(p.steps[1].kind == PlanStep::Kind::kGemm);
  CHECK(p.steps[1].attrs.at("compute") == "tf32");
  CHECK(p.steps[1].attrs.at("k") == "3");
  CHECK(p.steps[2].kind == PlanStep::Kind::kCopy);
  CHECK(p.steps[2].attrs.at("dst") == "b2");
  CHECK(p.steps[3].kind == PlanStep::Kind::kMemset);
  CHECK(p.steps[3].line == 18);
}

TEST_CASE("parse_plan reads variable lines: weight buffers the plan's copies write, by name") {
  const std::string w = "buffer 1 kind=weight dtype=f32 shape=3 bytes=12 offset=0 name=w\n";
  Plan p;
  std::string error;
  REQUIRE_MESSAGE(parse_plan(kHead + kX + w + "input x buffer=0\nvariable w.exp_avg buffer=1\nkernel k\n", &p, &error), error);
  REQUIRE(p.variables.size() == 1);
  CHECK(p.variables[0] == std::pair<std::string, int>{"w.exp_avg", 1});
  CHECK(plan_error(kHead + kX + w + "variable v buffer=0\n") == "plan:6: variable 'v': buffer 0 is not of kind weight");
  CHECK(plan_error(kHead + kX + w + "variable v buffer=2\n") == "plan:6: variable 'v': buffer '2' is not declared");
  CHECK(plan_error(kHead + kX + w + "variable v buffer=1\nvariable v buffer=1\n") == "plan:7: variable 'v' declared twice");
  CHECK(plan_error(kHead + kX + w + "variable v\n") == "plan:6: expected 'variable NAME buffer=ID [copy_of=NAME]'");
  CHECK(plan_error(kHead + kX + w + "kernel k\nvariable v buffer=1\n") ==
        "plan:7: 'variable' out of order (lines go: kiln-plan, arena, workspace, [mesh], buffer, input, output, "
        "[variable], kernel, step)");
}

TEST_CASE("parse_plan reads a weight's low-precision copy (copy_of) and checks what it names") {
  const std::string bufs = "buffer 1 kind=weight dtype=f32 shape=3 bytes=12 offset=0 name=w\n"
                           "buffer 2 kind=weight dtype=bf16 shape=3 bytes=6 offset=16 name=w.bf16\n"
                           "buffer 3 kind=weight dtype=bf16 shape=2 bytes=4 offset=32 name=v\n";
  Plan p;
  std::string error;
  REQUIRE_MESSAGE(parse_plan(kHead + kX + bufs + "variable w buffer=1\nvariable w.bf16 buffer=2 copy_of=w\nkernel k\n", &p, &error),
                  error);
  REQUIRE(p.variables.size() == 2);
  CHECK(p.variable_copies == std::map<std::string, std::string>{{"w.bf16", "w"}});
  CHECK(plan_error(kHead + kX + bufs + "variable w.bf16 buffer=2 copy_of=w\nvariable w buffer=1\n") ==
        "plan:8: variable 'w.bf16': copy_of 'w' is not a variable declared before it (and not a copy itself)");
  CHECK(plan_error(kHead + kX + bufs + "variable w buffer=1\nvariable v buffer=3 copy_of=w\n") ==
        "plan:9: variable 'v': its shape is not that of 'w', its copy_of");
  CHECK(plan_error(kHead + kX + bufs + "variable w buffer=1\nvariable w.bf16 buffer=2 copy_of=w\nvariable v buffer=3 copy_of=w.bf16\n") ==
        "plan:10: variable 'v': copy_of 'w.bf16' is not a variable declared before it (and not a copy itself)");
}

TEST_CASE("the runtime rounds a written weight into its bf16/f16 copy as the cast kernels do") {
  auto bf16 = [](float f) { return kiln::rt::round_to_bf16(f); };
  auto f16 = [](float f) { return kiln::rt::round_to_f16(f); };
  CHECK(bf16(1.0f) == 0x3f80);
  CHECK(bf16(1.0f + 0x1p-8f) == 0x3f80);        // a tie goes to even
  CHECK(bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);    // a tie goes to even, up
  CHECK(bf16(-2.0f) == 0xc000);
  CHECK(bf16(std::numeric_limits<float>::max()) == 0x7f80);  // rounds up to inf
  CHECK((bf16(std::nanf("")) & 0x7fc0) == 0x7fc0);
  CHECK(f16(1.0f) == 0x3c00);
  CHECK(f16(1.0f + 0x1p-11f) == 0x3c00);
  CHECK(f16(1.0f + 3 * 0x1p-11f) == 0x3c02);
  CHECK(f16(65504.0f) == 0x7bff);
  CHECK(f16(65519.0f) == 0x7bff);
  CHECK(f16(65520.0f) == 0x7c00);
  CHECK(f16(-1e10f) == 0xfc00);
  CHECK(f16(0x1p-14f) == 0x0400);               // the smallest normal
  CHECK(f16(0x1p-24f) == 0x0001);               // the smallest subnormal
  CHECK(f16(0x1p-25f) == 0x0000);               // a tie goes to even (zero)
  CHECK(f16(3 * 0x1p-25f) == 0x0002);
  CHECK(f16(0x1p-14f - 0x1p-26f) == 0x0400);    // rounds up into the normals
  CHECK((f16(std::nanf("")) & 0x7e00) == 0x7e00);
  std::vector<uint16_t> out;
  const float w[2] = {1.0f, -0.5f};
  CHECK(kiln::rt::round_f32_copy(KILN_DTYPE_F32, KILN_DTYPE_BF16, w, sizeof w, &out));
  CHECK(out == std::vector<uint16_t>{0x3f80, 0xbf00});
  CHECK_FALSE(kiln::rt::round_f32_copy(KILN_DTYPE_F32, KILN_DTYPE_F8E4M3FN, w, sizeof w, &out));
}

TEST_CASE("parse_plan: a launch without smem or args, and CRLF line ends") {
  Plan p;
  std::string error;
  REQUIRE_MESSAGE(parse_plan("kiln-plan 1\r\narena bytes=0\r\nworkspace bytes=0\r\nkernel k\r\n"
                             "step launch kernel=k grid=1,1,1 block=32,1,1\r\nstep launch kernel=k grid=1,1,1 block=32,1,1 args=\r\n",
                             &p, &error),
                  error);
  REQUIRE(p.steps.size() == 2);
  CHECK(p.steps[0].smem == 0);
  CHECK(p.steps[0].args.empty());
  CHECK(p.steps[1].args.empty());
}

TEST_CASE("parse_plan refuses malformed plans, naming the line") {
  const std::string k = kHead + kX + "kernel k\n";
  const std::string gemm = "step gemm a=b0 b=b0 d=b0 m=2 n=3 k=3 batch=1 trans_a=0 trans_b=0 lda=3 ldb=3 ldd=3 "
                           "stride_a=0 stride_b=0 stride_d=0 dtype=f32 compute=f32 alpha=1 beta=0";
  const std::pair<std::string, std::string> cases[] = {
      {"", "plan:0: empty plan: expected 'kiln-plan 1'"},
      {"kiln-plan 2\n", "plan:1: plan format version '2'; this runtime reads 1"},
      {"arena bytes=1\n", "plan:1: expected 'kiln-plan 1' first"},
      {"kiln-plan 1\nworkspace bytes=0\n", "plan:2: missing 'arena' line"},
      {"kiln-plan 1\narena bytes=8\n", "plan:2: missing 'workspace' line"},
      {"kiln-plan 1\narena bytes=x\n", "plan:2: bytes='x' is not a valid number"},
      {"kiln-plan 1\narena bytes=-1\n", "plan:2: bytes='-1' is not a valid number"},
      {"kiln-plan 1\narena\n", "plan:2: 'arena' needs bytes="},
      {kHead + "frob x=1\n", "plan:4: unknown line 'frob'"},
      {kHead + "arena bytes=1\n",
       "plan:4: 'arena' out of order (lines go: kiln-plan, arena, workspace, [mesh], buffer, input, output, [variable], kernel, step)"},
      {kHead + kX + "input x buffer=0\n" + kX, "plan:6: 'buffer' out of order (lines go: kiln-plan, arena, workspace, [mesh], buffer, input, output, [variable], kernel, step)"},
      {kHead + "buffer 1 kind=input dtype=f32 shape=2x3 bytes=24 offset=0\n",
       "plan:4: buffer 1: expected id 0 (ids are 0..count-1 in order)"},
      {kHead + "buffer x\n", "plan:4: expected 'buffer ID ...'"},
      {kHead + "buffer 0 kind=tmp dtype=f32 shape=2x3 bytes=24 offset=0\n", "plan:4: buffer 0: unknown kind 'tmp'"},
      {kHead + "buffer 0 kind=input dtype=f33 shape=2x3 bytes=24 offset=0\n", "plan:4: buffer 0: unknown dtype 'f33'"},
      {kHead + "buffer 0 kind=input dtype=f32 shape=2xx3 bytes=24 offset=0\n", "plan:4: buffer 0: bad shape '2xx3'"},
      {kHead + "buffer 0 kind=input dtype=f32 shape=2x3 bytes=20 offset=0\n",
       "plan:4: buffer 0: 20 bytes cannot hold f32 of shape 2x3"},
      {kHead + "buffer 0 kind=input dtype=i4 shape=3 bytes=1 offset=0\n", "plan:4: buffer 0: 1 bytes cannot hold i4 of shape 3"},
      {kHead + "buffer 0 kind=input dtype=f32 shape=2x3 bytes=24 offset=1008\n",
       "plan:4: buffer 0: bytes [1008, +24) outside the arena of 1024 bytes"},
      {kHead + "buffer 0 kind=input dtype=f32 shape=2x3 bytes=24\n", "plan:4: 'buffer' needs offset="},
      {kHead + "buffer 0 kind=input dtype=f32 shape=2x3 bytes=24 offset=0 foo=1\n", "plan:4: unknown attribute 'foo' on 'buffer'"},
      {kHead + "buffer 0 kind=input dtype=f32 shape=2x3 bytes=24 bytes=24 offset=0\n", "plan:4: attribute 'bytes' given twice"},
      {kHead + "buffer 0 kind=input dtype=f32 oops shape=2x3 bytes=24 offset=0\n", "plan:4: expected key=value, got 'oops'"},
      {kHead + kX + "buffer 1 kind=alias dtype=f32 shape=3 bytes=12 offset=0\n", "plan:5: buffer 1: an alias needs base=ID"},
      {kHead + kX + "buffer 1 kind=alias dtype=f32 shape=3 bytes=12 offset=0 base=1\n",
       "plan:5: buffer 1: base '1' is not a buffer declared before it"},
      {kHead + kX + "buffer 1 kind=alias dtype=f32 shape=3 bytes=12 offset=16 base=0\n",
       "plan:5: buffer 1: bytes [16, +12) outside its base buffer 0 of 24 bytes"},
      {kHead + kX + "buffer 1 kind=activation dtype=f32 shape=3 bytes=12 offset=256 base=0\n",
       "plan:5: buffer 1: base= is only for kind=alias"},
      {kHead + kX + "input z buffer=3\n", "plan:5: input 'z': buffer '3' is not declared"},
      {kHead + kX + "input x\n", "plan:5: expected 'input NAME buffer=ID [placement=...]'"},
      {kHead + "buffer 0 kind=activation dtype=f32 shape=2x3 bytes=24 offset=0\ninput a buffer=0\n",
       "plan:5: input 'a': buffer 0 is not of kind input"},
      {kHead + kX + "input x buffer=0\ninput x buffer=0\n", "plan:6: input 'x' declared twice"},
      {kHead + kX + "output y buffer=0\noutput y buffer=0\n", "plan:6: output 'y' declared twice"},
      {k + "kernel k\n", "plan:6: kernel 'k' declared twice"},
      {k + "step launch kernel=q grid=1,1,1 block=1,1,1\n", "plan:6: kernel 'q' is not declared"},
      {k + "step launch kernel=k grid=1,1 block=1,1,1\n", "plan:6: grid='1,1' is not three positive integers X,Y,Z"},
      {k + "step launch kernel=k grid=1,1,1 block=0,1,1\n", "plan:6: block='0,1,1' is not three positive integers X,Y,Z"},
      {k + "step launch kernel=k grid=1,1,1\n", "plan:6: 'step launch' needs block="},
      {k + "step launch kernel=k grid=1,1,1 block=1,1,1 args=b9\n", "plan:6: buffer 9 is not declared"},
      {k + "step launch kernel=k grid=1,1,1 block=1,1,1 args=b0,x1\n", "plan:6: bad launch argument 'x1' (expected bID, iN or fN)"},
      {k + "step launch kernel=k grid=1,1,1 block=1,1,1 args=fz\n", "plan:6: bad launch argument 'fz' (expected bID, iN or fN)"},
      {k + "step launch kernel=k grid=1,1,1 block=1,1,1 regs=4\n", "plan:6: unknown attribute 'regs' on 'step launch'"},
      {k + "step\n", "plan:6: expected 'step KIND ...'"},
      {k + "step frob\n", "plan:6: unknown step 'frob'"},
      {k + "step copy src=b0 dst=b0 bytes=32\n", "plan:6: copy of 32 bytes exceeds buffer 0 (24 bytes)"},
      {k + "step copy src=bx dst=b0 bytes=4\n", "plan:6: expected a buffer reference bID, got 'bx'"},
      {k + "step memset dst=b0\n", "plan:6: 'step memset' needs bytes="},
      {k + gemm + " epilogue=none\n", "plan:6: gemm: operand b spans more than buffer 0's 24 bytes"},
      {k + "step gemm a=b0 b=b0 d=b0 m=2 n=3 k=3 batch=1 trans_a=0 trans_b=0 lda=2 ldb=3 ldd=3 stride_a=0 stride_b=0 "
           "stride_d=0 dtype=f32 compute=f32 alpha=1 beta=0 epilogue=none\n",
       "plan:6: gemm: lda=2 is less than 3 columns"},
      {k + gemm + " epilogue=none dtype=f64\n", "plan:6: attribute 'dtype' given twice"},
      {k + gemm + " epilogue=sigmoid\n", "plan:6: gemm: epilogue='sigmoid' is not allowed"},
      {k + gemm + " epilogue=bias\n", "plan:6: gemm: bias= must be given exactly when the epilogue adds a bias or writes its gradient"},
      {k + gemm + " epilogue=none c=b0\n", "plan:6: gemm: c= needs ldc="},
      {k + gemm + " epilogue=none bias=b0\n", "plan:6: gemm: bias= must be given exactly when the epilogue adds a bias or writes its gradient"},
      {k + gemm + " epilogue=bgrad_a\n",
       "plan:6: gemm: bias= must be given exactly when the epilogue adds a bias or writes its gradient"},
      {k + "step gemm a=b0\n", "plan:6: 'step gemm' needs b="},
  };
  for (const auto& [text, message] : cases) {
    CAPTURE(text);
    CHECK(plan_error(text) == message);
  }
}

TEST_CASE("gemm bounds use strides, transposes and batches") {
  // a: 2 batches of [2,3] f32 (48 bytes) read transposed as [3,2] with lda=2; b: shared [3,1].
  const std::string head = kHead +
                           "buffer 0 kind=input dtype=f32 shape=2x2x3 bytes=48 offset=0\n"
                           "buffer 1 kind=activation dtype=f32 shape=3 bytes=12 offset=256\n"
                           "buffer 2 kind=output dtype=f32 shape=2x2 bytes=16 offset=512\n";
  auto gemm = [&](const std::string& stride_a) {
    return head + "step gemm a=b0 b=b1 d=b2 m=2 n=1 k=3 batch=2 trans_a=1 trans_b=0 lda=2 ldb=1 ldd=1 stride_a=" +
           stride_a + " stride_b=0 stride_d=2 dtype=f32 compute=f32 alpha=1 beta=0 epilogue=none\n";
  };
  Plan p;
  std::string error;
  CHECK_MESSAGE(parse_plan(gemm("6"), &p, &error), error);
  CHECK(plan_error(gemm("7")) == "plan:7: gemm: operand a spans more than buffer 0's 48 bytes");
}

TEST_CASE("a bias gradient has an element per row of the operand it sums: m for bgrad_a, n for bgrad_b") {
  // D [4, 2] = A [4, 3] @ B [3, 2]; bias buffers of 4 and 2 f32.
  const std::string head = kHead +
                           "buffer 0 kind=input dtype=f32 shape=4x3 bytes=48 offset=0\n"
                           "buffer 1 kind=input dtype=f32 shape=3x2 bytes=24 offset=256\n"
                           "buffer 2 kind=output dtype=f32 shape=4x2 bytes=32 offset=512\n"
                           "buffer 3 kind=output dtype=f32 shape=4 bytes=16 offset=768\n"
                           "buffer 4 kind=output dtype=f32 shape=2 bytes=8 offset=896\n";
  auto gemm = [&](const std::string& epilogue, int bias) {
    return head + "step gemm a=b0 b=b1 d=b2 bias=b" + std::to_string(bias) +
           " m=4 n=2 k=3 batch=1 trans_a=0 trans_b=0 lda=3 ldb=2 ldd=2 stride_a=0 stride_b=0 stride_d=0 dtype=f32 "
           "compute=f32 alpha=1 beta=0 epilogue=" + epilogue + "\n";
  };
  Plan p;
  std::string error;
  CHECK_MESSAGE(parse_plan(gemm("bgrad_a", 3), &p, &error), error);
  CHECK_MESSAGE(parse_plan(gemm("bgrad_b", 4), &p, &error), error);
  CHECK(plan_error(gemm("bgrad_a", 4)) == "plan:9: gemm: operand bias spans more than buffer 4's 8 bytes");
}

TEST_CASE("read_artifact refuses bad headers with the documented messages") {
  const std::string good = build_artifact(sections());
  const std::string n = std::to_string(good.size());
  CHECK(read_error("") == "m.kiln: not a Kiln artifact (bad magic)");
  CHECK(read_error("PK\3\4 this is a zip file, not an artifact at all; long enough to hold a header") ==
        "m.kiln: not a Kiln artifact (bad magic)");
  CHECK(read_error(good.substr(0, 30)) == "m.kiln: truncated: 30 bytes, shorter than the 64-byte header");
  CHECK(read_error(good.substr(0, good.size() - 1)) ==
        "m.kiln: truncated: " + std::to_string(good.size() - 1) + " bytes, header says " + n);
  CHECK(read_error(good + "x") == "m.kiln: size mismatch: " + std::to_string(good.size() + 1) + " bytes, header says " + n);
  std::string v2 = good;
  v2[8] = 2;
  CHECK(read_error(v2) == "m.kiln: format version 2; this runtime reads 1");
  std::string table = good;
  table[le(good, 16) + 40] ^= 1;  // a section name byte
  CHECK(read_error(table) == "m.kiln: corrupt section table (checksum mismatch)");
  std::string far = good;
  const uint64_t huge = 1ull << 40;
  std::memcpy(far.data() + 16, &huge, 8);
  CHECK(read_error(far) == "m.kiln: section table (offset 1099511627776, 6 entries) lies outside the file");
}

TEST_CASE("read_artifact refuses corrupt, misplaced and overlapping sections") {
  const std::string good = build_artifact(sections());
  const uint64_t plan_off = entry_field(good, 1, 8), plan_size = entry_field(good, 1, 16);
  std::string flipped = good;
  flipped[plan_off + 3] ^= 0x20;
  CHECK(read_error(flipped) == "m.kiln: corrupt section 'plan' (checksum mismatch)");

  CHECK(read_error(patch_entry(good, 1, good.size() - 10, 100, entry_field(good, 1, 24))) ==
        "m.kiln: section 'plan' (offset " + std::to_string(good.size() - 10) + ", 100 bytes) lies outside the file of " +
            std::to_string(good.size()) + " bytes");
  CHECK(read_error(patch_entry(good, 1, ~0ull - 4, 100, 0)).find("section 'plan' (offset 18446744073709551611, 100 bytes) lies outside") !=
        std::string::npos);
  CHECK(read_error(patch_entry(good, 1, plan_off + 1, plan_size - 1, fnv1a64(good.data() + plan_off + 1, plan_size - 1))) ==
        "m.kiln: section 'plan' is not 64-byte aligned");
  // The plan entry pointing at the meta bytes: checksums hold, the ranges overlap.
  CHECK(read_error(patch_entry(good, 1, entry_field(good, 0, 8), entry_field(good, 0, 16), entry_field(good, 0, 24))) ==
        "m.kiln: section 'meta' and section 'plan' overlap");
  // Bytes 0..32 of the header: the patch rewrites only the table checksum after them.
  CHECK(read_error(patch_entry(good, 1, 0, 32, fnv1a64(good.data(), 32))) ==
        "m.kiln: section 'plan' and the header overlap");
}

TEST_CASE("read_artifact refuses missing, duplicate and misnamed sections") {
  auto without = [](const std::string& name) {
    std::vector<TestSection> s;
    for (const auto& sec : sections())
      if (sec.name != name) s.push_back(sec);
    return build_artifact(s);
  };
  CHECK(read_error(without("meta")) == "m.kiln: missing section 'meta'");
  CHECK(read_error(without("plan")) == "m.kiln: missing section 'plan'");
  auto with = [](TestSection extra) {
    std::vector<TestSection> s = sections();
    s.push_back(std::move(extra));
    return build_artifact(s);
  };
  CHECK(read_error(with({kSectionImage, "sm_80.cubin", "again"})) == "m.kiln: two sections named 'sm_80.cubin'");
  CHECK(read_error(with({kSectionImage, "sm_80", "x"})) == "m.kiln: image section 'sm_80' is not named TARGET.FORM");
  CHECK(read_error(with({kSectionSource, "sm_90a.txt", "x"})) == "m.kiln: source section 'sm_90a.txt' is not named TARGET.cu");
  CHECK(read_error(with({kSectionMeta, "metadata", "a=b\n"})) == "m.kiln: section 'metadata' of kind meta must be named 'meta'");
  CHECK(read_error(with({kSectionImage, "", "x"})) == "m.kiln: section 6 has an empty or unterminated name");
  // Sections of kinds this reader does not know are skipped.
  std::string error;
  CHECK_MESSAGE(read_artifact(with({42, "future", "x"}), "m.kiln", &error), error);
}

TEST_CASE("read_artifact checks meta lines and the plan's references to the weights") {
  auto with_meta = [](const std::string& meta) {
    std::vector<TestSection> s = sections();
    s[0].bytes = meta;
    return build_artifact(s);
  };
  CHECK(read_error(with_meta("kiln_version=0.1.0\nnot a pair\n")) == "m.kiln: meta line 2: expected key=value");
  CHECK(read_error(with_meta("a=1\na=2\n")) == "m.kiln: meta key 'a' appears twice");
  CHECK(read_error(with_meta("format_version=2\n")) == "m.kiln: meta format_version '2' differs from the header's 1");
  CHECK(read_error(build_artifact(sections(kHead + "frob\n"))) == "m.kiln: plan:4: unknown line 'frob'");
  CHECK(read_error(build_artifact(sections(kPlan, std::string(100, 'w')))) ==
        "m.kiln: plan: buffer 3 (w): bytes [256, +12) outside the weights section of 100 bytes");
  std::string misaligned = kPlan;
  misaligned.replace(misaligned.find("offset=256 name=w"), 10, "offset=4  ");
  CHECK(read_error(build_artifact(sections(misaligned))) == "m.kiln: plan: buffer 3 (w): weight offset 4 is not 256-byte aligned");
}

TEST_CASE("read_artifact_file reads files and names the one it cannot read") {
  const std::string dir = (std::filesystem::temp_directory_path() / ("kiln-reader-" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/m.kiln", std::ios::binary) << build_artifact(sections());
  std::string error;
  CHECK_MESSAGE(read_artifact_file(dir + "/m.kiln", &error), error);
  CHECK(!read_artifact_file(dir + "/nope.kiln", &error));
  CHECK(error == "cannot read '" + dir + "/nope.kiln': No such file or directory");
  CHECK(!read_artifact_file(dir, &error));
  CHECK(error == "cannot read '" + dir + "': it is a directory");
  std::ofstream(dir + "/short.kiln", std::ios::binary) << "KILNART";
  CHECK(!read_artifact_file(dir + "/short.kiln", &error));
  CHECK(error == dir + "/short.kiln: truncated: 7 bytes, shorter than the 64-byte header");
  std::filesystem::remove_all(dir);
}

TEST_CASE("describe prints targets by name, as text and as JSON") {
  std::string error;
  auto a = read_artifact(build_artifact(sections()), "m.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  const std::string text = describe(*a, false);
  CHECK(text.find("targets: sm_80, sm_90a\n") != std::string::npos);
  CHECK(text.find("  sm_80.cubin: 7 bytes\n  compute_90a.ptx: 6 bytes\n  sm_80.cu: 6 bytes\n") != std::string::npos);
  CHECK(text.find("inputs:\n  x: f32[2, 3]\noutputs:\n  y: f32[2, 3]\n") != std::string::npos);
  CHECK(text.find("plan: steps 4 (1 copy, 1 gemm, 1 launch, 1 memset), kernels 1, buffers 6\n") != std::string::npos);
  CHECK(text.find("memory: weights 512 bytes, arena 1024 bytes, workspace 64 bytes\n") != std::string::npos);

  const std::string json = describe(*a, true);
  CHECK(json.starts_with("{\"format_version\": 1, \"meta\": {\"created_by\": \"kiln compile\", \"format_version\": \"1\", "));
  CHECK(json.find("\"targets\": [\"sm_80\", \"sm_90a\"]") != std::string::npos);
  CHECK(json.find("\"images\": [{\"name\": \"sm_80.cubin\", \"target\": \"sm_80\", \"form\": \"cubin\", \"bytes\": 7}, "
                  "{\"name\": \"compute_90a.ptx\", \"target\": \"compute_90a\", \"form\": \"ptx\", \"bytes\": 6}]") !=
        std::string::npos);
  CHECK(json.find("\"inputs\": [{\"name\": \"x\", \"buffer\": 0, \"dtype\": \"f32\", \"shape\": [2, 3], \"bytes\": 24}]") !=
        std::string::npos);
  CHECK(json.find("\"steps\": 4, \"kernels\": 1, \"weights_bytes\": 512, \"arena_bytes\": 1024, \"workspace_bytes\": 64}") !=
        std::string::npos);
}

TEST_CASE("describe falls back to the images' targets and escapes JSON strings") {
  std::vector<TestSection> s = sections();
  s[0].bytes = "pipeline=a \"quoted\"\\path\n";
  std::string error;
  auto a = read_artifact(build_artifact(s), "m.kiln", &error);
  REQUIRE_MESSAGE(a, error);
  const std::string json = describe(*a, true);
  CHECK(json.find("\"targets\": [\"compute_90a\", \"sm_80\"]") != std::string::npos);
  CHECK(json.find("\"pipeline\": \"a \\\"quoted\\\"\\\\path\"") != std::string::npos);
}
