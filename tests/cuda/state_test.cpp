// Tests of the CUDA lowering of persistent state (variable/assign) and amax: variables become
// weight buffers holding their init, assigns copies at the very end of the plan, amax one
// kernel into a zeroed f32; the FP8 delayed-scaling graph lowers and compiles with NVRTC.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/cuda/lowering.h"
#include "kiln/cuda/nvrtc.h"
#include "kiln/ir/text.h"
#include "lowering_test_util.h"
#include "state_graphs.h"

namespace kiln::cuda {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// "buffer N kind=... name=NAME" lines by name: the buffer id and the whole line.
bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// The integer after "key=" in a plan line.
int64_t field(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + "=");
  REQUIRE(at != std::string::npos);
  return std::stoll(line.substr(at + key.size() + 2));
}

TEST_CASE("state: the FP8 delayed-scaling graph lowers to weight-section state updated at the end of the plan") {
  const LoweredGraph l = lower_text(read_text(std::string(KILN_SOURCE_DIR) + "/tests/cuda/fp8_delayed.kir"));
  auto bufs = named_buffers(l.plan);
  for (const char* name : {"x.amax_history", "x.scale", "a.amax_history", "a.scale", "fp8.step"}) {
    CAPTURE(name);
    REQUIRE(bufs.count(name));
    CHECK(has(bufs[name].second, " kind=weight "));
  }
  // The weights section holds the init values: scales start at 1, histories and the step at 0.
  float scale = 0;
  std::memcpy(&scale, l.weights.data() + field(bufs["x.scale"].second, "offset"), 4);
  CHECK(scale == 1.0f);
  const std::vector<std::string> steps = plan_lines(l.plan, "step ");
  REQUIRE(steps.size() >= 3);
  // The last three steps are the assigns of the step counter and the scales, each a copy: both
  // are read after their new values are computed.
  std::vector<std::string> assigned;
  for (size_t i = steps.size() - 3; i < steps.size(); ++i) {
    CHECK(steps[i].rfind("step copy ", 0) == 0);
    for (const auto& [name, b] : bufs)
      if (has(steps[i], " dst=" + b.first + " ")) assigned.push_back(name);
  }
  CHECK(assigned == std::vector<std::string>{"fp8.step", "x.scale", "a.scale"});
  // The new amax histories (concats written after the slices that read the old ones) are written
  // in the variables' buffers: views of them.
  CHECK(has(bufs["2"].second, " kind=alias "));
  CHECK(has(bufs["2"].second, " base=" + bufs["x.amax_history"].first.substr(1)));
  CHECK(has(bufs["9"].second, " kind=alias "));
  CHECK(has(bufs["9"].second, " base=" + bufs["a.amax_history"].first.substr(1)));
  // Nothing else writes state: no earlier step names a variable's buffer as a copy destination.
  for (size_t i = 0; i + 3 < steps.size(); ++i)
    for (const char* name : {"x.amax_history", "x.scale", "a.amax_history", "a.scale", "fp8.step"})
      CHECK_FALSE(has(steps[i], " dst=" + bufs[name].first + " "));
  // Both GEMMs read their activation scale from the state buffer at run time.
  int gemms = 0;
  for (const std::string& s : steps)
    if (s.rfind("step gemm ", 0) == 0) {
      ++gemms;
      CHECK((has(s, " a_scale=" + bufs["x.scale"].first) || has(s, " a_scale=" + bufs["a.scale"].first)));
    }
  CHECK(gemms == 2);
  // Each history roll (a concat of 1 and 3 elements) is one kernel, not a copy per input.
  int concats = 0;
  for (const std::string& k : l.kernels) concats += has(k, "_concat");
  CHECK(concats == 2);
  CHECK(has(l.source, "if (a >= 1LL && a < 4LL) y[i] = x1[(o * 3LL + a - 1LL) * 1LL + e];"));
  // amax: a memset of the f32 result, then its kernel.
  int amax = 0;
  for (const std::string& k : l.kernels) amax += has(k, "_amax");
  CHECK(amax == 2);
  CHECK(plan_lines(l.plan, "step memset ").size() >= 2);
  for (const char* target : {"sm_90a", "sm_100a"}) {
    CAPTURE(target);
    auto image = compile_cuda(l.source, target, "test@0");
    CHECK_MESSAGE(image.ok(), image.status().message());
  }
}

