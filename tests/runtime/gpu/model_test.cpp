// Runs hand-written artifacts on the GPU: NVRTC-compiled kernels (PTX and SASS), cuBLASLt gemms,
// copies, memsets and aliases, with CUDA graphs on and off; and the refusals (wrong arch,
// corrupt file, out of memory), each with its message.
#include <doctest/doctest.h>
#include <nvrtc.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "artifact_builder.h"
#include "common/compare.h"
#include "kiln/runtime.h"

namespace {

const char* const kKernels = R"(
extern "C" __global__ void add(const float* a, const float* b, float* c, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
extern "C" __global__ void axpb(const float* x, float* y, float a, float b, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b;
}
)";

/// The message of a failed status ("" for success); releases it.
std::string message(kiln_status* st) {
  std::string m = st ? kiln_status_get_message(st) : "";
  kiln_status_release(st);
  return m;
}

/// Runs `call` and returns {code, message}, releasing the status.
std::pair<kiln_status_code, std::string> outcome(kiln_status* st) {
  kiln_status_code code = kiln_status_get_code(st);
  return {code, message(st)};
}

kiln_runtime* make_runtime(int graphs, uint64_t limit = 0) {
  kiln_runtime_options o;
  kiln_runtime_options_initialize(&o);
  o.use_cuda_graphs = graphs;
  o.device_memory_limit = limit;
  kiln_runtime* rt = nullptr;
  std::string err = message(kiln_runtime_create(&o, &rt));
  INFO(err);
  REQUIRE(rt != nullptr);
  return rt;
}

/// "sm_90" → "90".
std::string arch_digits(kiln_runtime* rt) { return std::string(kiln_runtime_device_name(rt)).substr(3); }

/// Compiles kKernels for `arch` ("compute_90" → PTX, "sm_90" → cubin).
std::string nvrtc_compile(const std::string& arch) {
  nvrtcProgram prog = nullptr;
  REQUIRE(nvrtcCreateProgram(&prog, kKernels, "kernels.cu", 0, nullptr, nullptr) == NVRTC_SUCCESS);
  std::string opt = "--gpu-architecture=" + arch;
  const char* opts[] = {opt.c_str()};
  nvrtcResult r = nvrtcCompileProgram(prog, 1, opts);
  size_t log_size = 0;
  nvrtcGetProgramLogSize(prog, &log_size);
  std::string log(log_size, '\0');
  nvrtcGetProgramLog(prog, log.data());
  INFO(log);
  REQUIRE(r == NVRTC_SUCCESS);
  bool cubin = arch.rfind("sm_", 0) == 0;
  size_t size = 0;
  REQUIRE((cubin ? nvrtcGetCUBINSize(prog, &size) : nvrtcGetPTXSize(prog, &size)) == NVRTC_SUCCESS);
  std::string out(size, '\0');
  REQUIRE((cubin ? nvrtcGetCUBIN(prog, out.data()) : nvrtcGetPTX(prog, out.data())) == NVRTC_SUCCESS);
  nvrtcDestroyProgram(&prog);
  if (!cubin && !out.empty() && out.back() == '\0') out.pop_back();
  return out;
}

// Plan A: s = x + y (kernel); out = relu(s @ W + zeros + bias) (gemm with c, beta, bias_relu);
// z[0:16] = 0.5 s - 1, z[16:32] = 2 s + 1 through aliases (kernels); s_copy = s (copy).
const char* const kPlanA = R"(kiln-plan 1
arena bytes=1792
workspace bytes=1048576
buffer 0 kind=input dtype=f32 shape=4x8 bytes=128 offset=0 name=x
buffer 1 kind=input dtype=f32 shape=4x8 bytes=128 offset=256 name=y
buffer 2 kind=activation dtype=f32 shape=4x8 bytes=128 offset=512
buffer 3 kind=output dtype=f32 shape=4x3 bytes=48 offset=768 name=out
buffer 4 kind=output dtype=f32 shape=4x8 bytes=128 offset=1024 name=z
buffer 5 kind=output dtype=f32 shape=4x8 bytes=128 offset=1280 name=s_copy
buffer 6 kind=activation dtype=f32 shape=4x3 bytes=48 offset=1536
buffer 7 kind=weight dtype=f32 shape=8x3 bytes=96 offset=0 name=w
buffer 8 kind=weight dtype=f32 shape=3 bytes=12 offset=256 name=bias
buffer 9 kind=alias dtype=f32 shape=2x8 bytes=64 offset=64 base=2
buffer 10 kind=alias dtype=f32 shape=2x8 bytes=64 offset=64 base=4
input x buffer=0
input y buffer=1
output out buffer=3
output z buffer=4
output s_copy buffer=5
kernel add
kernel axpb
step launch kernel=add grid=1,1,1 block=32,1,1 smem=0 args=b0,b1,b2,i32
step memset dst=b6 bytes=48
step gemm a=b2 b=b7 d=b3 c=b6 bias=b8 m=4 n=3 k=8 batch=1 trans_a=0 trans_b=0 lda=8 ldb=3 ldd=3 ldc=3 stride_a=0 stride_b=0 stride_d=0 stride_c=0 dtype=f32 compute=f32 alpha=1 beta=1 epilogue=bias_relu
step launch kernel=axpb grid=1,1,1 block=64,1,1 smem=0 args=b2,b4,f0.5,f-1,i32
step launch kernel=axpb grid=1,1,1 block=16,1,1 smem=0 args=b9,b10,f2,f1,i16
step copy src=b2 dst=b5 bytes=128
)";

