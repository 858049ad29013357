// kiln_model_enqueue / kiln_model_synchronize / kiln_model_device_time on the GPU, with CUDA
// graphs on and off, on a kernel-free plan (copies and a memset: no NVRTC needed).
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "artifact_builder.h"
#include "kiln/runtime.h"

namespace {

// y = x (copy), z = 0 (memset).
const char* const kCopyPlan = R"(kiln-plan 1
arena bytes=1024
workspace bytes=0
buffer 0 kind=input dtype=f32 shape=4x8 bytes=128 offset=0 name=x
buffer 1 kind=output dtype=f32 shape=4x8 bytes=128 offset=256 name=y
buffer 2 kind=output dtype=f32 shape=4 bytes=16 offset=512 name=z
input x buffer=0
output y buffer=1
output z buffer=2
step copy src=b0 dst=b1 bytes=128
step memset dst=b2 bytes=16
)";

std::string message_of(kiln_status* st) {
  std::string m = st ? kiln_status_get_message(st) : "";
  kiln_status_release(st);
  return m;
}

struct Loaded {
  kiln_runtime* rt = nullptr;
  kiln_model* model = nullptr;
  ~Loaded() {
    kiln_model_release(model);
    kiln_runtime_release(rt);
  }
};

void load(Loaded& l, int graphs, int timing) {
  kiln_runtime_options o;
  kiln_runtime_options_initialize(&o);
  o.use_cuda_graphs = graphs;
  o.enable_timing = timing;
  std::string err = message_of(kiln_runtime_create(&o, &l.rt));
  INFO(err);
  REQUIRE(l.rt != nullptr);
  const std::string bytes = kiln::test::make_artifact(kCopyPlan, {}, "");
  err = message_of(kiln_model_load_memory(l.rt, bytes.data(), bytes.size(), &l.model));
  INFO(err);
  REQUIRE(l.model != nullptr);
}

}  // namespace

TEST_CASE("enqueue then synchronize delivers the outputs; a second enqueue completes the first") {
  for (int graphs : {0, 1})
    for (int timing : {0, 1}) {
      CAPTURE(graphs);
      CAPTURE(timing);
      Loaded l;
      load(l, graphs, timing);
      std::vector<float> x1(32), x2(32), y1(32, -1), y2(32, -1), z(4, 7);
      for (int i = 0; i < 32; ++i) x1[i] = static_cast<float>(i), x2[i] = static_cast<float>(100 - i);
      kiln_host_tensor in1[1] = {{x1.data(), 128}}, in2[1] = {{x2.data(), 128}};
      kiln_host_tensor out1[2] = {{y1.data(), 128}, {z.data(), 16}}, out2[2] = {{y2.data(), 128}, {z.data(), 16}};
      CHECK(message_of(kiln_model_synchronize(l.model)).empty());  // nothing pending: no-op
      REQUIRE(message_of(kiln_model_enqueue(l.model, in1, 1, out1, 2)).empty());
      x1.assign(32, 55);  // the inputs were staged: the caller may reuse them at once
      REQUIRE(message_of(kiln_model_enqueue(l.model, in2, 1, out2, 2)).empty());
      for (int i = 0; i < 32; ++i) CHECK(y1[i] == static_cast<float>(i));  // completed by the second enqueue
      REQUIRE(message_of(kiln_model_synchronize(l.model)).empty());
      for (int i = 0; i < 32; ++i) CHECK(y2[i] == static_cast<float>(100 - i));
      for (float v : z) CHECK(v == 0);
      double ms = -1;
      std::string err = message_of(kiln_model_device_time(l.model, &ms));
      if (timing) {
        CHECK(err.empty());
        CHECK(ms >= 0);
      } else {
        CHECK(err == "kiln_model_device_time: the runtime was created without enable_timing");
      }
    }
}

TEST_CASE("device time before any run, and enqueue argument errors, are refused with messages") {
  Loaded l;
  load(l, 1, 1);
  double ms = 0;
  CHECK(message_of(kiln_model_device_time(l.model, &ms)) == "kiln_model_device_time: no timed run has completed yet");
  std::vector<float> x(32), y(32), z(4);
  kiln_host_tensor in[1] = {{x.data(), 124}};
  kiln_host_tensor out[2] = {{y.data(), 128}, {z.data(), 16}};
  CHECK(message_of(kiln_model_enqueue(l.model, in, 1, out, 2)) ==
        "kiln_model_enqueue: input 'x' has 124 bytes, the model expects 128");
  in[0].bytes = 128;
  CHECK(message_of(kiln_model_enqueue(l.model, in, 1, out, 1)) ==
        "kiln_model_enqueue: 1 output given, the model has 2");
  REQUIRE(message_of(kiln_model_run(l.model, in, 1, out, 2)).empty());
  CHECK(message_of(kiln_model_device_time(l.model, &ms)).empty());
}

TEST_CASE("timed runs with the L2 sweep and without the lead-in stay correct; bad timing variables are refused") {
  struct Env {  // clears the two variables on every exit (the suite never sets them otherwise)
    ~Env() {
      unsetenv("KILN_TIMING_LEAD_US");
      unsetenv("KILN_TIMING_FLUSH_L2");
    }
  } env;
  for (const char* lead : {"0", "20"}) {
    CAPTURE(lead);
    setenv("KILN_TIMING_LEAD_US", lead, 1);
    setenv("KILN_TIMING_FLUSH_L2", "1", 1);
    Loaded l;
    load(l, 1, 1);
    std::vector<float> x(32), y(32, -1), z(4, 7);
    for (int i = 0; i < 32; ++i) x[i] = static_cast<float>(3 * i);
    kiln_host_tensor in[1] = {{x.data(), 128}};
    kiln_host_tensor out[2] = {{y.data(), 128}, {z.data(), 16}};
    for (int run = 0; run < 2; ++run) REQUIRE(message_of(kiln_model_run(l.model, in, 1, out, 2)).empty());
    for (int i = 0; i < 32; ++i) CHECK(y[i] == static_cast<float>(3 * i));
    double ms = -1;
    CHECK(message_of(kiln_model_device_time(l.model, &ms)).empty());
    CHECK(ms >= 0);
  }
  const std::pair<const char*, const char*> bad[] = {
      {"KILN_TIMING_LEAD_US", "fifty"}, {"KILN_TIMING_LEAD_US", "-3"}, {"KILN_TIMING_FLUSH_L2", "yes"}};
  for (const auto& [name, value] : bad) {
    CAPTURE(name);
    CAPTURE(value);
    unsetenv("KILN_TIMING_LEAD_US");
    unsetenv("KILN_TIMING_FLUSH_L2");
    setenv(name, value, 1);
    kiln_runtime_options o;
    kiln_runtime_options_initialize(&o);
    o.enable_timing = 1;
    Loaded l;
    REQUIRE(message_of(kiln_runtime_create(&o, &l.rt)).empty());
    const std::string bytes = kiln::test::make_artifact(kCopyPlan, {}, "");
    kiln_status* st = kiln_model_load_memory(l.rt, bytes.data(), bytes.size(), &l.model);
    CHECK(kiln_status_get_code(st) == KILN_STATUS_INVALID_ARGUMENT);
    const std::string msg = message_of(st);
    CHECK(msg.find(name) != std::string::npos);
    CHECK(msg.find(std::string("'") + value + "'") != std::string::npos);
    CHECK(l.model == nullptr);
  }
}