TEST_CASE("state: assigns between variables read the values from before the run") {
  // a and b swap every run: each source is copied aside before either variable is written.
  const LoweredGraph l = lower_text(R"(graph @swap(%x: f32[2]) -> (f32[2], f32[2]) {
  %a = variable() {init = dense<f32[2]>[1.0, 2.0], name = "a"} : f32[2]
  %b = variable() {init = dense<f32[2]>[3.0, 4.0], name = "b"} : f32[2]
  assign(%b) {name = "a"}
  assign(%a) {name = "b"}
  %y = add(%a, %x) : f32[2]
  return %y, %b
}
)");
  INFO(l.plan);
  // Variables are the weight buffers (the output copy of %b is named b too).
  std::map<std::string, std::string> vars;
  for (const std::string& line : plan_lines(l.plan, "buffer "))
    if (has(line, " kind=weight ")) vars[line.substr(line.find(" name=") + 6)] = "b" + line.substr(7, line.find(' ', 7) - 7);
  const std::string a = vars.at("a"), b = vars.at("b");
  const std::vector<std::string> steps = plan_lines(l.plan, "step ");
  REQUIRE(steps.size() >= 5);
  const size_t n = steps.size();
  // The output %b is copied out first, then both sources go aside, then both land.
  CHECK(has(steps[n - 5], "step copy src=" + b + " "));
  CHECK(has(steps[n - 4], "step copy src=" + b + " "));
  CHECK(has(steps[n - 3], "step copy src=" + a + " "));
  CHECK(has(steps[n - 2], " dst=" + a + " "));
  CHECK(has(steps[n - 1], " dst=" + b + " "));
  CHECK_FALSE(has(steps[n - 2], "src=" + b + " "));
  // Each variable's buffer is named on a variable line, for the runtime's state API.
  CHECK(plan_lines(l.plan, "variable ") == std::vector<std::string>{"variable a buffer=" + a.substr(1),
                                                                     "variable b buffer=" + b.substr(1)});
}

TEST_CASE("state: an update computed elementwise after the old value's last reader is written in place") {
  const LoweredGraph l = lower_text(in_place_update_graph(256));
  INFO(l.plan);
  auto bufs = named_buffers(l.plan);
  std::map<std::string, std::string> vars;
  for (const std::string& line : plan_lines(l.plan, "variable "))
    vars[line.substr(9, line.find(' ', 9) - 9)] = "b" + line.substr(line.find("buffer=") + 7);
  REQUIRE(vars.size() == 3);
  // m2 and w2 live in m's and w's buffers: views of them, no copies. u is read after its
  // update, so u2 gets a buffer of its own and one copy at the end.
  for (const char* v : {"m2", "w2"}) {
    CAPTURE(v);
    REQUIRE(bufs.count(v));
    CHECK(has(bufs[v].second, " kind=alias "));
  }
  CHECK(has(bufs["m2"].second, " base=" + vars["m"].substr(1)));
  CHECK(has(bufs["w2"].second, " base=" + vars["w"].substr(1)));
  CHECK(has(bufs["u2"].second, " kind=activation "));
  const std::vector<std::string> copies = plan_lines(l.plan, "step copy ");
  REQUIRE(copies.size() == 1);
  CHECK(has(copies[0], "step copy src=" + bufs["u2"].first + " dst=" + vars["u"] + " "));
  compiles_everywhere(l);
}