float weight_w(int k, int j) { return static_cast<float>(k - j) * 0.25f; }
float weight_bias(int j) { return static_cast<float>(j - 1); }

std::string weights_a() {
  std::string w(268, '\0');
  for (int k = 0; k < 8; ++k)
    for (int j = 0; j < 3; ++j) {
      float v = weight_w(k, j);
      std::memcpy(&w[static_cast<size_t>((k * 3 + j) * 4)], &v, 4);
    }
  for (int j = 0; j < 3; ++j) {
    float v = weight_bias(j);
    std::memcpy(&w[static_cast<size_t>(256 + j * 4)], &v, 4);
  }
  return w;
}

std::string artifact_a(const std::string& image_name, const std::string& image,
                       const std::string& plan = kPlanA) {
  return kiln::test::make_artifact(plan, {{image_name, image}}, weights_a());
}

struct Outputs {
  std::vector<float> out = std::vector<float>(12), z = std::vector<float>(32), s_copy = std::vector<float>(32);
};

Outputs run_a(kiln_model* m, const std::vector<float>& x, const std::vector<float>& y) {
  Outputs o;
  kiln_host_tensor in[2] = {{const_cast<float*>(x.data()), 128}, {const_cast<float*>(y.data()), 128}};
  kiln_host_tensor out[3] = {{o.out.data(), 48}, {o.z.data(), 128}, {o.s_copy.data(), 128}};
  std::string err = message(kiln_model_run(m, in, 2, out, 3));
  INFO(err);
  REQUIRE(err.empty());
  return o;
}

/// Checks the outputs with the shared comparator (NaN and misplaced infinities fail): the copy
/// and the kernels' z exactly, the f32 gemm + bias + relu against double host math.
void check_a(const Outputs& o, const std::vector<float>& x, const std::vector<float>& y) {
  std::vector<float> s(32), z(32);
  for (int i = 0; i < 32; ++i) s[i] = x[i] + y[i];
  for (int i = 0; i < 32; ++i) z[i] = i < 16 ? 0.5f * s[i] - 1 : 2 * s[i] + 1;
  std::vector<double> out(12);
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 3; ++j) {
      double acc = weight_bias(j);
      for (int k = 0; k < 8; ++k) acc += static_cast<double>(s[r * 8 + k]) * weight_w(k, j);
      out[r * 3 + j] = std::max(acc, 0.0);
    }
  const kiln::test::Verdict copy = kiln::test::allclose(s, o.s_copy, kiln::test::kExact);
  CHECK_MESSAGE(copy.ok(), ("s_copy: " + copy.why));
  const kiln::test::Verdict zv = kiln::test::allclose(z, o.z, kiln::test::kExact);
  CHECK_MESSAGE(zv.ok(), ("z: " + zv.why));
  const kiln::test::Verdict gemm = kiln::test::allclose(out, o.out, {1e-5, 1e-5});
  CHECK_MESSAGE(gemm.ok(), ("out: " + gemm.why));
}

std::vector<float> iota(float start, float step) {
  std::vector<float> v(32);
  for (int i = 0; i < 32; ++i) v[i] = start + step * static_cast<float>(i);
  return v;
}

kiln_model* load(kiln_runtime* rt, const std::string& bytes) {
  kiln_model* m = nullptr;
  std::string err = message(kiln_model_load_memory(rt, bytes.data(), bytes.size(), &m));
  INFO(err);
  REQUIRE(m != nullptr);
  return m;
}

}  // namespace

TEST_CASE("a PTX image runs kernels, a gemm, copy, memset and aliases; graphs on and off agree") {
  std::vector<float> x = iota(-3, 0.25f), y = iota(1, -0.125f), x2 = iota(2, 0.5f);
  std::vector<Outputs> results;
  for (int graphs : {0, 1}) {
    CAPTURE(graphs);
    kiln_runtime* rt = make_runtime(graphs);
    std::string ptx = nvrtc_compile("compute_" + arch_digits(rt));
    kiln_model* m = load(rt, artifact_a("compute_" + arch_digits(rt) + ".ptx", ptx));
    Outputs o = run_a(m, x, y);
    check_a(o, x, y);
    results.push_back(o);
    // A second run with new inputs: a replayed graph must read the new staging contents.
    check_a(run_a(m, x2, y), x2, y);
    kiln_model_release(m);
    kiln_runtime_release(rt);
  }
  CHECK(results[0].out == results[1].out);
  CHECK(results[0].z == results[1].z);
}

TEST_CASE("the per-step profile times every step and checks its arguments") {
  kiln_runtime* rt = make_runtime(1);
  kiln_model* m = load(rt, artifact_a("compute_" + arch_digits(rt) + ".ptx", nvrtc_compile("compute_" + arch_digits(rt))));
  const size_t n = kiln_model_num_steps(m);
  REQUIRE(n > 0);
  std::vector<double> ms(n, -1.0);
  kiln_status* st = kiln_model_profile_steps(m, 3, ms.data(), n);
  REQUIRE_MESSAGE(st == nullptr, kiln_status_get_message(st));
  for (double v : ms) CHECK(v >= 0.0);
  st = kiln_model_profile_steps(m, 3, ms.data(), n - 1);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kiln_status_get_message(st)).find("capacity") != std::string::npos);
  kiln_status_release(st);
  st = kiln_model_profile_steps(m, 0, ms.data(), n);
  CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
  kiln_status_release(st);
  // The model still runs normally afterwards.
  check_a(run_a(m, iota(-3, 0.25f), iota(1, -0.125f)), iota(-3, 0.25f), iota(1, -0.125f));
  kiln_model_release(m);
  kiln_runtime_release(rt);
}