TEST_CASE("state: an update stays a copy when the old value is an output or a non-elementwise read") {
  // w is returned as it was before the run (the output copy reads it at the end); v's new value
  // comes from a kernel that also reads v's first element (a view of v) for every element.
  const LoweredGraph l = lower_text(R"(graph @step(%x: f32[4]) -> (f32[4]) {
  %w = variable() {init = dense<f32[4]>[0.5, 0.5, 0.5, 0.5], name = "w"} : f32[4]
  %v = variable() {init = dense<f32[4]>[1.0, 1.0, 1.0, 1.0], name = "v"} : f32[4]
  %w2 = add(%w, %x) : f32[4]
  assign(%w2) {name = "w"}
  %v0, %v1 = split(%v) {axis = 0, sizes = [1, 3]} : f32[1], f32[3]
  %v2 = add(%v, %v0) : f32[4]
  assign(%v2) {name = "v"}
  return %w
}
)");
  INFO(l.plan);
  CHECK(plan_lines(l.plan, "step copy ").size() == 3);  // the output and both assigns
  auto bufs = named_buffers(l.plan);
  CHECK_FALSE(has(bufs["w2"].second, " kind=alias "));
  CHECK_FALSE(has(bufs["v2"].second, " kind=alias "));
}

TEST_CASE("state: delayed_scaling_update of every tensor is one kernel at the end of the plan, in place") {
  const LoweredGraph l = lower_text(scale_update_graph());
  INFO(l.plan);
  std::map<std::string, std::string> vars;
  for (const std::string& line : plan_lines(l.plan, "variable "))
    vars[line.substr(9, line.find(' ', 9) - 9)] = "b" + line.substr(line.find("buffer=") + 7);
  REQUIRE(vars.size() == 6);
  const std::vector<std::string> steps = plan_lines(l.plan, "step ");
  std::vector<size_t> updates;
  for (size_t i = 0; i < steps.size(); ++i)
    if (has(steps[i], "_delayed_scaling ")) updates.push_back(i);
  // t2's new scale is also an output: its update runs where it stands, into activations that
  // two copies assign. t0's and t1's run last, one block each, on the variables themselves.
  REQUIRE(updates.size() == 2);
  CHECK(has(steps[updates[0]], " grid=1,1,1 "));
  CHECK(updates[1] == steps.size() - 1);
  CHECK(has(steps.back(), " grid=2,1,1 "));
  for (const char* v : {"t0.h", "t0.s", "t1.h", "t1.s"}) {
    CAPTURE(v);
    CHECK(has(steps.back() + ",", "," + vars[v] + ","));
    for (const std::string& c : plan_lines(l.plan, "step copy ")) CHECK_FALSE(has(c + " ", " dst=" + vars[v] + " "));
  }
  int copies_to_t2 = 0;
  for (const std::string& c : plan_lines(l.plan, "step copy "))
    copies_to_t2 += has(c + " ", " dst=" + vars["t2.h"] + " ") + has(c + " ", " dst=" + vars["t2.s"] + " ");
  CHECK(copies_to_t2 == 2);
  // The histories roll from their last chunk down (600 elements: three chunks of a block).
  CHECK(has(l.source, "kiln_delayed_scaling(a0, h0, h0, 16, s0, s0, 0x1.24924ap-10f, false, nullptr)"));
  compiles_everywhere(l);
}

TEST_CASE("state: amax of an f32 tensor is one kernel; an assign without its variable is refused") {
  const LoweredGraph l = lower_text(R"(graph @m(%x: f32[3, 500]) -> (f32[]) {
  %m = amax(%x) : f32[]
  return %m
}
)");
  CHECK(has(l.source, "atomicMax"));
  CHECK(plan_lines(l.plan, "step memset ").size() == 1);
  auto image = compile_cuda(l.source, "sm_90a", "test@0");
  CHECK_MESSAGE(image.ok(), image.status().message());

  // Built by hand (the verifier would refuse it): the lowering names what is missing.
  Graph g;
  Value* x = g.add_input("x", TensorType{DType::kF32, {2}});
  auto as = g.create_node("assign", {x}, {}, {{"name", Attribute("v")}});
  REQUIRE(as.ok());
  g.set_outputs({x});
  auto r = lower_graph(g);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == "cuda: assign: no variable named 'v' in this graph");
}

}  // namespace
}  // namespace kiln::cuda