TEST_CASE("a cubin for the device runs; inputs, outputs and memory are reported") {
  kiln_runtime* rt = make_runtime(1);
  std::string sm = kiln_runtime_device_name(rt);
  kiln_model* m = load(rt, artifact_a(sm + ".cubin", nvrtc_compile(sm)));
  REQUIRE(kiln_model_num_inputs(m) == 2);
  REQUIRE(kiln_model_num_outputs(m) == 3);
  kiln_tensor_info info;
  REQUIRE(message(kiln_model_input_info(m, 1, &info)).empty());
  CHECK(std::string(info.name) == "y");
  CHECK(info.dtype == KILN_DTYPE_F32);
  CHECK(info.rank == 2);
  CHECK(info.dims[0] == 4);
  CHECK(info.dims[1] == 8);
  CHECK(info.bytes == 128);
  REQUIRE(message(kiln_model_output_info(m, 0, &info)).empty());
  CHECK(std::string(info.name) == "out");
  CHECK(info.dims[1] == 3);
  CHECK(message(kiln_model_output_info(m, 3, &info)) == "kiln_model_output_info: index 3 out of range: the model has 3");

  std::vector<float> x = iota(0.5f, 1), y = iota(-2, 0.75f);
  check_a(run_a(m, x, y), x, y);

  kiln_memory_report r{};
  r.struct_size = sizeof r;
  REQUIRE(message(kiln_model_memory_report(m, &r)).empty());
  CHECK(r.weights == 268);
  CHECK(r.activations == 1792);
  CHECK(r.workspace == 1048576);
  CHECK(r.staging == 5 * 256);
  CHECK(r.allocated >= 512 + 2048 + 1048576);
  CHECK(r.reserved >= r.allocated);

  // A wrong input size is refused before anything runs.
  std::vector<float> out(12), z(32), sc(32);
  kiln_host_tensor in[2] = {{x.data(), 4}, {y.data(), 128}};
  kiln_host_tensor outs[3] = {{out.data(), 48}, {z.data(), 128}, {sc.data(), 128}};
  auto [code, msg] = outcome(kiln_model_run(m, in, 2, outs, 3));
  CHECK(code == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(msg == "kiln_model_run: input 'x' has 4 bytes, the model expects 128");
  CHECK(message(kiln_model_run(m, in, 1, outs, 3)) == "kiln_model_run: 1 input given, the model has 2");
  // Release order does not matter: the model keeps its runtime alive.
  kiln_runtime_release(rt);
  kiln_model_release(m);
}

namespace {

uint16_t to_bf16(float f) {  // exact for the small integers used here
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Plan B: a batched bf16 gemm with both operands transposed, alpha 2, no kernels at all.
// A stored [2][k=3][m=2], B stored [2][n=4][k=3], D [2][m=2][n=4].
const char* const kPlanB = R"(kiln-plan 1
arena bytes=1024
workspace bytes=0
buffer 0 kind=input dtype=bf16 shape=2x3x2 bytes=24 offset=0 name=a
buffer 1 kind=input dtype=bf16 shape=2x4x3 bytes=48 offset=256 name=b
buffer 2 kind=output dtype=bf16 shape=2x2x4 bytes=32 offset=512 name=d
input a buffer=0
input b buffer=1
output d buffer=2
step gemm a=b0 b=b1 d=b2 m=2 n=4 k=3 batch=2 trans_a=1 trans_b=1 lda=2 ldb=3 ldd=4 stride_a=6 stride_b=12 stride_d=8 dtype=bf16 compute=f32 alpha=2 beta=0 epilogue=none
)";

}  // namespace

TEST_CASE("a batched, transposed bf16 gemm matches host math; a plan without kernels needs no image") {
  for (int graphs : {0, 1}) {
    CAPTURE(graphs);
    kiln_runtime* rt = make_runtime(graphs);
    std::string bytes = kiln::test::make_artifact(kPlanB, {}, "");
    kiln_model* m = load(rt, bytes);
    std::vector<uint16_t> a(12), b(24), d(16);
    for (int i = 0; i < 12; ++i) a[i] = to_bf16(static_cast<float>(i % 5 - 2));
    for (int i = 0; i < 24; ++i) b[i] = to_bf16(static_cast<float>(i % 7 - 3));
    kiln_host_tensor in[2] = {{a.data(), 24}, {b.data(), 48}};
    kiln_host_tensor out[1] = {{d.data(), 32}};
    std::string err = message(kiln_model_run(m, in, 2, out, 1));
    INFO(err);
    REQUIRE(err.empty());
    // Small integers: exact in bf16, so exact here (the shared comparator: NaN fails too).
    std::vector<float> want(16), got(16);
    for (int bt = 0; bt < 2; ++bt)
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) {
          float acc = 0;
          for (int k = 0; k < 3; ++k)
            acc += from_bf16(a[bt * 6 + k * 2 + i]) * from_bf16(b[bt * 12 + j * 3 + k]);
          want[bt * 8 + i * 4 + j] = 2 * acc;
          got[bt * 8 + i * 4 + j] = from_bf16(d[bt * 8 + i * 4 + j]);
        }
    const kiln::test::Verdict v = kiln::test::allclose(want, got, kiln::test::kExact);
    CHECK_MESSAGE(v.ok(), v.why);
    kiln_model_release(m);
    kiln_runtime_release(rt);
  }
}

// A weight with two low-precision copies (a training step's optimizer keeps them): the step
// outputs the bf16 copy. No kernels: the state handling is the runtime's alone.
const char* const kPlanCopies = R"(kiln-plan 1
arena bytes=256
workspace bytes=0
buffer 0 kind=input dtype=f32 shape=2 bytes=8 offset=0 name=x
buffer 1 kind=output dtype=bf16 shape=2 bytes=4 offset=128 name=y
buffer 2 kind=weight dtype=f32 shape=2 bytes=8 offset=0 name=w
buffer 3 kind=weight dtype=bf16 shape=2 bytes=4 offset=64 name=w.bf16
buffer 4 kind=weight dtype=f8e4m3fn shape=2 bytes=2 offset=128 name=w.fp8
input x buffer=0
output y buffer=1
variable w buffer=2
variable w.bf16 buffer=3 copy_of=w
variable w.fp8 buffer=4 copy_of=w
step copy src=b3 dst=b1 bytes=4
)";

TEST_CASE("a weight's low-precision copies follow it: refreshed on write, never written alone, never run stale") {
  kiln_runtime* rt = make_runtime(0);
  std::string weights(130, '\0');
  const float w0[2] = {1.0f, -0.5f};
  const uint16_t c0[2] = {0x3f80, 0xbf00};
  std::memcpy(weights.data(), w0, 8);
  std::memcpy(weights.data() + 64, c0, 4);
  kiln_model* m = load(rt, kiln::test::make_artifact(kPlanCopies, {}, weights));
  REQUIRE(kiln_model_num_variables(m) == 3);
  float x[2] = {0, 0};
  uint16_t y[2] = {0, 0};
  kiln_host_tensor in[1] = {{x, 8}};
  kiln_host_tensor out[1] = {{y, 4}};
  REQUIRE(message(kiln_model_run(m, in, 1, out, 1)).empty());
  CHECK(y[0] == 0x3f80);
  // A copy alone would no longer be its weight's.
  const uint16_t bad[2] = {0, 0};
  auto [code, why] = outcome(kiln_model_write_variable(m, 1, bad, 4));
  CHECK(code == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(why == "kiln_model_write_variable: variable 'w.bf16' is the low-precision copy of 'w' that the training step "
               "keeps: write that weight (its bf16/f16 copies follow it), then, for other copies, this one");
  // Writing the weight refreshes the bf16 copy on the spot; the f8 copy (its scale is another
  // variable) must be written next, or the run is refused.
  const float w1[2] = {3.0f, 1e-3f};
  REQUIRE(message(kiln_model_write_variable(m, 0, w1, 8)).empty());
  uint16_t c1[2] = {0, 0};
  REQUIRE(message(kiln_model_read_variable(m, 1, c1, 4)).empty());
  CHECK(c1[0] == 0x4040);
  CHECK(c1[1] == 0x3a83);
  auto [stale_code, stale] = outcome(kiln_model_run(m, in, 1, out, 1));
  CHECK(stale_code == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(stale == "kiln_model_run: variable 'w.fp8' is a copy of 'w', which was written without it: write the copy "
                 "too (after its weight), as the checkpoint that holds the weight holds it");
  const uint8_t q[2] = {0x48, 0x01};
  REQUIRE(message(kiln_model_write_variable(m, 2, q, 2)).empty());
  REQUIRE(message(kiln_model_run(m, in, 1, out, 1)).empty());
  CHECK(y[0] == 0x4040);
  CHECK(y[1] == 0x3a83);
  // After a run a copy is its weight's again: writing it alone is refused once more.
  CHECK(outcome(kiln_model_write_variable(m, 2, q, 2)).first == KILN_STATUS_INVALID_ARGUMENT);
  kiln_model_release(m);
  kiln_runtime_release(rt);
}

TEST_CASE("an artifact without an image for the device is refused naming both") {
  kiln_runtime* rt = make_runtime(1);
  std::string device = kiln_runtime_device_name(rt);
  // SASS never crosses majors: an sm_100a-only artifact cannot run on sm_90, and vice versa.
  std::string other = device.rfind("sm_10", 0) == 0 ? "sm_90a" : "sm_100a";
  kiln_model* m = nullptr;
  std::string bytes = artifact_a(other + ".cubin", "not loaded");
  auto [code, msg] = outcome(kiln_model_load_memory(rt, bytes.data(), bytes.size(), &m));
  CHECK(m == nullptr);
  CHECK(code == KILN_STATUS_UNSUPPORTED);
  CHECK(msg == "artifact has " + other + "; device is " + device);
  kiln_runtime_release(rt);
}

TEST_CASE("corrupt, truncated, foreign and missing files are refused") {
  kiln_runtime* rt = make_runtime(1);
  std::string digits = arch_digits(rt);
  std::string good = artifact_a("compute_" + digits + ".ptx", nvrtc_compile("compute_" + digits));
  kiln_model* m = nullptr;

  std::string corrupt = good;
  size_t at = corrupt.find("kiln-plan 1");
  REQUIRE(at != std::string::npos);
  corrupt[at + 5] = 'P';
  auto [code, msg] = outcome(kiln_model_load_memory(rt, corrupt.data(), corrupt.size(), &m));
  CHECK(code == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(msg == "<memory>: corrupt section 'plan' (checksum mismatch)");

  std::string truncated = good.substr(0, good.size() - 10);
  std::tie(code, msg) = outcome(kiln_model_load_memory(rt, truncated.data(), truncated.size(), &m));
  CHECK(code == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(msg == "<memory>: truncated: " + std::to_string(truncated.size()) + " bytes, header says " +
                   std::to_string(good.size()));

  std::tie(code, msg) = outcome(kiln_model_load_memory(rt, "hello", 5, &m));
  CHECK(msg == "<memory>: not a Kiln artifact (bad magic)");

  std::tie(code, msg) = outcome(kiln_model_load_file(rt, "/nonexistent/model.kiln", &m));
  CHECK(code == KILN_STATUS_NOT_FOUND);
  CHECK(msg == "cannot open '/nonexistent/model.kiln': No such file or directory");
  CHECK(m == nullptr);

  // The good bytes load from a file too.
  std::string path = "runtime_gpu_test_model.kiln";
  std::ofstream(path, std::ios::binary) << good;
  REQUIRE(message(kiln_model_load_file(rt, path.c_str(), &m)).empty());
  kiln_model_release(m);
  std::remove(path.c_str());

  // An image that is not one: the driver refuses it and the message says which image.
  std::string sm = kiln_runtime_device_name(rt);
  std::string garbage = artifact_a(sm + ".cubin", std::string(256, 'x'));
  std::tie(code, msg) = outcome(kiln_model_load_memory(rt, garbage.data(), garbage.size(), &m));
  CHECK(code == KILN_STATUS_INVALID_ARGUMENT);
  INFO("message: ", msg);
  // Depending on lazy loading, the driver refuses it at load or at the first kernel lookup.
  CHECK(msg.find("loading image '" + sm + ".cubin'") != std::string::npos);
  CHECK((msg.find("cudaLibraryLoadData failed") != std::string::npos ||
         msg.find("the driver refused it") != std::string::npos));
  CHECK(m == nullptr);

  // A kernel the plan declares but the image lacks.
  std::string plan = kPlanA;
  plan.replace(plan.find("kernel axpb\n"), 12, "kernel axpb\nkernel missing\n");
  std::string lacking = artifact_a("compute_" + digits + ".ptx", nvrtc_compile("compute_" + digits), plan);
  m = nullptr;
  std::tie(code, msg) = outcome(kiln_model_load_memory(rt, lacking.data(), lacking.size(), &m));
  CHECK(code == KILN_STATUS_INVALID_ARGUMENT);
  CHECK(msg.rfind("image 'compute_" + digits + ".ptx' has no kernel 'missing': cudaLibraryGetKernel failed: ", 0) == 0);
  kiln_runtime_release(rt);
}

TEST_CASE("out of memory names the request, the device and Kiln's allocated and reserved bytes") {
  {
    // device_memory_limit: weights (512) and arena (2 KiB) fit in 1 MiB, the workspace does not.
    kiln_runtime* rt = make_runtime(1, 1 << 20);
    std::string digits = arch_digits(rt);
    std::string bytes = artifact_a("compute_" + digits + ".ptx", nvrtc_compile("compute_" + digits));
    kiln_model* m = nullptr;
    auto [code, msg] = outcome(kiln_model_load_memory(rt, bytes.data(), bytes.size(), &m));
    CHECK(m == nullptr);
    CHECK(code == KILN_STATUS_OUT_OF_MEMORY);
    INFO(msg);
    CHECK(msg.rfind("out of memory: cannot allocate 1.00 MiB (1048576 bytes) for workspace (it would exceed "
                    "device_memory_limit 1.00 MiB (1048576 bytes)); device total ", 0) == 0);
    CHECK(msg.find(", free ") != std::string::npos);
    CHECK(msg.find("; kiln allocated 2.50 KiB (2560 bytes), reserved 2.50 KiB (2560 bytes)") != std::string::npos);
    kiln_runtime_release(rt);
  }
  {
    // An arena larger than any device: cudaMalloc itself fails.
    kiln_runtime* rt = make_runtime(1);
    std::string plan = R"(kiln-plan 1
arena bytes=1099511627776
workspace bytes=0
buffer 0 kind=input dtype=f32 shape=4 bytes=16 offset=0 name=x
buffer 1 kind=output dtype=f32 shape=4 bytes=16 offset=256 name=y
input x buffer=0
output y buffer=1
step copy src=b0 dst=b1 bytes=16
)";
    std::string bytes = kiln::test::make_artifact(plan, {}, "");
    kiln_model* m = nullptr;
    auto [code, msg] = outcome(kiln_model_load_memory(rt, bytes.data(), bytes.size(), &m));
    CHECK(code == KILN_STATUS_OUT_OF_MEMORY);
    INFO(msg);
    CHECK(msg.rfind("out of memory: cannot allocate 1.00 TiB (1099511627776 bytes) for activations "
                    "(cudaMalloc failed); device total ", 0) == 0);
    CHECK(msg.find("; kiln allocated 0 bytes, reserved 0 bytes") != std::string::npos);
    // The runtime stays usable after the failure.
    plan.replace(plan.find("1099511627776"), 13, "512");
    bytes = kiln::test::make_artifact(plan, {}, "");
    m = load(rt, bytes);
    std::vector<float> x = {1, 2, 3, 4}, y(4);
    kiln_host_tensor in = {x.data(), 16}, out = {y.data(), 16};
    REQUIRE(message(kiln_model_run(m, &in, 1, &out, 1)).empty());
    CHECK(y == x);
    kiln_model_release(m);
    kiln_runtime_release(rt);
  }
}
